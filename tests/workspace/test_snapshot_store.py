"""The snapshot store: deleting a snapshot that a clone or a child snapshot uses is refused;
a corrupt or incomplete snapshot is reported by name, and forking from one fails cleanly."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from fork_programs import host
from fork_programs.host import sh

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, records
from bunshin_gym.workspace.errors import ForkError, SnapshotError
from bunshin_gym.workspace.snapshot import SnapshotStore


def test_deleting_a_snapshot_in_use_is_refused():
    ws = Workspace.create("base")
    clones, snaps = [], []
    try:
        sh(ws, "echo one > /root/f")
        snap = ws.snapshot()
        snaps.append(snap)
        [c] = snap.fork(1)
        clones.append(c)
        with pytest.raises(SnapshotError, match=rf"{snap.id}.*in use.*{c.id}"):
            snap.delete()
        assert SnapshotStore().get(snap.id).id == snap.id  # untouched, still usable
        [c2] = snap.fork(1)
        assert c2.read_file("/root/f") == b"one\n"
        c2.close()

        # a child snapshot (taken from the clone) keeps its parent too, after every clone is gone
        sh(c, "echo two >> /root/f")
        child = c.snapshot()
        snaps.append(child)
        assert child.parent == snap.id
        c.close()
        with pytest.raises(SnapshotError, match=rf"{snap.id}.*in use.*{child.id}"):
            snap.delete()
        assert snap.users() == {"clones": [], "children": [child.id]}
        [gc] = child.fork(1)
        clones.append(gc)
        assert gc.read_file("/root/f") == b"one\ntwo\n"
        with pytest.raises(SnapshotError, match=child.id):
            child.delete()
        gc.close()
        child.delete()
        snaps.remove(child)
        assert not child.path.exists()
        snap.delete()
        snaps.remove(snap)
        assert not snap.path.exists()
        with pytest.raises(SnapshotError, match=snap.id):
            SnapshotStore().get(snap.id)
    finally:
        host.close_all(clones, ws)
        for s in reversed(snaps):
            s.delete()


def test_corrupt_snapshot_is_reported_by_name():
    from conftest import leftovers

    ws = Workspace.create("base")
    snaps, logs = [], []
    try:
        sh(ws, "echo data > /root/f")
        no_inventory, no_meta, bad_meta = snaps[:] = [ws.snapshot() for _ in range(3)]
        (no_inventory.criu_dir / "inventory.img").unlink()
        (no_meta.path / "meta.json").unlink()
        (bad_meta.path / "meta.json").write_text("{not json")
        store = SnapshotStore()
        for snap, what in ((no_inventory, "inventory.img"), (no_meta, "meta.json"), (bad_meta, "meta.json")):
            with pytest.raises(SnapshotError, match=rf"{snap.id}.*(corrupt|incomplete).*{what}") as ei:
                store.get(snap.id)
            print(f"\n{ei.value}")
            with pytest.raises(SnapshotError, match=snap.id):
                ws.rollback(snap.id)
        assert {s.id for s in store.list()}.isdisjoint({no_meta.id, bad_meta.id})
        with pytest.raises(SnapshotError, match="snap-doesnotexist"):
            store.get("snap-doesnotexist")

        # forking from a handle loaded before the corruption: CRIU fails for every clone, each
        # failure is reported with its log, no restore process is left unreaped, nothing else is left
        log_dir = paths().run / "logs"
        logs_before = set(log_dir.iterdir())
        with pytest.raises(SnapshotError, match=f"{no_inventory.id} is corrupt: image inventory.img is missing"):
            no_inventory.fork(2)  # its checksums name the image: refused before anything is made
        no_inventory.metadata.checksums = None  # as a snapshot taken before images had sums: CRIU meets it
        # children of this process that earlier tests of the session keep (their workspaces'
        # uffd monitors, servers) are not this fork's: only new ones count
        children_before = set(host.children_of(os.getpid()))
        with pytest.raises(ForkError) as ei:
            no_inventory.fork(2)
        print(ei.value)
        named = [Path(x) for x in re.findall(r"log: ([^\s;]+)", str(ei.value))]
        logs.extend(named)
        assert no_inventory.id in str(ei.value) and len(named) == 2, ei.value
        for log in named:  # CRIU's own error (restores log errors and warnings only: fanout.py)
            assert log.is_file() and "Error (criu/" in log.read_text(errors="replace")
        clone_ids = re.findall(r"CRIU restore of (ws-[0-9a-f]{8})", str(ei.value))
        assert len(set(clone_ids)) == 2 and not leftovers(clone_ids)
        # of the new files there (other sessions restore on this host too), its clones' are the logs named
        new = {f for f in set(log_dir.iterdir()) - logs_before if f.name[:len("ws-01234567")] in clone_ids}
        assert new <= set(named)
        assert not set(host.children_of(os.getpid())) - children_before, "unreaped restore processes"
        assert not [r.id for r in records.all_records() if r.snapshot == no_inventory.id]

        # the source is unaffected
        assert ws.read_file("/root/f") == b"data\n"
    finally:
        ws.close()
        for s in snaps:
            s.delete()
        for log in logs:
            log.unlink(missing_ok=True)
    assert not any(s.path.exists() for s in snaps)


def test_release_deletes_now_or_once_the_last_user_is_gone():
    """``Snapshot.release()`` (what an env does with its snapshots on close): an unused snapshot
    goes at once; one a child snapshot still needs (a prefix cache's) goes with that child."""
    ws = Workspace.create("base")
    store = SnapshotStore()
    try:
        alone = ws.snapshot()
        alone.release()
        assert alone.id not in {s.id for s in store.list()}

        parent = ws.snapshot()
        [clone] = parent.fork(1)
        sh(clone, "echo child > /root/f")
        child = clone.snapshot()
        clone.close()
        parent.release()  # still needed by the child: kept, now ephemeral
        kept = store.get(parent.id)
        assert kept.meta["ephemeral"] and kept.users()["children"] == [child.id]
        [again] = kept.fork(1)  # still whole and usable
        again.close()
        assert parent.id in {s.id for s in store.list()}
        child.delete()  # the last user: the parent goes with it
        assert parent.id not in {s.id for s in store.list()}
    finally:
        ws.close()
