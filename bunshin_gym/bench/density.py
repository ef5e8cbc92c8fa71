"""``bunshin bench density``: how many live desktops one host holds.

One OSWorld desktop is booted and its task set up and snapshotted once; then share-mode (or
copy) clones are forked from that snapshot in groups of 16. Every live clone takes a step (a pyautogui action; the
observation is a screenshot) every ``period_s`` seconds, from a small pool of threads,
as a rollout's policies would. Groups are added until the next group would push the host
past ``mem_fraction`` of its memory (projected from what the last group cost), the step
median of the last period passes ``step_budget_ms``, or ``max_desktops`` is reached. The
reason it stopped is reported: that is what limits density on this host.

Memory is that of this run's workspaces only (their cgroups, the page images their share
clones map, their userfaultfd monitors; :func:`~bunshin_gym.rollout.runmemory.workspace_memory`),
never the host's total; the host's figure is used only for the stop rule. CPU is the
workspaces' own (their cgroups' ``cpu.stat``) and the host's busy share.

Modes run one after the other in one invocation: ``share``, ``share+ksm`` (share clones that
KSM may merge) and ``copy``.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

from bunshin_gym.bench.report import table, write
from bunshin_gym.config import overridden
from bunshin_gym.core import fork_pending
from bunshin_gym.rollout.runmemory import workspace_memory
from bunshin_gym.workspace.memory import SHARE_KSM_ENV
from bunshin_gym.workspace.memstat import meminfo

log = logging.getLogger(__name__)

ENV_ID = "Bunshin-OSWorld-v0"
TASK = "osworld/terminal-mkdir-projects"
MODES = ("share", "share+ksm", "copy")
#: actions the clones take in turn: cheap pointer moves, each followed by a screenshot
ACTIONS = tuple(f"pyautogui.moveTo({x}, {y})" for x, y in ((200, 200), (640, 360), (900, 500), (320, 240)))


@dataclass
class DensityConfig:
    """What one density run does (the CLI's options)."""

    modes: tuple[str, ...] = MODES
    group: int = 16
    period_s: float = 10.0
    max_desktops: int = 400
    mem_fraction: float = 0.9
    step_budget_ms: float = 250.0
    step_threads: int = 4
    task: str = TASK


# host figures (for the stop rule and for context) --------------------------------------------
def host_used_fraction() -> float:
    info = meminfo()
    return 1.0 - info["MemAvailable"] / info["MemTotal"]


def _host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cpus since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _cpu_ticks(envs: list) -> dict[int, int]:
    """CPU ticks (user + system, with reaped children's) of every process of the desktops,
    by host pid (cgroup v1 hosts have no per-workspace cpuacct group here)."""
    out = {}
    for env in envs:
        try:
            pids = env.unwrapped.workspace.pids()
        except Exception:  # noqa: BLE001 - a desktop closed meanwhile counts nothing
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                out[pid] = sum(int(x) for x in fields[11:15])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cpu_seconds(before: dict[int, int], after: dict[int, int]) -> float:
    """CPU seconds the desktops used between two :func:`_cpu_ticks` readings (new processes
    count from zero; those gone in between are not counted)."""
    hz = os.sysconf("SC_CLK_TCK")
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / hz


# the stepping clones ---------------------------------------------------------------------------
@dataclass
class Stepper:
    """Steps every live clone once per ``period_s`` from a thread pool; records latencies."""

    period_s: float
    threads: int
    clones: list = field(default_factory=list)
    #: (end time, seconds, whether it was the clone's first step: that one faults in the
    #: pages a screenshot touches, so it is reported apart and not judged by the budget)
    samples: list[tuple[float, float, bool]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="density-step")
        self._due: dict[int, float] = {}
        self._busy: set[int] = set()
        self._stepped: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="density-scheduler", daemon=True)
        self._rng = random.Random(7)

    def start(self) -> None:
        self._thread.start()

    def add(self, envs: list) -> None:
        now = time.monotonic()
        with self._lock:
            for i, env in enumerate(envs):
                self.clones.append(env)
                # spread the new group's first steps over one period
                self._due[id(env)] = now + self.period_s * i / max(1, len(envs))

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [e for e in self.clones if self._due[id(e)] <= now and id(e) not in self._busy]
                for e in due:
                    self._busy.add(id(e))
                    self._due[id(e)] = now + self.period_s
            for e in due:
                self._pool.submit(self._step, e)
            self._stop.wait(0.02)

    def _step(self, env: Any) -> None:
        t0 = time.monotonic()
        try:
            _, _, _, _, info = env.step(self._rng.choice(ACTIONS))
            if info.get("error"):
                self.errors.append(str(info["error"])[:300])
        except Exception as e:  # noqa: BLE001 - counted and reported; the run goes on
            self.errors.append(f"{type(e).__name__}: {e}"[:300])
        finally:
            t1 = time.monotonic()
            with self._lock:
                self.samples.append((t1, t1 - t0, id(env) not in self._stepped))
                self._stepped.add(id(env))
                self._busy.discard(id(env))

    def window(self, seconds: float, first: bool = False) -> list[float]:
        """Step latencies (ms) of the steps that ended in the last ``seconds``: later steps,
        or with ``first`` the clones' first ones."""
        since = time.monotonic() - seconds
        with self._lock:
            return sorted(s * 1e3 for t, s, f in self.samples if t >= since and f == first)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)


def _pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else float("nan")


# one mode --------------------------------------------------------------------------------------
def run_mode(label: str, cfg: DensityConfig) -> dict:
    with overridden({SHARE_KSM_ENV: "1"} if label == "share+ksm" else {}):
        return _run_mode(label, cfg)


def _run_mode(label: str, cfg: DensityConfig) -> dict:
    mode = "share" if label == "share+ksm" else label
    source = gym.make(ENV_ID, action_space="pyautogui", require_a11y_tree=False, memory_mode=mode,
                      task=cfg.task, max_steps=10**9)
    stepper = Stepper(cfg.period_s, cfg.step_threads)
    rows: list[dict] = []
    pool: list = []
    stopped = f"reached --max-desktops {cfg.max_desktops}"
    try:
        source.reset(seed=0)
        mem0 = workspace_memory()
        print(f"  {label}: source desktop up, {mem0['cgroups'] / 2**20:.0f} MB in its cgroup", flush=True)
        # one snapshot of the set-up desktop for the whole run; each group's workspaces are
        # forked from it together (a clone() per group would snapshot the source again)
        pool = source.unwrapped.clone(cfg.max_desktops, lazy=True)
        stepper.start()
        per_group = None
        while len(stepper.clones) < cfg.max_desktops:
            if per_group is not None and host_used_fraction() + per_group / meminfo()["MemTotal"] > cfg.mem_fraction:
                stopped = (f"memory: one more group ({per_group / 2**20:.0f} MB) would pass "
                           f"{cfg.mem_fraction:.0%} of the host's memory")
                break
            before = sum(workspace_memory()[k] for k in ("cgroups", "page_images", "monitors"))
            t0 = time.perf_counter()
            clones = pool[len(stepper.clones):len(stepper.clones) + cfg.group]
            try:
                fork_pending(clones)
            except Exception as e:  # noqa: BLE001 - a fork that fails ends the run and says why
                stopped = f"fork failed: {type(e).__name__}: {e}"[:300]
                break
            fanout = time.perf_counter() - t0
            stepper.add(clones)
            # one full period, so that every clone has stepped at least once since it came
            everyone = [source, *stepper.clones]
            cpu0, host0, ticks0 = time.monotonic(), _host_cpu_ticks(), _cpu_ticks(everyone)
            time.sleep(cfg.period_s * 1.5)
            elapsed = time.monotonic() - cpu0
            host1 = _host_cpu_ticks()
            ws_cpu = _cpu_seconds(ticks0, _cpu_ticks(everyone))
            parts = workspace_memory()
            total = parts["cgroups"] + parts["page_images"] + parts["monitors"]
            per_group = max(0, total - before)
            lat = stepper.window(cfg.period_s)
            first = stepper.window(cfg.period_s * 1.5, first=True)
            n = len(stepper.clones)
            row = {
                "desktops": n, "fanout_s": round(fanout, 2),
                "memory_mb": round(total / 2**20, 1),
                "per_desktop_mb": round(total / 2**20 / (n + 1), 1),  # the source is one of them
                "last_group_mb": round(per_group / 2**20, 1),
                "parts_mb": {k: round(parts[k] / 2**20, 1) for k in ("cgroups", "page_images", "monitors")},
                "host_used": round(host_used_fraction(), 3),
                "steps": len(lat), "first_steps": len(first),
                "step_p50_ms": _pct(lat, 0.5), "step_p90_ms": _pct(lat, 0.9),
                "step_p99_ms": _pct(lat, 0.99), "first_step_p50_ms": _pct(first, 0.5),
                "desktops_cpu_cores": round(ws_cpu / elapsed, 2),
                "host_cpu_busy": round((host1[0] - host0[0]) / max(1, host1[1] - host0[1]), 3),
                "errors": len(stepper.errors),
            }
            rows.append(row)
            print(f"  {label:>9}  {n:4d} desktops  fork {fanout:5.1f} s  {row['memory_mb']:8.0f} MB "
                  f"({row['per_desktop_mb']:.1f}/desktop)  step p50 {row['step_p50_ms']} ms "
                  f"p90 {row['step_p90_ms']} ms (first {row['first_step_p50_ms']} ms)  "
                  f"cpu {row['desktops_cpu_cores']} cores  "
                  f"host mem {row['host_used']:.0%}  errors {row['errors']}", flush=True)
            if lat and statistics.median(lat) > cfg.step_budget_ms:
                stopped = f"step latency: median {statistics.median(lat):.0f} ms > {cfg.step_budget_ms:.0f} ms"
                break
    finally:
        stepper.stop()
        for env in pool:
            env.close()
        source.close()
    held = rows[-1]["desktops"] if rows else 0
    if rows and stopped.startswith("step latency"):
        # the last group broke the budget: the count held within it is the one before
        held = rows[-2]["desktops"] if len(rows) > 1 else 0
    return {"rows": rows, "stopped": stopped, "held": held, "errors": stepper.errors[:10]}


def run(json_path: str | None = None, cfg: DensityConfig | None = None) -> dict:
    cfg = cfg or DensityConfig()
    info = meminfo()
    print(f"bench density: {ENV_ID} {cfg.task}; groups of {cfg.group}, a step every {cfg.period_s:.0f} s each; "
          f"stop at {cfg.mem_fraction:.0%} of {info['MemTotal'] / 2**30:.1f} GiB, a step median over "
          f"{cfg.step_budget_ms:.0f} ms, or {cfg.max_desktops} desktops; modes {', '.join(cfg.modes)}", flush=True)
    results: dict = {"config": vars(cfg) | {"modes": list(cfg.modes)}, "cpus": os.cpu_count(),
                     "host_memory_gib": round(info["MemTotal"] / 2**30, 1), "modes": {}}
    for label in cfg.modes:
        results["modes"][label] = run_mode(label, cfg)
    rows = []
    for label, res in results["modes"].items():
        last = res["rows"][-1] if res["rows"] else {}
        rows.append([label, res["held"], last.get("per_desktop_mb", "-"), last.get("step_p50_ms", "-"),
                     last.get("step_p90_ms", "-"), last.get("desktops_cpu_cores", "-"), res["stopped"]])
    print()
    print(table(rows, ["mode", "desktops held", "MB/desktop", "step p50 ms", "p90 ms", "cpu cores", "stopped by"]))
    return write("density", results, json_path)


def plot(doc: dict, path: str | Path) -> None:
    """Memory and step median against live desktops, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, res in doc["modes"].items():
        xs = [r["desktops"] for r in res["rows"]]
        ax1.plot(xs, [r["memory_mb"] / 1024 for r in res["rows"]], marker="o", label=label)
        ax2.plot(xs, [r["step_p50_ms"] for r in res["rows"]], marker="o", label=label)
    ax1.set(xlabel="live desktops", ylabel="workspaces' memory (GiB)")
    ax2.set(xlabel="live desktops", ylabel="step median (ms)")
    ax2.axhline(doc["config"]["step_budget_ms"], color="grey", linestyle="--")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path)
