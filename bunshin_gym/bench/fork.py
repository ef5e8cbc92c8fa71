"""``bunshin bench fork``: memory and time of forking a workspace, every memory mode side by side.

The source workspace holds about 300 MB of heap in three processes (random bytes, so only
sharing between clones, never merging inside one, can save memory). For each mode and
each n in 1, 2, 4, 8, 16 it forks n clones from one snapshot and measures:

- memory of the clones: distinct resident pages counted once (``unique``) and the sum of
  PSS, right after restore and after activity (each heap process rewrites 5% of its pages
  and a few commands run; on the desktop, keys and scrolling in chromium), plus the peak host
  memory during the fork; on the desktop also after one agent step before the activity (a
  command typed into the terminal);
- what the activity wrote in share clones: private copies of image pages it changed, and
  those it rewrote with the same bytes; share less the latter is a floor for any copy-on-write
  by pages, even one that skipped same-byte rewrites;
- fan-out time and per-clone restore time; rollback time;
- source frozen time for a first snapshot and for a delta snapshot (a clone's, after one
  small action; the median of DELTA_SNAPSHOTS taken in a row), split into freeze / files /
  dump / thaw;
- CPU spent by ksmd.

Besides the memory modes, ``share+ksm`` is share mode with its clones KSM-mergeable
(``BUNSHIN_SHARE_KSM=1``): the pages clones write merge where they are equal; and
``copy-untracked`` / ``ksm-untracked`` are those modes as they were before write tracking
(``BUNSHIN_WRITE_TRACKING=0``: a clone's snapshot records all its pages), to set the delta
snapshot of a tracked clone beside the full one in the same run.

Any label may end in ``-before`` (``share-before``, ``copy-untracked-before``): its clones are
restored the way forks restored them before :mod:`bunshin_gym.workspace.fanout` (CRIU debug
logs, the once-per-fork work before any clone's set-up: ``fanout.BEFORE``), to set the two
fan-outs side by side in one run. Every fork's time is split into phases (the ``/.snap``
view, the image copy, each clone's record and cgroup, file system, memory backend, waiting
for a restore slot, CRIU's restore; and the agents' first answer), printed under its row.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bunshin_gym.bench.report import summary, table, write
from bunshin_gym.config import overridden
from bunshin_gym.workspace import Workspace, fanout, uffd
from bunshin_gym.workspace.memory import (
    SHARE_KSM_ENV,
    MemoryMode,
    ksmd_cpu_seconds,
    share_anon_mechanism,
    uses_ksm,
    uses_uffd,
)
from bunshin_gym.workspace.memory.tracking import WRITE_TRACKING_ENV
from bunshin_gym.workspace.memstat import CopiedPages, copied_pages, group_memory, used_memory

HEAP_PROGRAM = r"""
import os, signal, time
buf = bytearray(os.urandom(int(os.environ["HEAP_MB"]) * 2**20))
def touch(sig, frame):  # rewrite 5% of the pages with bytes of this clone's own
    mine = os.urandom(len(buf) // 20 // 4096 + 1)
    for n, i in enumerate(range(0, len(buf) // 20, 4096)):
        buf[i] ^= mine[n] | 1
signal.signal(signal.SIGUSR1, touch)
open(f"/tmp/heap-ready-{os.getpid()}", "w").close()
while True:
    time.sleep(3600)
"""
KSM_SETTLE_S = 20.0


class PeakSampler:
    """Samples host memory in use every few ms while a fork runs."""

    def __init__(self) -> None:
        self.base = used_memory()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, used_memory())
            time.sleep(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


#: the page the desktop source's chromium shows
SOURCE_PAGE = "file:///home/user/page.html"


def make_source(image: str, heap_mb: int, procs: int, *, chromium: tuple[str, ...] = ("chromium",)) -> Workspace:
    """The benchmarks' source workspace: ``procs`` processes holding ``heap_mb`` of heap, or
    (``osworld``) the desktop with chromium on :data:`SOURCE_PAGE`, started by ``chromium``
    (the image's wrapper; another command line compares chromium's flags)."""
    ws = Workspace.create(image)
    if image == "osworld":  # the desktop: Xvfb, window manager, terminal, and chromium on a page
        from bunshin_gym.envs.osworld import desktop

        desktop.boot_desktop(ws, 1920, 1080)
        ws.write_file("/home/user/page.html", "<h1>bunshin</h1>" + "<p>lorem ipsum dolor</p>" * 200, owner="user")
        desktop.session_spawn(ws, [*chromium, SOURCE_PAGE], log="/tmp/chromium.log")
        time.sleep(8.0)  # let chromium start its renderer and settle
    if procs == 0 or heap_mb == 0:
        return ws
    ws.write_file("/opt/heap.py", HEAP_PROGRAM)
    for _ in range(procs):
        ws.spawn(["python3", "/opt/heap.py"], env={"HEAP_MB": str(heap_mb // procs)})
    deadline = time.monotonic() + 60
    while ws.exec("ls /tmp | grep -c heap-ready").text.strip() != str(procs):
        if time.monotonic() > deadline:
            raise RuntimeError("heap processes did not start")
        time.sleep(0.2)
    return ws


def agent_step(ws: Workspace) -> bool:
    """One typical agent step where the workspace has a desktop: bring the terminal to the front
    and type a command in it (False elsewhere: the heap workspace has only ``activity``)."""
    if ws.image != "osworld":
        return False
    ws.exec("xdotool search --onlyvisible --class XTerm windowactivate --sync type --delay 20 'ls -la ~'; "
            "xdotool key Return", env={"DISPLAY": ":0"}, user="user")
    return True


def activity(ws: Workspace) -> None:
    ws.exec("pkill -USR1 -f /opt/heap.py; ls -R /usr/share/doc > /dev/null; echo done > /root/activity.txt")
    if ws.image == "osworld":  # the desktop: keys and scrolling in chromium
        ws.exec("xdotool search --onlyvisible --class chromium windowactivate --sync key --delay 20 "
                "Page_Down Page_Down End Home ctrl+f b u n s h i n Escape", env={"DISPLAY": ":0"}, user="user")


def _ksm_settle(mode: MemoryMode) -> float:
    """Let ksmd finish its passes (KSM modes only); returns seconds waited."""
    if not uses_ksm(mode):
        return 0.0
    t0, last = time.monotonic(), -1
    full = Path("/sys/kernel/mm/ksm/full_scans")
    start_scans = int(full.read_text())
    while time.monotonic() - t0 < KSM_SETTLE_S:
        time.sleep(1.0)
        sharing = int(Path("/sys/kernel/mm/ksm/pages_sharing").read_text())
        if int(full.read_text()) >= start_scans + 2 and sharing == last:
            break
        last = sharing
    return round(time.monotonic() - t0, 1)


def run(json_path: str | None = None, *, image: str = "base", heap_mb: int = 300, procs: int = 3,
        counts: tuple[int, ...] = (1, 2, 4, 8, 16),
        modes: tuple[str, ...] = ("copy", "ksm", "share", "share+ksm", "map-anon"),
        plot: str | None = None) -> dict:
    mechanism = share_anon_mechanism()
    if image == "osworld":
        heap_mb, procs = 0, 0  # the desktop's own processes (chromium, Xvfb, ...) are the memory
    print(f"bench fork: image {image!r}, {heap_mb} MB heap in {procs} processes; modes {', '.join(modes)}; "
          f"n = {', '.join(map(str, counts))}; share mode's anonymous memory via {mechanism}")
    results: dict = {"image": image, "heap_mb": heap_mb, "share_anon_mechanism": mechanism, "modes": {}}
    for label in modes:
        options, variant = _fanout_of(label)
        mode, env = _variant(variant)
        by_uffd = uses_uffd(mode)
        src = make_source(image, heap_mb, procs)
        try:
            # forks and rollbacks of this label restore so; "share+ksm", "copy-untracked": what the
            # clones made below are
            with fanout.using(options), overridden(env):
                src_mem = group_memory(src.pids())
                first = src.snapshot()
                mres: dict = {"source_mb": src_mem.as_mb(), "first_snapshot": first.meta["timings"],
                              "first_snapshot_mb": round(first.size() / 2**20, 1), "by_n": {}}
                for n in counts:
                    print(f"  {label:>12}  n={n:<2} ", end="", flush=True)
                    ksm0 = ksmd_cpu_seconds()
                    with PeakSampler() as peak, fanout.tracing() as trace:
                        t0 = time.perf_counter()
                        clones = first.fork(n, mode=mode)
                        fanout_s = time.perf_counter() - t0
                    try:
                        settle = _ksm_settle(mode)
                        pids = [p for c in clones for p in c.pids()]
                        after_restore, copied_restore = group_memory(pids), _copied(clones, by_uffd)
                        stepped = [agent_step(c) for c in clones]
                        if all(stepped):
                            time.sleep(0.5)
                            settle += _ksm_settle(mode)
                            after_step = group_memory([p for c in clones for p in c.pids()])
                        for c in clones:
                            activity(c)
                        time.sleep(0.5)
                        settle += _ksm_settle(mode)
                        after_activity = group_memory([p for c in clones for p in c.pids()])
                        copied_activity = _copied(clones, by_uffd)
                        row = {
                            "fanout_s": round(fanout_s, 3), "per_clone_restore_s": round(fanout_s / n, 3),
                            "fanout_phases": _phases(trace, fanout_s),
                            "peak_during_fork_mb": round((peak.peak - peak.base) / 2**20, 1),
                            "after_restore": after_restore.as_mb(), "after_activity": after_activity.as_mb(),
                            **({"after_step": after_step.as_mb()} if all(stepped) else {}),
                            "ksm_settle_s": settle, "ksmd_cpu_s": round(ksmd_cpu_seconds() - ksm0, 2),
                            "monitor_cpu_s": round(uffd.cpu_seconds([c.id for c in clones]), 3),
                            "uffd_images_mb": round(_tree_bytes(uffd.images_root()) / 2**20, 1),
                        }
                        if copied_activity is not None:
                            row["activity_copies_per_clone_mb"] = _activity_cost(copied_restore, copied_activity, n)
                        if n == counts[0]:
                            row.update(_delta_and_rollback(clones[0]))
                        mres["by_n"][str(n)] = row
                        print(f"fan-out {fanout_s:6.2f} s  unique {after_activity.unique_mb:8.1f} MB  "
                              f"pss {after_activity.as_mb()['pss']:8.1f} MB  ksmd {row['ksmd_cpu_s']} s  "
                              f"monitor {row['monitor_cpu_s']} s  load {os.getloadavg()[0]:.1f}")
                        print(f"{'':17}{_phases_line(row['fanout_phases'])}")
                    finally:
                        for c in clones:
                            c.close()
                first.delete()
                results["modes"][label] = mres
        finally:
            src.close()
    _summarise(results, counts)
    if plot:
        _plot(results, counts, plot)
        results["plot"] = plot
    return write("fork", results, json_path)


#: a benchmarked mode's label ends so: the mode without write tracking (the path before it)
UNTRACKED = "-untracked"
#: a benchmarked mode's label ends so: its clones restored as forks did before ``fanout``
BEFORE = "-before"


def _fanout_of(label: str) -> tuple[fanout.FanoutOptions, str]:
    """How a benchmarked mode's forks restore their clones, and the label without ``-before``."""
    if label.endswith(BEFORE):
        return fanout.BEFORE, label[:-len(BEFORE)]
    return fanout.DEFAULT, label


def _phases(trace: fanout.FanoutTrace, fanout_s: float) -> dict[str, dict]:
    """The fork's phases (:meth:`fanout.FanoutTrace.phases`) and ``agents``: from the last
    restore's end until the fork returned (each clone's agent answering its first call)."""
    phases = trace.phases()
    done = max((row["last_s"] for row in phases.values()), default=0.0)
    phases["agents"] = {"clones": 1, "sum_s": round(fanout_s - done, 3), "first_s": round(done, 3),
                        "last_s": round(fanout_s, 3)}
    return phases


def _phases_line(phases: dict[str, dict]) -> str:
    """``name sum (first-last)`` per phase: seconds summed over the clones, and when the
    phase's first run began and its last ended, from the fork's start."""
    return "  ".join(f"{name} {row['sum_s']:.2f} ({row['first_s']:.2f}-{row['last_s']:.2f})"
                     for name, row in phases.items())


def _variant(label: str) -> tuple[MemoryMode, dict[str, str]]:
    """A benchmarked mode: a memory mode, ``share+ksm`` (share, its clones KSM-mergeable), or
    ``copy-untracked`` / ``ksm-untracked`` (no write tracking); and the environment it needs."""
    if label == "share+ksm":
        return MemoryMode.SHARE, {SHARE_KSM_ENV: "1"}
    if label.endswith(UNTRACKED):
        return MemoryMode.parse(label[:-len(UNTRACKED)]), {WRITE_TRACKING_ENV: "0"}
    return MemoryMode.parse(label), {}


def _tree_bytes(path: Path) -> int:
    """Bytes allocated by the files under ``path`` (sparse files count what they hold)."""
    if not path.exists():
        return 0
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_blocks * 512
        except FileNotFoundError:
            continue  # another process's copy, dropped while this walked the tree
    return total


def _copied(clones: list[Workspace], by_uffd: bool) -> CopiedPages | None:
    """Private copies the clones hold of their page images' pages (share clones served by uffd)."""
    if not by_uffd:
        return None
    return copied_pages([p for c in clones for p in c.pids()], os.stat(uffd.images_root()).st_dev)


def _activity_cost(before: CopiedPages, after: CopiedPages, n: int) -> dict:
    """Private copies of image pages the activity made per share clone, in MB: those it changed,
    and those it wrote again with the bytes they held (a repaint of the same pixels)."""
    return {"changed": round((after.changed - before.changed) / n / 2**20, 1),
            "unchanged": round((after.unchanged - before.unchanged) / n / 2**20, 1)}


#: delta snapshots taken of a clone in a row; the one with the median frozen time is reported
#: (one was too noisy on a shared host to compare two paths by)
DELTA_SNAPSHOTS = 5


def _delta_and_rollback(clone: Workspace) -> dict:
    base = clone.base_snapshot
    clone.exec("echo small change > /root/delta.txt")
    deltas = sorted((clone.snapshot() for _ in range(DELTA_SNAPSHOTS)), key=lambda s: s.meta["timings"]["frozen_ms"])
    delta = deltas[len(deltas) // 2]
    frozen_all = sorted(s.meta["timings"]["frozen_ms"] for s in deltas)
    for s in deltas:
        if s is not delta:
            s.delete()
    clone.exec("echo after > /root/delta.txt")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        clone.rollback(delta)
        times.append(time.perf_counter() - t0)
    assert clone.exec("cat /root/delta.txt").text == "small change\n", "rollback lost the delta state"
    out = {"delta_snapshot": delta.meta["timings"], "delta_snapshot_mb": round(delta.size() / 2**20, 1),
           "delta_frozen_ms_all": frozen_all, "rollback": summary(times)}
    clone.rollback(base)  # let go of the delta snapshot before deleting it
    delta.delete()
    return out


def _summarise(res: dict, counts: tuple[int, ...]) -> None:
    modes = res["modes"]
    n_max = str(counts[-1])
    stages = [k for k in ("after_restore", "after_step", "after_activity")
              if all(k in m["by_n"][n_max] for m in modes.values())]
    rows = []
    for mode, m in modes.items():
        row = m["by_n"][n_max]
        first = m["by_n"][str(counts[0])]
        rows.append([
            mode, *(row[k]["unique"] for k in stages), row["after_activity"]["pss"],
            row["peak_during_fork_mb"], row["fanout_s"], row["per_clone_restore_s"],
            m["first_snapshot"]["frozen_ms"], first["delta_snapshot"]["frozen_ms"], first["delta_snapshot_mb"],
            first["rollback"]["median_ms"],
            row["ksmd_cpu_s"], row["monitor_cpu_s"],
        ])
    what = f"a {res['heap_mb']} MB-heap workspace" if res['heap_mb'] else f"the {res['image']} workspace"
    print(f"\nat n = {n_max} clones of {what} (memory in MB, times as named; "
          f"share's anonymous memory via {res['share_anon_mechanism']}):")
    print(table(rows, ["mode", *(f"uniq@{k.split('_')[1]}" for k in stages), "pss@activity", "peak", "fan-out s",
                       "s/clone", "frozen 1st ms", "frozen delta ms", "delta MB", "rollback ms", "ksmd s",
                       "monitor s"]))
    if "copy" in modes:
        by_stage = {k: {mode: round(m["by_n"][n_max][k]["unique"] / modes["copy"]["by_n"][n_max][k]["unique"], 3)
                        for mode, m in modes.items()} for k in stages}
        res["ratio_vs_copy"], res["ratio_vs_copy_by_stage"] = by_stage["after_activity"], by_stage
        print("\nmemory relative to copy at the same stage (target: share <= 0.15x):")
        for k, ratios in by_stage.items():
            print(f"  {k.replace('_', ' '):<15}" + ", ".join(f"{mode} {v:.3f}x" for mode, v in ratios.items()))
        share = modes.get("share", {}).get("by_n", {}).get(n_max, {})
        if "activity_copies_per_clone_mb" in share:
            _print_write_floor(res, share, int(n_max), modes["copy"]["by_n"][n_max]["after_activity"]["unique"])


def _print_write_floor(res: dict, share: dict, n: int, copy_mem: float) -> None:
    """What the activity's own writes cost: every copy-on-write by pages (uffd, the kernel
    module, fork) copies each page written; even one that could skip pages rewritten with the
    bytes they held would still hold share's memory less those copies."""
    cost = share["activity_copies_per_clone_mb"]
    floor = share["after_activity"]["unique"] - n * cost["unchanged"]
    res["share_without_same_byte_copies"] = {"mb": round(floor, 1), "ratio_vs_copy": round(floor / copy_mem, 3)}
    print(f"activity, per share clone: {cost['changed']} MB of image pages changed, {cost['unchanged']} MB rewritten "
          f"with the bytes they held;\nshare without the latter (a floor for copy-on-write by pages, even one that "
          f"skipped same-byte rewrites): {floor:.1f} MB = {floor / copy_mem:.3f}x of copy")


def _plot(res: dict, counts: tuple[int, ...], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, m in res["modes"].items():
        for ax, key in zip(axes, ("after_restore", "after_activity"), strict=True):
            ax.plot(counts, [m["by_n"][str(n)][key]["unique"] for n in counts], marker="o", label=mode)
    for ax, title in zip(axes, ("right after restore", "after activity"), strict=True):
        ax.set(title=f"clones' memory, {title}", xlabel="clones", ylabel="MB (distinct pages)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
