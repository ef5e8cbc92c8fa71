"""The "kmod" memory mode (bunshin_gym/workspace/kmod.py).

The bunshin_share module cannot be loaded on the development host (its kernel has no module
support; ``make -C kmod test`` tests the module itself in a VM). These tests run the whole
kmod restore path on real workspaces and real CRIU — pages skipped by CRIU
(criu/patches/0012), the frozen holder, the pre-resume action script, the pairing of clone and
holder processes, the ranges — with the module replaced by the copying test double
``BUNSHIN_KMOD_DOUBLE=copy``; and they check that without the module the mode refuses clearly.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from fork_programs import host
from fork_programs.host import DIR, heap, sh

from bunshin_gym import kmod_share
from bunshin_gym.workspace import Workspace, kmod, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.errors import ForkError, SetupError
from bunshin_gym.workspace.gc import collect
from bunshin_gym.workspace.snapshot import SnapshotStore

PORT = 7311
PAGE = os.sysconf("SC_PAGE_SIZE")


# units: the address-space plan -------------------------------------------------------------
MAPS = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 ---p 00000000 00:00 0
7f0000200000-7f0000201000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
7f0000300000-7f0000301000 rw-s 00000000 00:01 99                         /dev/zero (deleted)
7f0000400000-7f0000410000 rw-p 00000000 00:00 0                          [anon:v8]
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00102000 r--p 00000000 00:00 0                          [vvar]
7ffd00102000-7ffd00104000 r-xp 00000000 00:00 0                          [vdso]
"""


def test_parse_maps_and_private_anonymous_ranges():
    vmas = kmod.parse_maps(MAPS)
    assert len(vmas) == 9
    anon = [v.path or hex(v.start) for v in vmas if v.private_anon]
    assert anon == ["[heap]", "0x7f0000000000", "0x7f0000100000", "[anon:v8]", "[stack]"]


def test_plan_cuts_at_both_sides_boundaries():
    v = kmod.Vma
    src = [v(0x1000, 0x3000, "rw-p", ""), v(0x3000, 0x5000, "r--p", ""), v(0x8000, 0x9000, "rw-p", "[stack]")]
    dst = [v(0x1000, 0x5000, "rw-p", ""), v(0x8000, 0x9000, "rw-p", "[stack]")]
    ranges, missing = kmod.plan(src, dst)
    assert [(r.start, r.end, r.same_prot) for r in ranges] == [
        (0x1000, 0x3000, True), (0x3000, 0x5000, False), (0x8000, 0x9000, True)]
    assert missing == []


def test_plan_reports_what_the_holder_does_not_map():
    v = kmod.Vma
    ranges, missing = kmod.plan([v(0x2000, 0x3000, "rw-p", "")],
                                [v(0x1000, 0x4000, "rw-p", ""), v(0x6000, 0x7000, "rw-p", "/lib/x.so")])
    assert [(r.start, r.end) for r in ranges] == [(0x2000, 0x3000)]
    assert missing == [(0x1000, 0x2000), (0x3000, 0x4000)]  # the file mapping is not anonymous memory


# without the module ------------------------------------------------------------------------
@pytest.fixture
def no_double(monkeypatch):
    monkeypatch.delenv(kmod.DOUBLE_ENV, raising=False)


@pytest.mark.skipif(kmod_share.available(), reason="the module is loaded here; the refusal cannot be seen")
def test_without_the_module_kmod_mode_refuses_and_leaves_the_source_alone(no_double, fresh_ws):
    sh(fresh_ws, "echo before > /root/f")
    snap = fresh_ws.snapshot()
    before = {r.id for r in records.all_records()}
    try:
        with pytest.raises(SetupError, match="bunshin_share kernel module is not loaded"):
            snap.fork(1, mode="kmod")
        assert not {r.id for r in records.all_records()} - before  # no holder, no clone
        assert sh(fresh_ws, "cat /root/f").strip() == "before"
    finally:
        snap.delete()


@pytest.mark.skipif(kmod_share.available(), reason="the module is loaded here; the refusal cannot be seen")
def test_without_the_module_a_kmod_rollback_refuses_before_stopping_anything(no_double):
    ws = Workspace.create("base", memory_mode="kmod")
    try:
        sh(ws, "echo before > /root/f")
        snap = ws.snapshot()
        sh(ws, "echo after > /root/f")
        with pytest.raises(SetupError, match="bunshin_share kernel module is not loaded"):
            ws.rollback(snap)
        assert sh(ws, "cat /root/f").strip() == "after"  # still running, unchanged
        snap.delete()
    finally:
        ws.close()


# the whole path, with the copying double ---------------------------------------------------
@pytest.fixture
def double(monkeypatch):
    monkeypatch.setenv(kmod.DOUBLE_ENV, "copy")



def test_kmod_clones_equal_the_source_through_the_holder(double):
    ws = Workspace.create("base", memory_mode="kmod")
    clones, snap = [], None
    try:
        host.install(ws, "madv")
        host.heap_start(ws, PORT, 32, "equal")
        heap(ws, PORT, "incr")
        want = host.heap_expected(32, "equal")
        ws.spawn([f"{DIR}/madv", "16", "/tmp/madv.ready", "/tmp/madv.out"], log="/tmp/madv.log")
        madv_pid = int(host.wait_file(ws, "/tmp/madv.ready"))
        snap = ws.snapshot()
        clones = snap.fork(2)
        [holder] = kmod.holders_of(snap.id)
        assert holder.running() and holder.memory_mode == "copy"
        assert set(snap.users()["clones"]) == {c.id for c in clones}, "the holder is no user of the snapshot"
        for c in clones:
            served = c._rec.kmod
            print(f"\n{c.id}: {served}")
            assert served.mechanism == "copy" and served.processes >= 3
            assert served.pages_copied * PAGE > 32 * 2**20  # the heap came from the holder
            assert heap(c, PORT, "sha") == want and heap(c, PORT, "get") == "1"
            heap(c, PORT, "incr")
            assert heap(c, PORT, "get") == "2"
            sh(c, f"kill -USR1 {madv_pid}")
            out = host.wait_file(c, "/tmp/madv.out", timeout=60).split()
            assert out == ["before_bad=0", "after_nonzero=0", "refill_bad=0"], out
        assert heap(ws, PORT, "get") == "1"  # the source is untouched
        # the holder is frozen and stays so: its pages never change under the clones
        assert Cgroup(holder.cgroup).is_frozen()
        # a second fork reuses the holder
        more = snap.fork(1)
        clones += more
        assert [r.id for r in kmod.holders_of(snap.id)] == [holder.id]
        assert heap(more[0], PORT, "sha") == want
        for c in clones[1:]:
            c.close()
        assert [r.id for r in kmod.holders_of(snap.id)] == [holder.id]  # one kmod clone is left
        clones[0].close()
        assert kmod.holders_of(snap.id) == []  # the last kmod clone takes the holder with it
        assert not records.process_alive(holder.pid1, holder.pid1_start)
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
    assert kmod.holders_of(snap.id) == []


def test_ephemeral_fork_and_rollback_in_kmod_mode(double):
    ws = Workspace.create("base", memory_mode="kmod")
    try:
        sh(ws, "echo one > /root/f")
        [c] = ws.fork(1)
        snap_id = c.base_snapshot
        assert len(kmod.holders_of(snap_id)) == 1
        sh(c, "echo two > /root/f")
        c.rollback()
        assert sh(c, "cat /root/f").strip() == "one"
        c.close()
        assert kmod.holders_of(snap_id) == [] and snap_id not in {s.id for s in SnapshotStore().list()}
    finally:
        ws.close()


def test_a_holder_that_lost_a_process_fails_the_fork_cleanly(double):
    ws = Workspace.create("base", memory_mode="kmod")
    snap = None
    try:
        ws.spawn(["sleep", "1000"])
        snap = ws.snapshot()
        [c] = snap.fork(1)  # keeps the holder alive
        [holder] = kmod.holders_of(snap.id)
        sleeper = next(pid for pid in _cgroup_pids(holder) if _comm(pid) == "sleep")
        os.kill(sleeper, signal.SIGKILL)  # pending until thawed
        holder_ws = Workspace(holder, ws._p)
        holder_ws.thaw()
        deadline = time.monotonic() + 10
        while sleeper in _cgroup_pids(holder):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        holder_ws.freeze()
        def of_snap() -> set[str]:  # (other sessions on this host make workspaces meanwhile)
            return {r.id for r in records.all_records() if r.snapshot == snap.id}

        before = of_snap()
        with pytest.raises(ForkError, match="no holder process for pid"):
            snap.fork(1)
        assert not of_snap() - before  # the failed clone is gone
        assert sh(ws, "pgrep -c sleep").strip() == "1"  # the source runs on
        assert sh(c, "pgrep -c sleep").strip() == "1"  # and so does the earlier clone
        c.close()
    finally:
        ws.close()
        if snap is not None:
            snap.delete()


def test_gc_reclaims_the_holder_of_a_vanished_snapshot(double):
    ws = Workspace.create("base", memory_mode="kmod")
    try:
        snap = ws.snapshot()
        [c] = snap.fork(1)
        [holder] = kmod.holders_of(snap.id)
        assert holder.id not in collect().workspaces  # in use: kept
        os.rename(snap.path, snap.path.with_name(f".gone-{snap.id}"))  # as if deleted by a crashed process
        try:
            report = collect()
            assert holder.id in report.workspaces
            assert kmod.holders_of(snap.id) == []
        finally:
            os.rename(snap.path.with_name(f".gone-{snap.id}"), snap.path)
        c.close()
        snap.delete()
    finally:
        ws.close()


def _cgroup_pids(rec: records.Record) -> list[int]:
    return Cgroup(rec.cgroup).pids()


def _comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""
