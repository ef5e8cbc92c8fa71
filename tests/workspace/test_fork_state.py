"""BunshinFork, state: a clone is its source at fork time (memory, files, processes), clones
then diverge independently, nested snapshot chains restore every level's changes, and
rolling back twice to one snapshot gives one state. Real CRIU, real workspaces."""

from __future__ import annotations

import time

import pytest
from fork_programs import host
from fork_programs.host import DIR, heap, sh

from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.memory import MemoryMode
from bunshin_gym.workspace.snapshots import delta, store

HEAP_MB = 100
PORT = 7001


def _populate_files(ws: Workspace) -> None:
    """Changes of every kind to the overlay and to the tmpfs mounts, and a sqlite database."""
    sh(ws, "set -e; mkdir -p /var/lib/forktest /root/dir/sub; echo notes > /root/notes.txt;"
           "head -c 3000000 /dev/urandom > /root/dir/sub/blob; chmod 640 /root/dir/sub/blob;"
           "ln -s /root/notes.txt /root/link; rm /etc/issue.net; echo changed >> /etc/issue;"
           "echo in-tmp > /tmp/tmpfile; echo in-shm > /dev/shm/shmfile;"
           "sqlite3 /var/lib/forktest/db.sqlite 'create table t(v text); insert into t values (\"base\");'")


def _start_processes(ws: Workspace) -> None:
    """A small process tree besides heap.py: a shell with two children."""
    ws.spawn(["sh", "-c", "sleep 1001 & sleep 1002 & wait"])
    deadline = time.monotonic() + 10
    while "sleep 1002" not in " ".join(host.proc_tree(ws)):
        assert time.monotonic() < deadline, "the sleep processes did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", [m.value for m in MemoryMode])
def test_clone_equals_source_at_fork_time(mode, kmod_double):
    kmod_double(mode)
    ws = Workspace.create("base", memory_mode=mode)
    clones, snap = [], None
    try:
        host.heap_start(ws, PORT, HEAP_MB, "equal")
        for _ in range(7):
            heap(ws, PORT, "incr")
        _populate_files(ws)
        _start_processes(ws)
        want_sha = host.heap_expected(HEAP_MB, "equal")
        src_files, src_procs = host.fs_state(ws), host.proc_tree(ws)
        assert heap(ws, PORT, "sha") == want_sha

        snap = ws.snapshot(tags={"test": "equal"})
        print(f"\n[{mode}] snapshot {snap.id}: {snap.meta['timings']} criu {snap.size() / 2**20:.1f} MiB")
        t = time.perf_counter()
        clones = snap.fork(2)
        print(f"[{mode}] fork of 2: {time.perf_counter() - t:.3f} s")

        for c in clones:
            assert c.id != ws.id and c.base_snapshot == snap.id
            assert heap(c, PORT, "sha") == want_sha, f"{c.id}: the 100 MiB heap differs from the source's"
            assert heap(c, PORT, "get") == "7"
            assert host.fs_state(c) == src_files
            assert host.proc_tree(c) == src_procs
            assert sh(c, "sqlite3 /var/lib/forktest/db.sqlite 'select v from t'").split() == ["base"]
        # the source itself is unchanged by the snapshot
        assert heap(ws, PORT, "sha") == want_sha and heap(ws, PORT, "get") == "7"
        assert host.fs_state(ws) == src_files and host.proc_tree(ws) == src_procs
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()


def test_clones_diverge_independently():
    ws = Workspace.create("base")
    clones, snap = [], None
    try:
        host.heap_start(ws, PORT, 16, "diverge")
        _populate_files(ws)
        base_sha = heap(ws, PORT, "sha")
        snap = ws.snapshot()
        clones = snap.fork(3)
        everyone = [ws, *clones]
        names = ["src", "c0", "c1", "c2"]
        for w, name in zip(everyone, names, strict=True):
            heap(w, PORT, "mutate", name)
            for _ in range(names.index(name) + 1):
                heap(w, PORT, "incr")
            sh(w, f"echo {name} > /root/who; rm /root/notes.txt; echo {name} >> /tmp/tmpfile;"
                  f"sqlite3 /var/lib/forktest/db.sqlite \"insert into t values ('{name}')\"")
            w.spawn(["sleep", f"{2000 + names.index(name)}"])
        for w, name in zip(everyone, names, strict=True):
            i = names.index(name)
            assert heap(w, PORT, "sha") == host.heap_expected(16, "diverge", name) != base_sha
            assert heap(w, PORT, "get") == str(i + 1)
            assert w.read_file("/root/who") == f"{name}\n".encode()
            assert w.read_file("/tmp/tmpfile") == f"in-tmp\n{name}\n".encode()
            assert sh(w, "sqlite3 /var/lib/forktest/db.sqlite 'select v from t'").split() == ["base", name]
            sleeps = sorted(r.split()[-1] for r in host.proc_tree(w) if " sleep 2" in r)
            assert sleeps == [str(2000 + i)], f"{name} sees the processes {sleeps}"
        # the snapshot is untouched: a new clone has the state at snapshot time
        [late] = snap.fork(1)
        clones.append(late)
        assert heap(late, PORT, "sha") == base_sha and heap(late, PORT, "get") == "0"
        assert late.read_file("/root/notes.txt") == b"notes\n"
        assert sh(late, "sqlite3 /var/lib/forktest/db.sqlite 'select v from t'").split() == ["base"]
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()


@pytest.mark.parametrize("mode", ["copy", "share", "map-anon"])
def test_nested_snapshots_three_levels(mode):
    """snapshot -> fork -> modify -> snapshot -> fork -> modify -> snapshot -> fork."""
    mb = 64
    ws = Workspace.create("base", memory_mode=mode)
    opened, snaps = [ws], []
    try:
        host.heap_start(ws, PORT, mb, "nested")
        sh(ws, "echo 0 > /root/chain; echo level0 > /root/level0")
        heap(ws, PORT, "incr")
        current = ws
        mutations: list[str] = []
        for level in range(3):
            snap = current.snapshot(tags={"level": level})
            snaps.append(snap)
            t = time.perf_counter()
            [clone] = snap.fork(1)
            restore_s = time.perf_counter() - t
            opened.append(clone)
            print(f"\n[{mode}] level {level}: {snap.id} parent={snap.parent} depth={snap.depth} "
                  f"criu={snap.size() / 2**20:.1f} MiB frozen={snap.meta['timings']['frozen_ms']} ms "
                  f"restore={restore_s:.3f} s")
            # every earlier level's change is in the clone
            assert clone.read_file("/root/chain") == "".join(f"{i}\n" for i in range(level + 1)).encode()
            for i in range(level + 1):
                assert clone.read_file(f"/root/level{i}") == f"level{i}\n".encode()
            assert heap(clone, PORT, "get") == str(level + 1)
            assert heap(clone, PORT, "sha") == host.heap_expected(mb, "nested", *mutations)
            for i in range(1, level + 1):
                assert any(f"sleep {3000 + i}" in r for r in host.proc_tree(clone)), f"level {i}'s process is gone"
            # modify, for the next level
            sh(clone, f"echo {level + 1} >> /root/chain; echo level{level + 1} > /root/level{level + 1}")
            clone.spawn(["sleep", str(3000 + level + 1)])
            heap(clone, PORT, "incr")
            mutations.append(f"level{level + 1}")
            heap(clone, PORT, "mutate", mutations[-1])
            current = clone
        # the chain of snapshots
        assert [s.parent for s in snaps] == [None, snaps[0].id, snaps[1].id]
        assert [s.depth for s in snaps] == [0, 1, 2]
        for s in snaps:
            assert s.meta["criu_bytes"] == s.size() > 0, f"{s.id}: image size not recorded"
            assert s.meta["memory_mode"] == mode
        sizes = [s.size() for s in snaps]
        print(f"[{mode}] criu image sizes per level (MiB): {[round(x / 2**20, 1) for x in sizes]}")
        if mode in ("share", "map-anon"):
            # a child stores its delta: level 1 changed 1 MiB of a 64 MiB heap (share mode: the pages
            # a clone never wrote are recorded as in the parent's images, delta.dump_delta)
            smaller = sizes[1] < sizes[0] / 2 and sizes[2] < sizes[0] / 2
            assert smaller, f"child images are not deltas: sizes {sizes}"
        if mode == "share":
            # the delta levels restore in every way: share (tmpfs copy made self-contained from the
            # chain), copy (CRIU reads the parent images), and after the chain is flattened
            last = snaps[-1]
            assert (last.criu_dir / "parent").exists()
            want = host.heap_expected(mb, "nested", *mutations[:-1])
            for how in ("copy", "share"):
                [c] = last.fork(1, mode=how)
                opened.append(c)
                assert heap(c, PORT, "sha") == want, f"{how} clone of a delta snapshot"
            # made independent of its parent (what flattening does first): the images alone restore it
            assert delta.materialize(last.criu_dir) and not (last.criu_dir / "parent").exists()
            store.Store().reseal(last)  # its images were rewritten: their checksums too
            [c] = last.fork(1, mode="copy")
            opened.append(c)
            assert heap(c, PORT, "sha") == want, "copy clone of a materialized delta snapshot"
    finally:
        host.close_all(*reversed(opened))
        for s in reversed(snaps):
            s.delete()


@pytest.mark.parametrize("mode", ["copy", "share"])
def test_rollback_twice_gives_the_same_state(mode):
    ws = Workspace.create("base", memory_mode=mode)
    snap = None
    try:
        heap_pid = host.heap_start(ws, PORT, 8, "rollback")
        for _ in range(5):
            heap(ws, PORT, "incr")
        sh(ws, "echo before > /root/r; echo t > /tmp/t")
        files, procs, sha = host.fs_state(ws), host.proc_tree(ws), heap(ws, PORT, "sha")
        snap = ws.snapshot()

        states = []
        for attempt in range(2):
            heap(ws, PORT, "mutate", f"attempt{attempt}")
            for _ in range(3 + attempt):
                heap(ws, PORT, "incr")
            sh(ws, f"echo after{attempt} > /root/r; touch /root/new{attempt}; rm /tmp/t")
            ws.spawn(["sleep", "4000"])
            assert host.fs_state(ws) != files and heap(ws, PORT, "get") != "5"
            t = time.perf_counter()
            ws.rollback(snap)
            print(f"\n[{mode}] rollback {attempt}: {time.perf_counter() - t:.3f} s")
            assert ws.base_snapshot == snap.id
            states.append((host.fs_state(ws), host.proc_tree(ws), heap(ws, PORT, "get"), heap(ws, PORT, "sha"),
                           heap(ws, PORT, "pid")))
        assert states[0] == states[1] == (files, procs, "5", sha, str(heap_pid))
        assert ws.read_file("/root/r") == b"before\n"
        # the rolled-back workspace keeps working and counting from the snapshot's value
        assert heap(ws, PORT, "incr") == "6"
    finally:
        ws.close()
        if snap is not None:
            snap.delete()


def test_heap_program_is_checked_against_the_host():
    """The expected hashes above are computed on the host: make sure heap.py agrees, so a
    mismatch in a clone can only mean the clone's memory is wrong."""
    ws = Workspace.create("base")
    try:
        host.heap_start(ws, PORT, 2, "host")
        assert heap(ws, PORT, "sha") == host.heap_expected(2, "host")
        assert heap(ws, PORT, "mutate", "x") == host.heap_expected(2, "host", "x") != host.heap_expected(2, "host")
        assert sh(ws, f"ls {DIR}").split() == ["heap.py", "heapctl.py"]
    finally:
        ws.close()
