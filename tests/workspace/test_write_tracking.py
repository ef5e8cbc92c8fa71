"""Deltas of clones restored by copy (memory modes copy and ksm): write tracking with
userfaultfd's asynchronous write-protect and PAGEMAP_SCAN (bunshin_gym/workspace/memory/tracking.py,
native/uffd-monitor.c --wp, criu/patches/0018-wp-async-deltas.patch), on real workspaces.

A clone's snapshot records the pages it never wrote since its restore as in its parent. Each
test compares what a clone restored from such a delta holds with what the snapshotted clone
held, page by page (read from the host through /proc/PID/mem), or lets the program check its
own memory under a writer that never pauses; and each asserts the snapshot really was a delta,
so it fails without write tracking (a full dump) as well as with a wrong delta.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fork_programs import host

from bunshin_gym.workspace import Workspace, memory, uffd
from bunshin_gym.workspace.snapshots import delta, store

DIR = "/tmp/wpd"
PROG = f"{host.DIR}/wpdelta"
MB = 16

pytestmark = pytest.mark.skipif(uffd.write_tracking_unavailable_reason() is not None,
                                reason=f"write tracking unavailable: {uffd.write_tracking_unavailable_reason()}")


@contextlib.contextmanager
def _lab(mode: str) -> Iterator[tuple[Workspace, list[Workspace], list]]:
    """A source workspace of ``mode`` and lists for the clones and snapshots a test makes; all
    are closed and deleted afterwards (clones first, snapshots children first)."""
    ws = Workspace.create("base", memory_mode=mode)
    made: list[Workspace] = []
    snaps: list = []
    try:
        yield ws, made, snaps
    finally:
        for w in reversed(made):
            w.close()
        ws.close()
        for s in reversed(snaps):
            s.delete()


def _signal(ws: Workspace, pid: int, sig: str, answer: str | None = None) -> str:
    if answer:
        ws.exec(["rm", "-f", f"{DIR}/{answer}"])
    res = ws.exec(["kill", f"-{sig}", str(pid)])
    assert res.ok, f"{ws.id}: kill -{sig} {pid}: {res.stderr.decode()}"
    return host.wait_file(ws, f"{DIR}/{answer}") if answer else ""


def _check(ws: Workspace, pid: int) -> dict[str, int]:
    text = _signal(ws, pid, "WINCH", "check")
    return {k: int(v) for k, v in (line.split("=") for line in text.split())}


def _bad(res: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in res.items() if v and k != "rounds"}


def _start(ws: Workspace) -> tuple[int, int, int]:
    host.install(ws, "wpdelta")
    ws.exec(["mkdir", "-p", DIR])
    # no rseq: the kernel rewrites a registered rseq area (cpu id) whenever the task moves to
    # another CPU, which a restored clone does; the page-by-page comparison would see that
    ws.spawn([PROG, str(MB), DIR], log="/tmp/wpdelta.log", env={"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    main, helper, sparse = host.wait_file(ws, f"{DIR}/ready").split()
    return int(main), int(helper), int(sparse)


def _mutated_clone(ws: Workspace, made: list[Workspace], snaps: list) -> tuple[int, Workspace]:
    """Start wpdelta in ``ws``, snapshot it, fork a clone and let the clone mutate its memory;
    (the program's pid, the clone)."""
    main, _, _ = _start(ws)
    snaps.append(ws.snapshot())
    (clone,) = snaps[0].fork(1)
    made.append(clone)
    _signal(clone, main, "USR1", "mutated")
    return main, clone


def _vpid(host_pid: int) -> int:
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {host_pid}")


_MAPS = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ (\S+) (\d+)\s*(.*)$")


def _anon_pages(host_pid: int) -> dict[int, bytes]:
    """{address: sha1 of the page} over the process's private anonymous read-write memory (its
    stack left out: the process runs there), read through /proc/PID/mem. A share clone's
    anonymous memory is a private mapping of its page images on the uffd tmpfs."""
    out: dict[int, bytes] = {}
    st = os.stat(uffd.images_root())
    images = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"  # the tmpfs, as maps names it
    with open(f"/proc/{host_pid}/mem", "rb", buffering=0) as mem:
        for line in Path(f"/proc/{host_pid}/maps").read_text().splitlines():
            m = _MAPS.match(line)
            if not m:
                continue
            start, end, perms, dev, inode, name = int(m[1], 16), int(m[2], 16), m[3], m[4], int(m[5]), m[6].strip()
            anon = not inode and name in ("", "[heap]")
            if perms[:2] != "rw" or perms[3] != "p" or not (anon or dev == images):
                continue
            mem.seek(start)
            data = mem.read(end - start)
            for off in range(0, len(data), 4096):
                out[start + off] = hashlib.sha1(data[off:off + 4096]).digest()
    return out


def _memory_by_vpid(ws: Workspace, vpids: set[int]) -> dict[int, dict[int, bytes]]:
    by = {}
    for pid in ws.pids():
        try:
            v = _vpid(pid)
        except OSError:
            continue
        if v in vpids:
            by[v] = _anon_pages(pid)
    assert set(by) == vpids, f"{ws.id}: processes {sorted(vpids - set(by))} not found"
    return by


def _differences(want: dict[int, dict[int, bytes]], got: dict[int, dict[int, bytes]]) -> list[str]:
    diffs = []
    for v, pages in want.items():
        other = got.get(v, {})
        for a in sorted(set(pages) | set(other)):
            if pages.get(a) != other.get(a):
                diffs.append(f"pid {v} page {a:#x}: {'missing' if a not in other else 'differs'}")
    return diffs


def _pages(criu_dir: Path, vpid: int) -> tuple[int, int]:
    """(pages dumped, pages in parent) of one process in a snapshot's images."""
    ents = delta.read_pagemap(criu_dir / f"pagemap-{vpid}.img")[2]
    return (sum(n for _, n, fl in ents if fl & delta.PE_PRESENT), sum(n for _, n, fl in ents if fl & delta.PE_PARENT))


def _pages_in(criu_dir: Path, vpid: int, start: int, end: int) -> int:
    """Pages of [start, end) a process's pagemap has (dumped or in parent)."""
    ents = delta.read_pagemap(criu_dir / f"pagemap-{vpid}.img")[2]
    return sum(max(0, min(end, a + n * 4096) - max(start, a)) for a, n, _ in ents) // 4096


def _settled_snapshot(ws: Workspace, vpids: set[int], snaps: list) -> dict[int, dict[int, bytes]]:
    """Snapshot the workspace (appended to ``snaps``) at a moment its processes' memory is the
    same just before and just after (a just-forked child still writes its own pages for a
    moment); that memory."""
    for _ in range(5):
        held = _memory_by_vpid(ws, vpids)
        snaps.append(ws.snapshot())
        if _memory_by_vpid(ws, vpids) == held:
            return held
        snaps.pop().delete()
        time.sleep(0.5)
    raise AssertionError(f"{ws.id}: its memory never held still around a snapshot")


def _tracker_stats(ws: Workspace) -> dict:
    deadline = time.monotonic() + 10
    st = uffd.stats(ws.id)
    while not st.get("protected_ranges") and time.monotonic() < deadline:
        time.sleep(0.2)  # the monitor writes its counters every second
        st = uffd.stats(ws.id)
    return st


def _wait_ksm_merging(ws: Workspace, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        merged = 0
        for pid in ws.pids():
            try:
                merged += int(Path(f"/proc/{pid}/ksm_merging_pages").read_text())
            except (OSError, ValueError):
                pass
        if merged:
            return merged
        time.sleep(0.5)
    return 0


@pytest.mark.parametrize(("source_mode", "clone_mode"), [("copy", "copy"), ("ksm", "ksm"), ("ksm", "copy")])
def test_delta_of_a_tracked_clone_holds_its_memory_page_by_page(source_mode, clone_mode):
    """A clone (copy, ksm, and a copy clone of a ksm source) rewrites pages, drops pages
    (MADV_DONTNEED), moves pages onto others (mremap), and forks a child holding its memory
    copy-on-write in place of a process of the source (same pid where the pid namespace lets
    it). Its snapshot is a delta holding few pages; clones of it (copy and share) hold, page for
    page, what the clone held."""
    with _lab(source_mode) as (ws, made, snaps):
        main, helper, sparse = _start(ws)
        snaps.append(ws.snapshot())
        (clone,) = snaps[0].fork(1, mode=clone_mode)
        made.append(clone)
        assert uffd.tracks_writes(clone._rec), f"{clone_mode} clone has no write tracker"
        st = _tracker_stats(clone)
        assert st.get("wp") == 1 and st["protected_ranges"] > 0 and st["errors"] == 0, st
        child = int(_signal(clone, main, "USR1", "mutated"))
        print(f"\nchild {child} (the source's helper was {helper})")
        if clone_mode == "ksm":  # pages ksmd merges lose their write-protect bit: they must be dumped
            assert _wait_ksm_merging(clone) > 0, "ksmd merged nothing in the ksm clone"
        held = _settled_snapshot(clone, {main, child}, snaps)
        dumped, in_parent = _pages(snaps[1].criu_dir, main)
        print(f"sizes: source {snaps[0].size() >> 10} KiB, clone's delta {snaps[1].size() >> 10} KiB; main process: "
              f"{dumped} pages dumped, {in_parent} in parent; child: {_pages(snaps[1].criu_dir, child)}")
        assert (snaps[1].criu_dir / "parent").exists(), "the clone's snapshot is not a delta"
        if clone_mode == "copy":  # R less what the clone rewrote, dropped and moved is the parent's
            assert in_parent >= MB * 256 - 40 and dumped < 200, (dumped, in_parent)
        else:  # a page ksmd merged lost its write-protect bit and is dumped; the others are the parent's
            assert in_parent > 0 and in_parent + dumped >= MB * 256 - 40, (dumped, in_parent)
        # the forked child is no process the parent restored: all its pages are dumped
        assert _pages(snaps[1].criu_dir, child)[1] == 0
        # pages never populated stay out of the images (write-protecting must not fill empty
        # page-table entries: a dump would take them for swapped pages)
        in_sparse = _pages_in(snaps[1].criu_dir, main, sparse, sparse + 64 * 4096)
        assert in_sparse == 32, f"{in_sparse} of the 64 sparse pages (32 ever touched) are in the images"
        for mode in ("copy", "share"):
            (g,) = snaps[1].fork(1, mode=mode)
            made.append(g)
            diffs = _differences(held, _memory_by_vpid(g, {main, child}))
            assert not diffs, f"{mode} clone of the delta differs from the clone: {diffs[:10]} ({len(diffs)})"
            res = _check(g, main)
            assert not _bad(res), f"{mode} clone of the delta: {res}"
        # made self-contained (as flattening does before its ancestors may go), it still restores the same
        assert delta.materialize(snaps[1].criu_dir) and not (snaps[1].criu_dir / "parent").exists()
        store.Store().reseal(snaps[1])  # its images were rewritten: their checksums too
        (g,) = snaps[1].fork(1, mode="copy")
        made.append(g)
        assert not _differences(held, _memory_by_vpid(g, {main, child})), "clone of the materialized delta"


def test_deltas_under_a_writer_that_keeps_writing():
    """The clone writes its hot pages without pause while it is snapshotted twice (each a delta
    of the snapshot it was restored from); a clone of each snapshot holds a state the writer
    could have been in (every page of the round in progress up to where the state page says,
    the rest of the previous round) and every untouched page, and writes on from there."""
    with _lab("copy") as (ws, made, snaps):
        main, clone = _mutated_clone(ws, made, snaps)
        _signal(clone, main, "USR2", "writing")
        for _ in range(2):
            time.sleep(0.5)
            snaps.append(clone.snapshot())
            assert (snaps[-1].criu_dir / "parent").resolve() == (snaps[0].criu_dir).resolve()
            assert _pages(snaps[-1].criu_dir, main)[1] >= MB * 256 - 40
            (g,) = snaps[-1].fork(1)
            made.append(g)
            first = _check(g, main)
            assert not _bad(first), f"clone of a delta taken under writes: {first}"
            time.sleep(0.3)
            later = _check(g, main)
            assert not _bad(later) and later["rounds"] > first["rounds"], (first, later)
        assert not _bad(_check(clone, main))


def test_a_dead_tracker_means_full_dumps_not_stale_pages():
    """The clone's tracker is killed: the clone runs on (it is not stopped), and its next
    snapshot records every page (no delta), which restores with the clone's data."""
    with _lab("copy") as (ws, made, snaps):
        main, clone = _mutated_clone(ws, made, snaps)
        rec = clone._rec
        subprocess.run(["kill", "-KILL", str(rec.uffd.worker)], check=True)
        deadline = time.monotonic() + 10
        while uffd.monitor_alive(rec) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not uffd.monitor_alive(rec)
        clone.check()  # no WorkspaceClosed: a copy clone needs no tracker to run
        assert memory.for_record(rec).health(rec, clone._p) is None and clone._rec.running()
        snaps.append(clone.snapshot())
        assert not (snaps[1].criu_dir / "parent").exists(), "a delta without tracking"
        (g,) = snaps[1].fork(1)
        made.append(g)
        assert not _bad(_check(g, main))
