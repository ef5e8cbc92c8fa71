"""Spares (``Workspace.prepare_rollback``): a snapshot restored ahead of time and kept frozen,
which a later rollback thaws and swaps in instead of restoring. The rollback's result must be
the one a restore gives; a spare that cannot serve is never used; nothing leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import leftovers
from fork_programs import host
from fork_programs.host import heap, sh

from bunshin_gym.workspace import Workspace, gc, records, spares
from bunshin_gym.workspace.cgroups import Cgroup

PORT = 7003
REPO = Path(__file__).resolve().parents[2]


def _spare_records(snap_id: str) -> list[records.Record]:
    return [r for r in records.all_records() if r.snapshot == snap_id and r.owner == os.getpid()]


@pytest.mark.parametrize("mode", ["copy", "share"])
def test_a_rollback_that_takes_a_spare_gives_the_snapshots_state(mode):
    ws = Workspace.create("base", memory_mode=mode)
    snap = None
    try:
        heap_pid = host.heap_start(ws, PORT, 8, "spare")
        for _ in range(4):
            heap(ws, PORT, "incr")
        sh(ws, "echo before > /root/r; echo t > /tmp/t")
        ws.spawn(["sh", "-c", "sleep 1001 & wait"])
        time.sleep(0.3)
        want = (host.fs_state(ws), host.proc_tree(ws), "4", heap(ws, PORT, "sha"), str(heap_pid))
        snap = ws.snapshot()

        ws.prepare_rollback(snap)
        [spare] = [r for r in _spare_records(snap.id) if r.id != ws.id]
        assert spares.count(snap.id) == 1 and Cgroup(spare.cgroup).is_frozen()
        assert spares.memory_bytes(snap.id) > 0

        heap(ws, PORT, "mutate", "after")
        heap(ws, PORT, "incr")
        sh(ws, "echo after > /root/r; touch /root/new; rm /tmp/t")
        ws.rollback(snap)
        assert ws.pid == spare.pid1, "the rollback restored instead of taking the spare"
        assert spares.count(snap.id) == 0 and not Cgroup(ws._rec.cgroup).is_frozen()
        got = (host.fs_state(ws), host.proc_tree(ws), heap(ws, PORT, "get"), heap(ws, PORT, "sha"),
               heap(ws, PORT, "pid"))
        assert got == want

        # and the same as a rollback without a spare, which goes on counting alike
        ws.rollback(snap)
        assert (host.fs_state(ws), heap(ws, PORT, "get"), heap(ws, PORT, "sha")) == (want[0], "4", want[3])
        assert heap(ws, PORT, "incr") == "5"
    finally:
        ws.close()
        if snap is not None:
            snap.delete()
    assert leftovers([ws.id]) == {}


def test_a_spare_that_does_not_fit_or_died_is_not_used_and_a_delete_reclaims_spares():
    ws = Workspace.create("base", memory_mode="share")
    other = Workspace.create("base", memory_mode="copy")
    snap = None
    try:
        sh(ws, "echo kept > /root/kept")
        snap = ws.snapshot()
        sh(ws, "echo changed > /root/kept")
        ws.prepare_rollback(snap)
        [spare] = _spare_records(snap.id)
        # a workspace of another memory mode never takes it (its pages are served differently)
        assert spares.take(other._rec, snap.id) is None and spares.count(snap.id) == 1

        os.kill(spare.pid1, signal.SIGKILL)  # killed while frozen (it dies at its thaw): restored instead
        ws.rollback(snap)
        assert ws.pid != spare.pid1 and ws.read_file("/root/kept") == b"kept\n"
        assert spares.count(snap.id) == 0 and not Cgroup(spare.cgroup).exists()

        ws.prepare_rollback(snap)
        ws.prepare_rollback(snap)
        kept = [r for r in _spare_records(snap.id) if r.id != ws.id]
        assert len(kept) == 2 and spares.count(snap.id) == 2
        ws.close()
        snap.delete()  # its spares are users: reclaimed first, then the snapshot goes
        snap = None
        assert spares.count() == 0
        assert leftovers([r.id for r in kept]) == {}
    finally:
        ws.close()
        other.close()
        if snap is not None:
            spares.discard(snap.id)
            snap.delete()


def test_gc_reclaims_the_spares_of_a_sigkilled_controller():
    script = textwrap.dedent("""
        import sys, time
        from bunshin_gym.workspace import Workspace, records
        ws = Workspace.create("base", memory_mode="share", detached=True)
        snap = ws.snapshot()
        ws.prepare_rollback(snap)
        spare = [r for r in records.all_records() if r.snapshot == snap.id and r.id != ws.id][0]
        print(ws.id, snap.id, spare.id, spare.cgroup, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    ws_id = snap_id = spare_id = None
    try:
        ws_id, snap_id, spare_id, spare_cg = proc.stdout.readline().split()
        assert records.load(spare_id).running() and Cgroup(spare_cg).is_frozen()
        proc.kill()
        proc.wait(10)
        present = records.load(spare_id) is not None
        report = gc.collect()
        assert spare_id in report.workspaces or not present
        assert leftovers([spare_id]) == {} and not Cgroup(spare_cg).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if ws_id and records.load(ws_id) is not None:
            Workspace.attach(ws_id).close()
        if snap_id:
            from bunshin_gym.workspace.snapshot import SnapshotStore

            try:
                SnapshotStore().get(snap_id).delete()
            except Exception:  # noqa: BLE001 - gone with gc already
                pass


def test_a_fork_takes_the_snapshots_spares_first_and_restores_the_rest():
    ws = Workspace.create("base", memory_mode="share")
    snap, clones = None, []
    try:
        sh(ws, "echo at-snapshot > /root/f; sleep 1003 >/dev/null 2>&1 &")
        snap = ws.snapshot()
        sh(ws, "echo later > /root/f")
        snap.prepare_spares(1)
        [spare] = _spare_records(snap.id)
        clones = snap.fork(2)
        assert spares.count(snap.id) == 0
        assert [c.pid == spare.pid1 for c in clones] == [True, False]  # the spare first, then a restore
        for c in clones:
            assert c.read_file("/root/f") == b"at-snapshot\n"
            assert "sleep 1003" in " ".join(host.proc_tree(c))
            assert not Cgroup(c._rec.cgroup).is_frozen()
        # the clones are independent of each other
        sh(clones[0], "echo mine > /root/f")
        assert clones[1].read_file("/root/f") == b"at-snapshot\n"
    finally:
        host.close_all(clones)
        ws.close()
        if snap is not None:
            snap.delete()
    assert leftovers([c.id for c in clones]) == {}
