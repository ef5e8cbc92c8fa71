"""The "kmod" memory mode for real: the bunshin_share module, real CRIU, real workspaces.

The development host cannot load modules, so the tests that need ``/dev/bunshin_share`` are
skipped there; ``make -C kmod e2e`` (kmod/e2e.sh) boots Debian's 6.1 kernel in a qemu VM with
the host's root file system over virtio-9p, loads the module and runs this file inside it.
``test_kmod_e2e_in_vm`` (markers ``slow``, ``vm``) is the host side: it runs that VM.
(tests/workspace/test_fork_kmod.py runs the same restore path on the host with a copying test double.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from fork_programs import host
from fork_programs.host import DIR, heap, sh

from bunshin_gym import kmod_share
from bunshin_gym.workspace import Workspace, kmod, memstat, records
from bunshin_gym.workspace.cgroups import Cgroup

REPO = Path(__file__).resolve().parents[2]
PORT = 7321
MB = 32
PAGE = os.sysconf("SC_PAGE_SIZE")

needs_module = pytest.mark.skipif(
    not kmod_share.available(), reason="needs the bunshin_share module (/dev/bunshin_share): make -C kmod e2e")


@pytest.fixture
def real_module(monkeypatch):
    monkeypatch.delenv(kmod.DOUBLE_ENV, raising=False)
    assert kmod.sharer().name == "module"



def _pid_running(rec: records.Record, needle: str) -> int:
    """Host pid of the workspace's process whose command line contains ``needle``."""
    for pid in Cgroup(rec.cgroup).pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd:
            return pid
    raise AssertionError(f"{rec.id}: no process running {needle!r}")


def _shared_mb(a: int, b: int) -> float:
    """MiB of anonymous memory two processes map with the same physical frames."""
    fa, fb = memstat._frames(a)[1], memstat._frames(b)[1]
    return np.intersect1d(fa, fb).size * PAGE / 2**20


@needs_module
def test_kmod_clones_map_the_holders_pages_copy_on_write(real_module):
    ws = Workspace.create("base", memory_mode="kmod")
    clones, snap = [], None
    try:
        host.install(ws, "madv")
        host.heap_start(ws, PORT, MB, "e2e")
        heap(ws, PORT, "incr")
        want = host.heap_expected(MB, "e2e")
        ws.spawn([f"{DIR}/madv", "8", "/tmp/madv.ready", "/tmp/madv.out"], log="/tmp/madv.log")
        madv_pid = int(host.wait_file(ws, "/tmp/madv.ready"))
        snap = ws.snapshot()
        clones = snap.fork(2)
        [holder] = kmod.holders_of(snap.id)
        assert Cgroup(holder.cgroup).is_frozen()
        holder_heap = _pid_running(holder, "heap.py")
        for c in clones:
            served = c._rec.kmod
            print(f"\n{c.id}: {served}")
            assert served.mechanism == "module" and served.processes >= 3
            assert served.pages_shared * PAGE > MB * 2**20  # the heap was shared, not copied
            assert served.pages_copied * PAGE < 8 * 2**20
            shared = _shared_mb(holder_heap, _pid_running(c._rec, "heap.py"))
            print(f"{c.id}: heap.py maps {shared:.1f} MiB of anonymous memory with the holder's frames")
            assert shared > MB
            assert heap(c, PORT, "sha") == want and heap(c, PORT, "get") == "1"
        # a write is private to the writer: the other clone, the holder and the source keep theirs
        assert heap(clones[0], PORT, "mutate", "m1") == host.heap_expected(MB, "e2e", "m1")
        heap(clones[0], PORT, "incr")
        assert heap(clones[0], PORT, "get") == "2"
        assert heap(clones[1], PORT, "sha") == want and heap(clones[1], PORT, "get") == "1"
        assert heap(ws, PORT, "sha") == want and heap(ws, PORT, "get") == "1"
        still = _shared_mb(holder_heap, _pid_running(clones[0]._rec, "heap.py"))
        print(f"after a 1 MiB write clone 0 still shares {still:.1f} MiB with the holder")
        assert MB - 2 < still < MB + 8
        # exact anonymous-memory semantics in a clone: MADV_DONTNEED reads zeros, refill works
        for c in clones:
            sh(c, f"kill -USR1 {madv_pid}")
            out = host.wait_file(c, "/tmp/madv.out", timeout=120).split()
            assert out == ["before_bad=0", "after_nonzero=0", "refill_bad=0"], out
        # the holder's pages never changed: a later clone gets the snapshot's memory
        more = snap.fork(1)
        clones += more
        assert [r.id for r in kmod.holders_of(snap.id)] == [holder.id]
        assert more[0]._rec.kmod.mechanism == "module"
        assert heap(more[0], PORT, "sha") == want and heap(more[0], PORT, "get") == "1"
        for c in clones:
            c.close()
        assert kmod.holders_of(snap.id) == []  # the last kmod clone takes the holder with it
        assert not records.process_alive(holder.pid1, holder.pid1_start)
        assert heap(ws, PORT, "sha") == want  # the source runs on
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()


@needs_module
def test_kmod_rollback_and_ephemeral_fork_with_the_module(real_module):
    ws = Workspace.create("base", memory_mode="kmod")
    try:
        host.heap_start(ws, PORT, 8, "rb")
        want = host.heap_expected(8, "rb")
        sh(ws, "echo one > /root/f")
        [c] = ws.fork(1)
        snap_id = c.base_snapshot
        assert c._rec.kmod.mechanism == "module"
        sh(c, "echo two > /root/f")
        heap(c, PORT, "mutate", "x")
        heap(c, PORT, "incr")
        c.rollback()
        assert c._rec.kmod.mechanism == "module"
        assert c._rec.kmod.pages_shared * PAGE > 8 * 2**20
        assert sh(c, "cat /root/f").strip() == "one"
        assert heap(c, PORT, "sha") == want and heap(c, PORT, "get") == "0"
        c.close()
        assert kmod.holders_of(snap_id) == []
    finally:
        ws.close()


@needs_module
def test_a_snapshot_of_a_kmod_clone_forks_in_kmod_mode(real_module):
    """A kmod clone's memory (mostly the holder's pages) is dumped like any other; its snapshot
    gets a holder of its own, from which the next generation is shared."""
    ws = Workspace.create("base", memory_mode="kmod")
    clones, snaps = [], []
    try:
        host.heap_start(ws, PORT, 8, "gen")
        snaps.append(ws.snapshot())
        [a] = snaps[0].fork(1)
        clones.append(a)
        heap(a, PORT, "mutate", "a1")
        heap(a, PORT, "incr")
        snaps.append(a.snapshot())
        [b] = snaps[1].fork(1)
        clones.append(b)
        served = b._rec.kmod
        print(f"\nsecond generation {b.id}: {served}")
        assert served.mechanism == "module" and served.pages_shared * PAGE > 8 * 2**20
        assert heap(b, PORT, "sha") == host.heap_expected(8, "gen", "a1") and heap(b, PORT, "get") == "1"
        assert len(kmod.holders_of(snaps[0].id)) == 1 and len(kmod.holders_of(snaps[1].id)) == 1
        heap(b, PORT, "mutate", "b1")
        assert heap(a, PORT, "sha") == host.heap_expected(8, "gen", "a1")
        assert heap(ws, PORT, "sha") == host.heap_expected(8, "gen")
        b.close()
        assert kmod.holders_of(snaps[1].id) == []
    finally:
        host.close_all(clones, ws)
        for s in reversed(snaps):
            s.delete()


@pytest.mark.slow
@pytest.mark.vm
def test_kmod_e2e_in_vm():
    """Runs this file (and the kmod/copy memory comparison) inside a qemu VM with the module."""
    _, log = host.kmod_vm("e2e", timeout=4000)
    assert "PASSED tests/workspace/test_kmod_e2e.py::test_kmod_clones_map_the_holders_pages_copy_on_write" in log
    assert "PASSED tests/workspace/test_kmod_e2e.py::test_kmod_rollback_and_ephemeral_fork_with_the_module" in log
    assert "PASSED tests/workspace/test_kmod_e2e.py::test_a_snapshot_of_a_kmod_clone_forks_in_kmod_mode" in log
    assert (REPO / "kmod/build/e2e.json").exists()
