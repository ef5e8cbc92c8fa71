"""Share mode's anonymous memory through userfaultfd (bunshin_gym/workspace/uffd.py, the CRIU
patch criu/patches/0003-uffd-share-anon.patch and native/uffd-monitor.c), on real workspaces.

Each test is able to fail: the semantics program runs in the source workspace too (so a bug in
the program shows there), and the memory and monitor checks read the kernel's and the
monitor's own numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from bunshin_gym.config import paths
from bunshin_gym.workspace import AgentError, Workspace, WorkspaceClosed, memory, memstat, records, uffd
from bunshin_gym.workspace.snapshots import delta as snapshot_delta

HERE = Path(__file__).parent / "uffd_programs"
DIR = "/opt/uffdtest"
SEM_MB = 32

pytestmark = pytest.mark.skipif(not uffd.available(), reason=f"uffd share unavailable: {uffd.unavailable_reason()}")


@functools.cache
def _compiled(name: str) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / name
        subprocess.run(["gcc", "-static", "-O1", "-Wall", "-o", str(out), str(HERE / f"{name}.c")],
                       check=True, capture_output=True, text=True)
        return out.read_bytes()


def _wait_file(ws: Workspace, path: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ws.read_file(path).decode()
        except AgentError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ws.id}: {path} not there after {timeout}s") from None
            time.sleep(0.05)


def _sh(ws: Workspace, cmd: str) -> str:
    res = ws.exec(cmd, timeout=120)
    assert res.ok, f"{ws.id}: {cmd!r}: exit {res.exit_code}: {res.stderr.decode()}"
    return res.text


def _results(ws: Workspace, pid: int) -> dict[str, int]:
    _sh(ws, f"kill -USR1 {pid}")
    text = _wait_file(ws, "/tmp/sem.out")
    return {k: int(v) for k, v in (line.split("=") for line in text.split())}


def _violations(res: dict[str, int]) -> dict[str, int]:
    """The checks of uffdsem that failed (MADV_FREE's answer is checked on its own)."""
    return {k: v for k, v in res.items() if v and k not in ("free_rc", "free_errno")}


def _start_sem(ws: Workspace, mb: int = SEM_MB) -> int:
    ws.write_file(f"{DIR}/uffdsem", _compiled("uffdsem"), mode=0o755)
    ws.spawn([f"{DIR}/uffdsem", str(mb), "/tmp/sem.ready", "/tmp/sem.out"], log="/tmp/sem.log")
    return int(_wait_file(ws, "/tmp/sem.ready"))


def _uffds(pids: list[int]) -> int:
    """userfaultfd descriptors the given processes hold."""
    n = 0
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[userfaultfd]"
                except OSError:
                    pass
        except OSError:
            pass
    return n


def _rollup(pids: list[int]) -> dict[str, int]:
    tot: dict[str, int] = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            k, _, v = line.partition(":")
            tot[k] = tot.get(k, 0) + int(v.split()[0]) * 1024
    return tot


def test_first_uses_at_once_mount_one_images_tmpfs(tmp_path):
    """The race CI caught on a cluster host's first share forks: each use that saw no tmpfs
    mounted one, the second on top of the first, and a copy under way in the first lost its
    directory (FileNotFoundError on .../uffd-images/snap-*/ids-1.img)."""
    p = dataclasses.replace(paths(), run=tmp_path / "run")
    root = p.run / "uffd-images"
    start = threading.Barrier(8)
    errors = []

    def first_use():
        try:
            start.wait()
            uffd.images_root(p)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with open("/proc/self/mountinfo") as f:
            mounts = [line for line in f if line.split()[4] == str(root)]
        assert not errors and len(mounts) == 1, (errors, mounts)
    finally:
        while os.path.ismount(root):
            subprocess.run(["umount", str(root)], check=True)


def test_share_mode_reports_uffd():
    assert memory.SHARE_ANON_MECHANISM == "uffd"
    assert memory.uses_uffd(memory.MemoryMode.SHARE) and not memory.uses_ksm(memory.MemoryMode.SHARE)
    assert memory.uses_ksm(memory.MemoryMode.KSM)  # KSM stays available as a mode


def test_semantics_in_clone_and_its_forked_children():
    """MADV_DONTNEED reads zeros in a clone; a forked child (and grandchild) sees its parent's
    drops as zeros and its own drops too; mremap (move, grow) keeps semantics; MADV_FREE fails
    with EINVAL and loses nothing, also after MADV_PAGEOUT. Same answers as the source."""
    ws = Workspace.create("base", memory_mode="share")
    clones, snap = [], None
    try:
        pid = _start_sem(ws)
        snap = ws.snapshot()
        clones = snap.fork(2)
        for c in clones:
            assert c._rec.uffd is not None
            res = _results(c, pid)
            print(f"\n{c.id}: {res}")
            # the monitor writes its counters a moment after the events: wait for all of them
            st = uffd.stats(c.id) or {}
            deadline = time.monotonic() + 10
            while not (st.get("remove", 0) > 0 and st.get("fork", 0) >= 2 and st.get("remap", 0) >= 1) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
                st = uffd.stats(c.id) or {}
            print(f"{c.id} monitor: {st}")
            assert res["free_rc"] == -1 and res["free_errno"] == 22, "MADV_FREE must fail with EINVAL"
            bad = _violations(res)
            assert not bad, f"{c.id}: semantics violated: {bad}"
            # the mechanism really served this clone: its area was registered and drops were seen
            assert st["registered_pages"] >= SEM_MB * 256
            assert st["remove"] > 0 and st["fork"] >= 2 and st["remap"] >= 1 and st["errors"] == 0
        src = _results(ws, pid)
        assert _violations(src) == {}
        assert src["free_errno"] == 22
    finally:
        for c in clones:
            c.close()
        ws.close()
        if snap is not None:
            snap.delete()


def test_clones_share_unwritten_anonymous_memory():
    """Two clones of a 96 MB heap: the heap is the page cache's, counted once; each clone's
    private anonymous memory is a small fraction of it."""
    mb = 96
    ws = Workspace.create("base", memory_mode="share")
    clones, snap = [], None
    try:
        pid = _start_sem(ws, mb)
        snap = ws.snapshot()
        t = time.perf_counter()
        clones = snap.fork(2)
        print(f"\nfork of 2 ({mb} MB heap): {time.perf_counter() - t:.3f} s")
        for c in clones:
            r = _rollup(c.pids())
            st = uffd.stats(c.id)
            print(f"{c.id}: Pss {r['Pss'] >> 20} MB Pss_Anon {r['Pss_Anon'] >> 20} MB "
                  f"Pss_Shmem {r['Pss_Shmem'] >> 20} MB Anonymous {r['Anonymous'] >> 20} MB; monitor {st}")
            assert r["Anonymous"] < (mb << 20) // 4, "the clone copied its heap"
            assert r["Pss_Shmem"] > (mb << 20) // 4, "the heap is not mapped from the shared image"
        # the source's heap stays right, and a clone reads the same pattern
        assert _results(clones[0], pid)["before_bad"] == 0
    finally:
        for c in clones:
            c.close()
        ws.close()
        if snap is not None:
            snap.delete()


def test_copied_pages_tell_what_a_clone_changed_from_what_it_rewrote():
    """memstat.copied_pages, which the fork benchmark uses to split what activity costs a share
    clone: 1 MiB a clone overwrites with new bytes counts as changed, 1 MiB it writes again
    with the bytes it held as unchanged (both are private copies of image pages)."""
    from fork_programs import host

    ws = Workspace.create("base", memory_mode="share")
    clones, snap = [], None
    try:
        host.heap_start(ws, 7002, 32, "copied")
        snap = ws.snapshot()
        clones = snap.fork(1)
        device = os.stat(uffd.images_root()).st_dev
        before = memstat.copied_pages(clones[0].pids(), device)
        want = host.heap_expected(32, "copied", "a")
        assert host.heap(clones[0], 7002, "mutate", "a") == want
        assert host.heap(clones[0], 7002, "rewrite", "b") == want
        after = memstat.copied_pages(clones[0].pids(), device)
        print(f"\ncopied pages before {before.as_mb()} after {after.as_mb()}")
        mib, slack = 1 << 20, 1 << 20  # the interpreter's own writes (refcounts, the patch it computes)
        assert mib <= after.changed - before.changed <= mib + slack
        assert mib <= after.unchanged - before.unchanged <= mib + slack
        assert memstat.copied_pages(ws.pids(), device) == memstat.CopiedPages(0, 0), "the source maps no image"
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()


def _alarm(signum, frame):
    raise TimeoutError("the grandchild did not answer in time (lost memory?)")


def _unrecognised_image_vmas(log: str) -> list[str]:
    """VMAs of a CRIU dump log that map a file on the uffd images tmpfs but were not turned
    into anonymous memory ("uffd-share: ... is anonymous memory" right after)."""
    st = os.stat(uffd.images_root())
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    lines = log.splitlines()
    missed = []
    for i, line in enumerate(lines):
        if "Handling VMA with the following smaps entry:" not in line:
            continue
        fields = line.split("entry:", 1)[1].split()
        if len(fields) >= 6 and fields[3] == dev and fields[4] != "0":
            nxt = next((x for x in lines[i + 1:i + 4] if "uffd-share:" in x or "Handling VMA" in x), "")
            if "uffd-share:" not in nxt:
                missed.append(" ".join(fields))
    return missed


#: a process holding a 64 GiB PROT_NONE reservation, as V8 and PartitionAlloc do (chromium)
RESERVE = ("import mmap,time; m=mmap.mmap(-1, 64<<30, flags=mmap.MAP_PRIVATE, prot=0); "
           "open('/tmp/reserve.ready','w').close(); time.sleep(1e6)")


def test_nested_snapshot_of_a_uffd_clone(monkeypatch):
    """A clone is snapshotted again: its image mappings are dumped as anonymous memory, the
    pages it never wrote stay in the parent's images (a delta), and the grandchild clone (share
    again, and copy) has exact semantics and the same data. A reservation larger than RAM
    restores too (a delta is restored in CRIU's context, which premapped every VMA writable)."""
    ws = Workspace.create("base", memory_mode="share")
    made: list[Workspace] = []
    snaps = []
    try:
        monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "4")  # the VMA lines checked below
        pid = _start_sem(ws)
        ws.spawn(["python3", "-c", RESERVE])
        _wait_file(ws, "/tmp/reserve.ready")
        snaps.append(ws.snapshot())
        (child,) = snaps[0].fork(1)
        made.append(child)
        snaps.append(child.snapshot())
        text = (snaps[1].criu_dir / "dump.log").read_text(errors="replace")
        assert "uffd-share:" in text and "Handling VMA with the following smaps entry" in text
        missed = _unrecognised_image_vmas(text)
        assert not missed, f"mappings of the tmpfs images not dumped as anonymous memory: {missed}"
        print(f"\nsnapshot sizes: source {snaps[0].size() >> 20} MiB, child {snaps[1].size() >> 20} MiB")
        assert (snaps[1].criu_dir / "parent").exists() and snaps[1].size() < snaps[0].size() / 2
        # a grandchild that lost pages crashes or wedges its agent: fail, don't hang
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(300)
        try:
            for mode in ("share", "copy"):
                (g,) = snaps[1].fork(1, mode=mode)
                made.append(g)
                res = _results(g, pid)
                bad = _violations(res)
                assert not bad, f"grandchild ({mode}): {bad}"
                assert g.exec(["pgrep", "-f", "64<<30"]).ok, f"grandchild ({mode}): the reserving process is gone"
                if mode == "share":  # the parent's pages are mapped (from its copy), not copied
                    deadline = time.monotonic() + 5
                    while uffd.stats(g.id).get("registered_pages", 0) == 0 and time.monotonic() < deadline:
                        time.sleep(0.2)  # the monitor writes its counters every second
                    assert uffd.stats(g.id)["registered_pages"] >= SEM_MB * 256, uffd.stats(g.id)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    finally:
        for w in reversed(made):
            w.close()
        ws.close()
        for s in reversed(snaps):
            s.delete()


@pytest.mark.parametrize("victim", ["worker", "guard"])
def test_killing_the_monitor_stops_the_clone_with_a_report(victim):
    ws = Workspace.create("base", memory_mode="share")
    clone, snap = None, None
    try:
        pid = _start_sem(ws, 8)
        snap = ws.snapshot()
        (clone,) = snap.fork(1)
        u = clone._rec.uffd
        pids = clone.pids()
        assert pids
        os.kill(getattr(u, victim), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(records.process_alive(q, records.proc_start_time(q)) for q in pids):
            assert time.monotonic() < deadline, "the clone kept running after its monitor died"
            time.sleep(0.05)
        why = uffd.failure(clone._rec)
        print(f"\nreport: {why}")
        assert why and "stopped" in why
        if victim == "worker":
            assert "killed by signal 9" in why
        else:
            assert "guard" in why
        with pytest.raises(WorkspaceClosed, match="uffd monitor|monitor's"):
            clone.exec("true")
        assert _results(ws, pid)["before_bad"] == 0  # the source is untouched
    finally:
        if clone is not None:
            clone.close()
        ws.close()
        if snap is not None:
            snap.delete()


def _cycles(n: int) -> None:
    p = paths()
    ws = Workspace.create("base", memory_mode="share")
    try:
        pid = _start_sem(ws, 8)
        base_fds = len(os.listdir("/proc/self/fd"))
        mine: set[str] = set()  # snapshot and clone ids: other sessions fork share clones on this host too
        for i in range(n):
            snap = ws.snapshot()
            (c,) = snap.fork(1)
            mine |= {snap.id, c.id}
            u = c._rec.uffd
            if i == 0:
                # a restored process forks 20 children that exit: the monitor follows and forgets them
                _sh(c, f"kill -USR2 {pid}")
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    st = uffd.stats(c.id)
                    if st.get("fork", 0) >= 20 and st["processes"] <= 4:
                        break
                    time.sleep(0.2)
                st = uffd.stats(c.id)
                print(f"\nafter 20 forks: {st}")
                assert st["fork"] >= 20 and st["processes"] <= 4, "monitor keeps state of exited processes"
                # no restored process keeps a userfaultfd; the monitor holds one per process, the guard a copy
                assert _uffds(c.pids()) == 0
                assert _uffds([u.worker]) == st["processes"] and _uffds([u.guard]) == st["processes"]
            c.close()
            snap.delete()
            assert not records.process_alive(u.guard, u.guard_start)
            assert not records.process_alive(u.worker, u.worker_start)
        left = {k: [f for f in v if f.split(".")[0] in mine] for k, v in uffd.leftovers(p).items()}
        assert left == {"files": [], "images": []}, left
        assert len(os.listdir("/proc/self/fd")) <= base_fds
        assert not (p.run / "uffd-images").exists() or not [
            d for d in (p.run / "uffd-images").iterdir() if d.is_dir() and d.name in mine]
    finally:
        ws.close()


def test_fork_close_cycles_leak_nothing():
    _cycles(10)


@pytest.mark.slow
def test_100_fork_close_cycles_leak_nothing():
    _cycles(100)


def _osworld_image() -> bool:
    from bunshin_gym.workspace import ImageStore

    try:
        ImageStore().get("osworld")
        return True
    except Exception:  # noqa: BLE001 - no image, no test
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _osworld_image(), reason="the osworld (desktop) image is not built")
def test_chromium_in_a_desktop_clone_survives_five_minutes_of_activity():
    """Chromium's PartitionAlloc relies on dropped memory reading zeros (it aborts ~20 s after
    activity when it does not): a clone of a desktop keeps a page allocating and freeing,
    and opens and closes tabs, for five minutes; the browser must stay up and answer."""
    import json
    import sys
    import urllib.parse

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from envs.osworld import desktop

    page = ("data:text/html,<title>soak</title><script>let k=0;setInterval(()=>{let a=[];for(let i=0;i<200000;i++)"
            "a.push({x:i,s:'y'.repeat(64)+i});k+=a.length;document.title='soak '+k;a=null},150)</script>")

    def cdp(w: Workspace, path: str, method: str = "GET") -> str | None:
        code = ("import sys,urllib.request;sys.stdout.write(urllib.request.urlopen(urllib.request.Request("
                f"'http://127.0.0.1:9222{path}', method='{method}'), timeout=10).read().decode())")
        r = w.exec(["python3", "-c", code], user=desktop.USER, timeout=20)
        return r.text if r.ok else None

    ws = Workspace.create("osworld", memory_mode="share")
    clone = snap = None
    try:
        desktop.boot_desktop(ws, 1280, 800, terminal=False)
        desktop.session_spawn(ws, ["chromium", "about:blank"], log="/tmp/.bunshin/chromium.log")
        assert desktop.wait_window(ws, "Chromium", 90)
        deadline = time.monotonic() + 60
        while cdp(ws, "/json/version") is None:
            assert time.monotonic() < deadline, "chromium's DevTools port never answered"
            time.sleep(1)
        assert cdp(ws, "/json/new?" + urllib.parse.quote(page, safe=""), "PUT")
        time.sleep(10)
        snap = ws.snapshot()
        (clone,) = snap.fork(1)
        browser = clone.exec("pgrep -o -f /usr/lib/chromium/chromium").text.strip()
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < 300:
            i += 1
            if i % 3 == 0:
                assert cdp(clone, "/json/new?" + urllib.parse.quote(page, safe=""), "PUT"), "chromium stopped answering"
            if i % 6 == 0:
                pages = [t for t in json.loads(cdp(clone, "/json/list") or "[]") if t.get("type") == "page"]
                for t in pages[:-3]:
                    cdp(clone, f"/json/close/{t['id']}")
            assert clone.exec("pgrep -o -f /usr/lib/chromium/chromium").text.strip() == browser, "the browser died"
            time.sleep(5)
        titles = [t.get("title", "") for t in json.loads(cdp(clone, "/json/list") or "[]") if t.get("type") == "page"]
        assert any(t.startswith("soak ") for t in titles), titles
        st = uffd.stats(clone.id)
        print(f"\nchromium clone after 5 min: monitor {st}")
        assert st["remove"] > 0 and st["zeropage"] > 0 and st["errors"] == 0
        # the soaked clone's snapshot is a delta of the first, and a grandchild's browser answers
        delta = clone.snapshot()
        try:
            # five minutes of allocation in several tabs rewrite most of the heap and grow it: the
            # delta's size is near the first snapshot's, above it in some runs (356 and 412 MiB of
            # 378 on 2026-12-05, same code); what makes it a delta is pages left in the parent
            in_parent = sum(n for pm in delta.criu_dir.glob("pagemap-*.img") if pm.stem.split("-", 1)[1].isdigit()
                            for _, n, flags in snapshot_delta.read_pagemap(pm)[2] if flags & snapshot_delta.PE_PARENT)
            print(f"delta snapshot {delta.size() >> 20} MiB of {snap.size() >> 20} MiB, {in_parent} pages in parent")
            assert (delta.criu_dir / "parent").exists() and in_parent > 0
            (grandchild,) = delta.fork(1)
            try:
                assert cdp(grandchild, "/json/new?" + urllib.parse.quote(page, safe=""), "PUT")
                time.sleep(5)
                titles = [t.get("title", "") for t in json.loads(cdp(grandchild, "/json/list") or "[]")]
                assert any(t.startswith("soak ") for t in titles), titles
            finally:
                grandchild.close()
        finally:
            delta.delete()
    finally:
        if clone is not None:
            clone.close()
        ws.close()
        if snap is not None:
            snap.delete()


def test_share_ksm_merges_the_pages_clones_write_and_keeps_semantics(monkeypatch):
    """BUNSHIN_SHARE_KSM=1: share clones are KSM-mergeable, so equal pages that two clones
    write (copies of the image's pages) merge; the data stays right and dropped memory still
    reads zeros (KSM changes where a page lives, never what a program reads)."""
    from fork_programs import host

    monkeypatch.setenv(memory.SHARE_KSM_ENV, "1")
    ws = Workspace.create("base", memory_mode="share")
    clones, snap = [], None
    try:
        host.heap_start(ws, 7001, 32, "ksm")
        pid = _start_sem(ws)
        snap = ws.snapshot()
        clones = snap.fork(2)
        want = host.heap_expected(32, "ksm", "same")
        heaps = []
        for c in clones:
            assert c._rec.uffd is not None
            assert host.heap(c, 7001, "mutate", "same") == want  # the same 1 MiB written in both
            [hp] = [p for p in c.pids() if "heap.py" in Path(f"/proc/{p}/cmdline").read_text()]
            assert "ksm_merge_any: yes" in Path(f"/proc/{hp}/ksm_stat").read_text()
            heaps.append(hp)
        deadline = time.monotonic() + 60
        merged = lambda: sum(int(Path(f"/proc/{hp}/ksm_merging_pages").read_text()) for hp in heaps)  # noqa: E731
        while merged() < 256 and time.monotonic() < deadline:  # 2 x 1 MiB written, equal
            time.sleep(0.5)
        print(f"\nKSM merging pages of the two clones' heap processes: {merged()}")
        assert merged() >= 256, "the pages both clones wrote did not merge"
        for c in clones:
            assert host.heap(c, 7001, "sha") == want
            assert not _violations(_results(c, pid)), f"{c.id}: semantics violated with KSM"
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
