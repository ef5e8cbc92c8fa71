"""Background dumps (criu/patches/0020-background-dump and 0021, ``BUNSHIN_BACKGROUND_DUMP=1``): CRIU
thaws the workspace once it holds the metadata and the pages (by reference, made
copy-on-write) and writes the pages afterwards, while the source runs on.

The reference is a stop-the-world dump of the same frozen state: the workspace is frozen, dumped
the old way (CRIU leaves it frozen, as it found it), then dumped in the background from that
same frozen state while a writer rewrites every page, drops, unmaps, moves pages and forks
during the background phase. Both images must hold the same pages, page by page; and the test
asserts the second dump really ran in the background (CRIU said it thawed, and the writer ran
before CRIU finished), so it fails with a CRIU that writes everything frozen as well as with a
background dump that lets a write through to a page it has not saved. Two writers run: CRIU
dumps the second while the first's pages are spliced and its copy-on-write fork made
(criu/patches/0036, 0038).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fork_programs import dumped, host

from bunshin_gym import config
from bunshin_gym.config import criu_env
from bunshin_gym.workspace import Workspace, dumping, forking, memory
from bunshin_gym.workspace.dumping import BACKGROUND_DUMP_ENV

DIR = "/tmp/bgw"
DIR2 = "/tmp/bgw2"
PROG = f"{host.DIR}/bgwriter"
MB = 64


pytestmark = pytest.mark.skipif(not dumping.background_available(),
                                reason="CRIU without criu/patches/0020-background-dump (see criu/build.sh)")


def _runtime_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def test_background_dump_holds_the_frozen_state_page_by_page(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # the info lines checked below
    p = config.paths()
    ws = Workspace.create("base")
    try:
        host.install(ws, "bgwriter")
        # two writers: CRIU dumps the second while the first forks, and the second's fork runs
        # while CRIU dumps the mounts and namespaces (criu/patches/0036)
        vpids = []
        for d in (DIR, DIR2):
            ws.exec(["mkdir", "-p", d])
            # no rseq: the kernel writes a registered rseq area whenever the task runs on another
            # CPU, which the parasite's runs between the two dumps may do
            ws.spawn([PROG, str(MB), d], log=f"{d}.log", env={"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
            vpids.append(int(host.wait_file(ws, f"{d}/ready")))
        vpid = vpids[0]
        writer = host.host_pid_of(ws, vpid)
        time.sleep(0.3)  # writing, dropping, moving and forking by now
        rec = ws._rec
        cg = ws.cgroup
        freezer = cg.freezer_dir()
        env = dict(os.environ, **criu_env(p), **memory.registry.dump_env(p))
        ref, bg = tmp_path / "stop-the-world", tmp_path / "background"
        ref.mkdir()
        bg.mkdir()
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:  # the writer's CPU time, to see it run while CRIU writes pages
            while not stop.is_set():
                samples.append((time.perf_counter(), _runtime_ns(writer)))
                time.sleep(0.001)

        ws._quiesce_agent()  # the controller's connections into the workspace (CRIU cannot dump them)
        cg.freeze()
        try:
            old = subprocess.run(forking.dump_command(rec, p, ref, freezer, "skip"), env=env,
                                 capture_output=True, text=True)
            assert old.returncode == 0, (ref / "dump.log").read_text()[-3000:]
            assert cg.is_frozen(), "the stop-the-world dump should leave the workspace frozen"
            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                new, thawed = dumping.run_in_background(forking.dump_command(rec, p, bg, freezer, "skip"), env, ())
                done = time.perf_counter()
            finally:
                stop.set()
                sampler.join()
        finally:
            cg.thaw()
        log = (bg / "dump.log").read_text()
        assert new.returncode == 0, log[-3000:]
        assert thawed is not None, "CRIU never said it thawed the workspace"
        assert "bg-dump: writing the pages of" in log
        # the writer's MADV_WIPEONFORK page (as BoringSSL's in every chromium process) made it
        # copy-on-write for CRIU's fork, not written while frozen with the rest of its pages
        assert "is not copied by fork" not in log, log[-3000:]
        assert "MADV_WIPEONFORK range(s) made copy-on-write for the fork" in log
        for v in vpids:  # each writer's drain and fork ran while CRIU went on (0036, 0038)
            assert f"bg-dump: {v} forks while the next tasks are dumped" in log, log[-3000:]
            assert re.search(rf"bg-dump: {v}: \d+ pipe\(s\) to fill with its fork", log), log[-3000:]
        ran = [ns for t, ns in samples if thawed <= t <= done]
        assert ran and ran[-1] - ran[0] > 0, "the writer did not run while CRIU wrote the pages"

        want, got = dumped.pages(ref), dumped.pages(bg)
        dumped.mask_rseq(ref, want)
        dumped.mask_rseq(ref, got)  # the same frozen state: the same threads and rseq areas
        assert set(want) == set(got)
        for v in vpids:
            assert len(want[f"pagemap-{v}.img"]) >= MB * 256, "a writer's memory is not in the reference dump"
        mine = f"pagemap-{vpid}.img"
        diffs = [f"{name} {a:#x}: {'missing' if a not in got[name] else 'differs'}"
                 for name in want for a in sorted(set(want[name]) | set(got[name]))
                 if want[name].get(a) != got[name].get(a)]
        assert not diffs, f"{len(diffs)} pages differ from the stop-the-world dump, first: {diffs[:10]}"
        # and the writer really changed its memory after the freeze: most live pages differ
        changed = 0
        with open(f"/proc/{writer}/mem", "rb", buffering=0) as mem:
            for a, page in got[mine].items():
                try:
                    mem.seek(a)
                    changed += mem.read(4096) != page
                except OSError:  # unmapped by now (the writer maps pages again and again)
                    changed += 1
        assert changed >= MB * 256 // 2, f"only {changed} of the writer's pages changed after the dump"
        # and the page is still wiped on fork: the writer's children (one every 8 rounds) read zeros
        assert " wf" in "".join(ln for ln in Path(f"/proc/{writer}/smaps").read_text().splitlines()
                                if ln.startswith("VmFlags:")), "the writer lost MADV_WIPEONFORK"
        time.sleep(0.5)
        for d in (DIR, DIR2):
            assert ws.exec(["test", "!", "-e", f"{d}/wipe-broken"]).exit_code == 0, \
                "a child of a writer read the parent's MADV_WIPEONFORK page"
    finally:
        ws.close()


#: a process with a heap (32 MiB, a pattern in every page) that rewrites 10 of its pages on
#: SIGUSR1 (then /tmp/heap.poked); the heap's address in /tmp/heap.addr
HEAP = """
import ctypes, os, signal, time
b = bytearray(32 << 20)
b[::4096] = bytes(i % 251 for i in range(len(b) // 4096))
def poke(*_):
    b[:40960:4096] = b"y" * 10
    open("/tmp/heap.poked", "w").close()
signal.signal(signal.SIGUSR1, poke)
open("/tmp/heap.addr.tmp", "w").write(str(ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))))
os.rename("/tmp/heap.addr.tmp", "/tmp/heap.addr")  # whole when it appears
while True:
    time.sleep(3600)
"""


def _heap(ws: Workspace, vpid: int, addr: int) -> bytes:
    """The heap of process ``vpid`` of ``ws`` (read through its host pid's memory)."""
    with open(f"/proc/{host.host_pid_of(ws, vpid)}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(32 << 20)


def test_a_delta_with_few_pages_writes_them_at_once_without_a_fork(monkeypatch):
    """criu/patches/0031: the copy-on-write fork copies the page tables of all of a process's
    memory, whatever is to be written (4.6 ms for a 100 MB heap of which a delta wrote ~400
    pages, ~1.7 ms to write while frozen). A first snapshot forks the heap's process (all its
    pages to write); a clone's delta, after it rewrote 10 pages of the heap, writes them at once
    without a fork, and a clone of the delta holds the heap as the clone did. With
    CRIU_BG_FORK_ALWAYS=1 the delta forks it again."""
    monkeypatch.setenv(BACKGROUND_DUMP_ENV, "1")
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # the info lines checked below
    ws = Workspace.create("base")
    made: list[Workspace] = []
    snaps = []
    try:
        vpid = ws.spawn(["python3", "-c", HEAP])
        addr = int(host.wait_file(ws, "/tmp/heap.addr"))
        snaps.append(ws.snapshot())
        assert f"bg-dump: writing the pages of {vpid}\n" in (snaps[0].criu_dir / "dump.log").read_text()
        (clone,) = snaps[0].fork(1, mode="share")
        made.append(clone)
        clone.exec(["kill", "-USR1", str(vpid)], check=True)
        host.wait_file(clone, "/tmp/heap.poked")
        held = _heap(clone, vpid, addr)
        assert held[:40960:4096] == b"y" * 10 and held[40960::4096] == bytes(i % 251 for i in range(10, 8192))

        snaps.append(clone.snapshot())
        assert (snaps[1].criu_dir / "parent").exists(), "the clone's snapshot is not a delta"
        log = (snaps[1].criu_dir / "dump.log").read_text()
        m = re.search(rf"bg-dump: {vpid}: (\d+) page\(s\) to write, (\d+) in the parent, \d+ VMAs: "
                      r"written now, no fork", log)
        assert m, log[-3000:]
        assert int(m.group(2)) >= 8192 - 10, m.group(0)  # the heap's other pages: in the parent
        assert f"bg-dump: writing the pages of {vpid}\n" not in log
        (g,) = snaps[1].fork(1, mode="copy")
        made.append(g)
        assert _heap(g, vpid, addr) == held, "a clone of the delta does not hold the clone's heap"

        monkeypatch.setenv("CRIU_BG_FORK_ALWAYS", "1")
        snaps.append(clone.snapshot())
        assert f"bg-dump: writing the pages of {vpid}\n" in (snaps[2].criu_dir / "dump.log").read_text()
    finally:
        for w in made:
            w.close()
        for snap in reversed(snaps):
            snap.delete()
        ws.close()


def test_a_fork_that_fails_has_its_pages_written_while_frozen(monkeypatch):
    """criu/patches/0036: CRIU takes a copy-on-write fork's answer only after the other tasks,
    mounts and namespaces are dumped. A fork that failed (here: the workspace is at its pids
    limit) has its task's pages written then, still frozen: the snapshot completes, and a clone
    of it holds the heap the source had."""
    monkeypatch.setenv(BACKGROUND_DUMP_ENV, "1")
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # the info lines checked below
    with contextlib.ExitStack() as made:  # closed in reverse: the clone, the snapshot, the source
        ws = Workspace.create("base")
        made.callback(ws.close)
        vpid = ws.spawn(["python3", "-c", HEAP])
        addr = int(host.wait_file(ws, "/tmp/heap.addr"))
        held = _heap(ws, vpid, addr)
        pids = ws.cgroup._pids_dir()
        assert pids is not None, "this host's workspaces have no pids controller"
        limit = (pids / "pids.max").read_text().strip()
        (pids / "pids.max").write_text((pids / "pids.current").read_text().strip())
        try:
            snap = ws.snapshot()
        finally:
            (pids / "pids.max").write_text(limit)
        made.callback(snap.delete)
        log = (snap.criu_dir / "dump.log").read_text()
        assert f"bg-dump: {vpid} forks while the next tasks are dumped" in log, log[-3000:]
        assert f"bg-dump: {vpid} could not be made copy-on-write" in log, log[-3000:]
        assert f"bg-dump: writing the pages of {vpid}\n" not in log  # written while frozen
        (clone,) = snap.fork(1, mode="copy")
        made.callback(clone.close)
        assert _heap(clone, vpid, addr) == held, "a clone does not hold the source's heap"
        assert _heap(ws, vpid, addr) == held, "the source's heap changed"
