"""Flattening snapshot chains (issue #3): in the modes that map page images, a snapshot of a
clone references its ancestors' page files; past BUNSHIN_MAX_SNAPSHOT_DEPTH the new snapshot
takes those files over and rewrites its CRIU images, so it needs no other snapshot. Real CRIU,
real workspaces: the flattened snapshot forks clones equal to their source after every
ancestor is deleted, and its images (decoded by CRIU's own pycriu) name no other snapshot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from fork_programs import host
from fork_programs.host import heap, sh

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.errors import SnapshotError
from bunshin_gym.workspace.snapshot import Snapshot, SnapshotStore
from bunshin_gym.workspace.snapshots import flatten

PORT = 7011
MB = 24


def _foreign_names(snap: Snapshot) -> list[str]:
    """Paths of other snapshots that the snapshot's CRIU images name: reg-file entries decoded
    with pycriu, and a raw byte search of every image but the page contents (pages-*.img hold
    the programs' memory, whatever it contains)."""
    names = [r["name"] for r in flatten.references(snap.criu_dir, snap.id)]
    for f in sorted(snap.criu_dir.glob("*.img")):
        if f.name.startswith("pages-"):
            continue
        for m in re.finditer(rb"/\.snap/(snap-[0-9a-f]{8})", f.read_bytes()):
            if m.group(1).decode() != snap.id:
                names.append(f"{f.name}: {m.group(0).decode()}")
    return names


def _crit_reg_names(snap: Snapshot) -> list[str]:
    """The reg-file paths of files.img as CRIU's crit shows them (criu/pycriu.sh installs it)."""
    env = dict(os.environ, PYTHONPATH=str(paths().criu_prefix / "lib" / "python"))
    out = subprocess.run([sys.executable, "-m", "crit", "show", str(snap.criu_dir / "files.img")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return [e["reg"]["name"] for e in json.loads(out.stdout)["entries"] if e["type"] == "REG"]


def _check_clone(c: Workspace, level: int, mutations: list[str], files: str | None = None) -> None:
    """The clone has every level's changes; its heap process keeps working."""
    assert c.read_file("/root/chain") == "".join(f"{i}\n" for i in range(level + 1)).encode()
    assert heap(c, PORT, "sha") == host.heap_expected(MB, "flatten", *mutations)
    assert heap(c, PORT, "get") == str(level)
    tree = " ".join(host.proc_tree(c))
    for i in range(1, level + 1):
        assert f"sleep {5000 + i}" in tree, f"{c.id}: level {i}'s process is gone"
    if files is not None:
        assert host.fs_state(c) == files
    assert heap(c, PORT, "incr") == str(level + 1)  # the running process keeps serving


@pytest.mark.parametrize("mode", ["share", "map-anon"])
def test_chain_is_flattened_at_the_depth_limit(mode, monkeypatch):
    """snapshot -> fork -> modify, four levels with the limit at 2: the 4th snapshot would
    reference 3 ancestors and is flattened; it forks correct clones after all ancestors are gone."""
    monkeypatch.setenv("BUNSHIN_MAX_SNAPSHOT_DEPTH", "2")
    ws = Workspace.create("base", memory_mode=mode)
    opened, snaps = [ws], []
    try:
        host.heap_start(ws, PORT, MB, "flatten")
        sh(ws, "echo 0 > /root/chain")
        current, mutations = ws, []
        for level in range(4):
            files = host.fs_state(current)
            snap = current.snapshot(tags={"level": level})
            snaps.append(snap)
            print(f"\n[{mode}] level {level}: {snap.id} ref_depth={snap.meta['ref_depth']} "
                  f"refs={snap.meta.get('refs')} frozen={snap.meta['timings']['frozen_ms']} ms "
                  f"flatten={snap.meta['timings'].get('flatten_ms')} ms")
            if level == 3:
                break
            [clone] = snap.fork(1)
            opened.append(clone)
            # modify, for the next level: files, memory, a new process
            sh(clone, f"echo {level + 1} >> /root/chain")
            heap(clone, PORT, "incr")
            mutations.append(f"level{level + 1}")
            heap(clone, PORT, "mutate", mutations[-1])
            clone.spawn(["sleep", str(5000 + level + 1)])
            current = clone

        s0, s1, s2, s3 = snaps
        assert [s.meta["ref_depth"] for s in snaps] == [0, 1, 2, 0]
        assert [s.depth for s in snaps] == [0, 1, 2, 3] and s3.parent == s2.id  # lineage is kept
        # before the limit the chain references its ancestors' page files, by path
        assert {r["holder"] for r in flatten.references(s2.criu_dir, s2.id)} == {s0.id, s1.id}
        assert s2.meta["refs"] == sorted([s0.id, s1.id])
        # the flattened one took them over and names no other snapshot
        info = s3.meta["flattened"]
        print(f"[{mode}] flattened {s3.id}: {len(info['files'])} files, {info['bytes'] / 2**20:.1f} MiB, "
              f"{info['ms']} ms, {sorted({f['how'] for f in info['files']})}")
        assert info["files"] and set(info["refs_before"]) == {s0.id, s1.id, s2.id}
        assert {f["from"].split("/")[2] for f in info["files"]} == {s0.id, s1.id, s2.id}
        assert _foreign_names(s3) == []
        taken = [n for n in _crit_reg_names(s3) if n.startswith("/.snap/")]
        assert taken and all(n.startswith(f"/.snap/{s3.id}/flat/") for n in taken)
        assert s3.meta["refs"] == [] and not any(s3.users().values())
        for f in info["files"]:  # CRIU's restore checks size and mode
            taken = s3.path / f["to"].split("/", 3)[3]
            orig = SnapshotStore().p.snapshots / f["from"].split("/", 2)[2]
            assert taken.stat().st_size == orig.stat().st_size == f["bytes"]
            assert taken.stat().st_mode == orig.stat().st_mode

        # every ancestor can go: close the clones, delete s2, s1, s0
        host.close_all(*reversed(opened))
        opened = []
        for s in (s2, s1, s0):
            assert not any(s.users().values()), (s.id, s.users())
            s.delete()
            snaps.remove(s)
        assert not any(s.path.exists() for s in (s0, s1, s2))

        t = time.perf_counter()
        clones = SnapshotStore().get(s3.id).fork(2)
        opened += clones
        print(f"[{mode}] fork of 2 from the flattened snapshot, ancestors deleted: {time.perf_counter() - t:.2f} s")
        for c in clones:
            _check_clone(c, 3, mutations, files)
        # the clones diverge independently
        heap(clones[0], PORT, "mutate", "only0")
        assert heap(clones[1], PORT, "sha") == host.heap_expected(MB, "flatten", *mutations)
    finally:
        host.close_all(*reversed(opened))
        for s in reversed(snaps):
            s.delete()


def test_flatten_on_demand_from_the_cli(monkeypatch):
    """A chain below the limit flattened with 'bunshin snap flatten': a clone restored before
    keeps the parent in use until it closes; then the parent can go and the flattened snapshot
    forks correct clones. A snapshot of a clone of a flattened snapshot takes over files the
    flattened one took over under their owner's name (no nesting); where hard links fail, by
    btrfs reflink copies (CRIU's restore accepts them: same size and mode)."""
    ws = Workspace.create("base", memory_mode="share")
    opened, snaps = [ws], []
    try:
        host.heap_start(ws, PORT, MB, "flatten")
        sh(ws, "echo 0 > /root/chain")
        s0 = ws.snapshot()
        snaps.append(s0)
        ws.close()
        opened.remove(ws)
        [c1] = s0.fork(1)
        opened.append(c1)
        sh(c1, "echo 1 >> /root/chain")
        heap(c1, PORT, "incr")
        heap(c1, PORT, "mutate", "level1")
        c1.spawn(["sleep", "5001"])
        files = host.fs_state(c1)
        s1 = c1.snapshot()
        snaps.append(s1)
        assert s1.meta["ref_depth"] == 1 and s1.meta["refs"] == [s0.id] and "flattened" not in s1.meta
        c1.close()
        opened.remove(c1)
        [early] = s1.fork(1)  # restored before the flatten: it maps s0's files
        opened.append(early)
        with pytest.raises(SnapshotError, match=s1.id):
            s0.delete()

        out = subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "snap", "flatten", s1.id],
                             capture_output=True, text=True, timeout=120)
        print(f"\n{out.stdout}{out.stderr}")
        assert out.returncode == 0 and f"flattened {s1.id}" in out.stdout and s0.id in out.stdout
        s1 = snaps[1] = SnapshotStore().get(s1.id)
        assert s1.meta["ref_depth"] == 0 and s1.meta["flattened"]["reason"] == "on demand"
        assert _foreign_names(s1) == []
        assert s1.flatten()["files"] == s1.meta["flattened"]["files"]  # idempotent
        # the early clone still maps s0's files: s0 stays in use until it closes
        assert s0.users() == {"clones": [early.id], "children": []}
        with pytest.raises(SnapshotError, match=early.id):
            s0.delete()
        _check_clone(early, 1, ["level1"], files)
        sh(early, "echo 2 >> /root/chain")
        heap(early, PORT, "mutate", "level2")
        early.spawn(["sleep", "5002"])
        # a snapshot of it references s0's files (which it maps) and s1's
        s2 = early.snapshot()
        snaps.append(s2)
        assert set(s2.meta["refs"]) == {s0.id, s1.id} and s2.meta["ref_depth"] == 2  # not s1's 0, plus 1
        early.close()
        opened.remove(early)
        assert s0.users() == {"clones": [], "children": [s2.id]}
        # the same from its images when the metadata has no refs (snapshots taken before they were recorded)
        meta = json.loads((s2.path / "meta.json").read_text())
        del meta["refs"]
        (s2.path / "meta.json").write_text(json.dumps(meta))
        assert s0.users() == {"clones": [], "children": [s2.id]}
        with pytest.raises(SnapshotError, match=s2.id):
            s0.delete()
        s2.delete()
        snaps.remove(s2)
        s0.delete()
        snaps.remove(s0)

        [late] = s1.fork(1)
        opened.append(late)
        _check_clone(late, 1, ["level1"], files)
        # a child of the flattened snapshot names the files s1 took over; flattened, by their owner's name
        s3 = late.snapshot()
        snaps.append(s3)
        assert s3.meta["refs"] == [s1.id] and any(f"/{s1.id}/flat/{s0.id}/" in r["name"]
                                                  for r in flatten.references(s3.criu_dir, s3.id))
        def no_link(src, dst):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(flatten.os, "link", no_link)
        info = s3.flatten()
        monkeypatch.undo()
        assert {f["how"] for f in info["files"]} == {"reflink"}
        assert {f["to"].split("/", 4)[4].split("/")[0] for f in info["files"]} == {s0.id, s1.id}
        assert _foreign_names(s3) == []
        late.close()
        opened.remove(late)
        s1.delete()
        snaps.remove(s1)
        [again] = s3.fork(1)
        opened.append(again)
        assert heap(again, PORT, "get") == "2"
        assert heap(again, PORT, "sha") == host.heap_expected(MB, "flatten", "level1")
    finally:
        host.close_all(*reversed(opened))
        for s in reversed(snaps):
            s.delete()


def test_snapshot_paths_are_named_by_their_owner():
    """A file a flattened snapshot took over is named by the snapshot it came from, however
    many flattened snapshots passed it on; other paths are no snapshot's."""
    assert flatten._split("/.snap/snap-a/criu/pages-1.img") == ("snap-a", "snap-a", "criu/pages-1.img")
    assert flatten._split("/.snap/snap-c/flat/snap-b/criu/pages-2.img") == ("snap-c", "snap-b", "criu/pages-2.img")
    assert flatten._split("/.snap/snap-d/flat/snap-c/flat/snap-a/criu/pages-3.img") == (
        "snap-d", "snap-a", "criu/pages-3.img")
    for other in ("/usr/lib/libc.so.6", "/.snap", "/.snap/snap-a", "/.snapshots/snap-a/criu/x", "snap/snap-a/x/y"):
        assert flatten._split(other) is None, other
