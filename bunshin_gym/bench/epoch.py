"""``bunshin bench epoch``: the BunshinRL paper's rollout evaluation on the desktop and web envs.

A recorded set of GRPO trajectories is replayed epoch by epoch in four modes side by side:

- **copy-base**: each group's members are private-copy forks of the set-up workspace (as
  plain CRIU: every clone restores its own copy of the memory);
- **share-base**: the members are share forks (memory shared copy-on-write);
- **spec**: share-base plus speculative tool execution, the selector trained on the earlier
  epochs' log (from epoch 2 on: epoch 1 has no log);
- **full**: spec plus the tool-prefix cache, kept across epochs; it snapshots a call's
  workspace (every 2nd depth) only where that spares more replay than a snapshot costs
  (``SNAPSHOT_POLICY``).

The trajectories come from a stochastic policy mixing each task's shipped oracle with
exploration in the env's real action types (pyautogui code and computer_13 dicts on the
desktop, WebArena action strings on the shop): per task a few exploration "styles" that the
members and epochs draw from (later epochs favour the first, as a converging policy
would), detours, and solutions that are complete or cut short (reward 0), so groups share
prefixes and later epochs revisit earlier ones. Tool latencies are the envs' own (apps
starting, pages loading). The policy's think time per turn is drawn from a lognormal
distribution (:class:`ThinkTime`, stated in the results) and slept, as a policy's
generation would take that long. The trajectories are saved with the results, and
``--replay FILE`` replays those of an earlier run.

Memory is what the run's own workspaces use, sampled over time: the sum of their cgroups'
charge, the tmpfs page images their share clones map or the prefix cache keeps for its hot
snapshots, their userfaultfd monitors, and (in full mode) the bytes of the cache's resident
snapshots held in the page cache only (the residency's count, under a budget sized from the
run unless ``--cache-budget-mb`` fixes it); never host-wide. Each sample's parts are saved
(``memory_parts_trace``), so a spike can be read back as what made it. The
live speculative forks (spec and full) and their snapshots are bounded by a share of the
run's peak memory (:data:`~bunshin_gym.rollout.speculation.MEMORY_FRACTION`, 3%: with the
cache's 2%, Full stays within the 5% of share-base the paper reports); a prediction whose
fork does not fit is not speculated (``skipped_memory``). After
the epochs, restores of a cached snapshot are timed hot and cold (:func:`measure_restores`).

The run keeps its boot snapshots (:func:`bunshin_gym.core.boots.keep`), as a trainer keeps
its envs for the whole run: each memory mode's workspace is booted once, before the first
epoch (``boot_s`` in the results), and no epoch of any mode pays a boot. Before this, an
epoch's groups closed their envs at its end, the last close deleted the shared boot, and
every epoch of every mode began with a boot (1.5-2.6 s for the desktop, 6.5-9.7 s for the
web shop, on session 16's host).

Sizes: ``--quick`` (2 tasks, G=2, 2 epochs) is a smoke test; the default (4 tasks, G=4,
3 epochs) fits a small shared machine in about half an hour; the paper's size is
``bunshin bench epoch --env Bunshin-OSWorld-v0 --paper --json bench/results/epoch-osworld-paper.json``
(8 tasks, G=8, 3 epochs, every group of an epoch at once: 64 rollouts and 8 set-up
workspaces live together, about 20 GB in copy-base with browsers open, so a host with
16+ cores and 64 GB), and the same with ``--env Bunshin-WebArena-v0``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym

from bunshin_gym.bench.report import table, write
from bunshin_gym.bench.rollout import MemorySampler, replay_group
from bunshin_gym.core import boots
from bunshin_gym.envs.osworld.oracle import to_computer_13
from bunshin_gym.rollout import PrefixCache, Speculation, TrajectoryLog
from bunshin_gym.rollout.runmemory import workspace_memory
from bunshin_gym.rollout.speculation import MEMORY_FRACTION as SPEC_MEMORY_FRACTION
from bunshin_gym.rollout.speculation import ForkTiming

log = logging.getLogger(__name__)

MODES = ("copy-base", "share-base", "spec", "full")
#: full's cache snapshots where that spares more replay than it costs (PrefixCache.want_snapshot):
#: on the desktop a snapshot takes seconds under the run's load, a call a fraction of one, and
#: most snapshots of the interval policy were never restored (measured: 36 made, 7 restored)
SNAPSHOT_POLICY = "cost"
OSWORLD, WEBARENA = "Bunshin-OSWorld-v0", "Bunshin-WebArena-v0"

#: tasks in the order ``--tasks N`` takes them (cheap and varied first)
TASKS = {
    OSWORLD: ["osworld/terminal-count-lines", "osworld/editor-fix-port", "osworld/chrome-open-about",
              "osworld/terminal-grep-errors", "osworld/files-copy-report", "osworld/editor-append-item",
              "osworld/terminal-sum-numbers", "osworld/chrome-site-search", "osworld/files-delete-tmp",
              "osworld/editor-enable-debug", "osworld/terminal-mkdir-projects", "osworld/calc-max-sales"],
    WEBARENA: [f"webarena/{n}" for n in (1001, 1006, 1019, 1004, 1008, 1025, 1012, 1034, 1014, 1029, 1016, 1036)],
}
#: env kwargs of every group (no a11y tree: 0.2-3 s a step; a short settle so a screenshot is
#: taken once the action's effect is drawn, as OSWorld waits after each action)
ENV_KWARGS = {OSWORLD: {"require_a11y_tree": False, "settle": 0.3}, WEBARENA: {}}

#: exploration in each action kind: short sequences that look around without changing what
#: the task checks (a detour followed by its way back, on the web)
EXPLORE = {
    "pyautogui": [["pyautogui.moveTo(960, 540)"], ["pyautogui.scroll(-3)"], ["pyautogui.scroll(3)"],
                  ["pyautogui.press('shift')"], ["WAIT"], ["pyautogui.moveTo(200, 300)", "WAIT"]],
    "computer_13": [[{"action_type": "MOVE_TO", "x": 960, "y": 540}], [{"action_type": "SCROLL", "dx": 0, "dy": -3}],
                    [{"action_type": "SCROLL", "dx": 0, "dy": 3}], [{"action_type": "PRESS", "key": "shift"}],
                    [{"action_type": "WAIT"}],
                    [{"action_type": "MOVE_TO", "x": 200, "y": 300}, {"action_type": "WAIT"}]],
    "webarena": [["scroll [down]"], ["scroll [up]"], ["click [link 'My Account']", "go_back"],
                 ["click [link 'Electronics']", "go_back"], ["type [searchbox 'Search'] [headphones] [1]", "go_back"],
                 ["scroll [down]", "scroll [up]"]],
}


@dataclass
class ThinkTime:
    """The policy's time per turn: lognormal around an assumed generation time of a 7-8B
    vision-language model, scaled down so an epoch fits a small machine.

    The default median, 6 s, is an assumption, not measured here: a 7B VLM (Qwen2.5-VL-7B,
    UI-TARS-7B) writing ~150-250 tokens of thought and action per turn at ~30-40 tokens/s
    on one GPU, after prefilling a screenshot; sigma 0.6 gives its spread (p90 ~2.2x the median).
    """

    median_s: float = 6.0
    sigma: float = 0.6
    scale: float = 0.2

    def draw(self, rng: random.Random) -> float:
        return round(self.scale * self.median_s * math.exp(rng.gauss(0.0, self.sigma)), 3)

    def describe(self) -> str:
        return (f"lognormal, median {self.median_s} s, sigma {self.sigma} (assumed per-turn generation time of a "
                f"7-8B VLM), scaled by {self.scale}: median {self.median_s * self.scale:.2f} s per turn")


# the shipped oracles ------------------------------------------------------------------
def oracle(env_id: str, task_id: str) -> list:
    """The task's shipped scripted solution (pyautogui strings on the desktop)."""
    if env_id == OSWORLD:
        from bunshin_gym.envs.osworld.tasks import task_paths

        return list(json.loads(task_paths()[task_id].read_text())["oracle"])
    if env_id == WEBARENA:
        from bunshin_gym.envs.webarena.tasks import load_config

        return list(load_config(task_id)["oracle"])
    raise ValueError(f"bench epoch: unknown env {env_id!r} (one of {OSWORLD}, {WEBARENA})")


def action_kind(env_id: str, task_index: int, oracle_actions: list) -> str:
    """The action space a task's group uses: on the desktop every other task speaks
    computer_13 (when its oracle translates), the rest pyautogui; the web its action strings."""
    if env_id == WEBARENA:
        return "webarena"
    if task_index % 2:
        try:
            for a in oracle_actions:
                to_computer_13(a)
            return "computer_13"
        except (ValueError, SyntaxError):
            pass
    return "pyautogui"


def _is_wait(action: Any) -> bool:
    text = action.get("action_type") if isinstance(action, dict) else action
    return text == "WAIT" or "time.sleep" in str(text)


def last_real_step(steps: list) -> int | None:
    """Index of a solution's last step that does something (not its final DONE/stop, not a
    wait): the step a solution cut short lacks."""
    return next((i for i in range(len(steps) - 2, -1, -1) if not _is_wait(steps[i])), None)


def _solution(kind: str, actions: list) -> list:
    if kind != "computer_13":
        return list(actions)
    return [c for a in actions for c in to_computer_13(a)]


# the recorded set --------------------------------------------------------------------
def make_trajectories(env_id: str, tasks: list[str], *, group: int, epochs: int, seed: int,
                      think: ThinkTime, oracles: dict[str, list] | None = None) -> list[dict]:
    """Per epoch and task, G members' actions and think times (see the module docs).

    ``oracles`` (task -> pyautogui/web actions) replaces the shipped ones (tests)."""
    if group < 1 or epochs < 1 or not tasks:
        raise ValueError(f"bench epoch needs tasks, group >= 1 and epochs >= 1 (got {len(tasks)} tasks, "
                         f"group {group}, epochs {epochs})")
    rng = random.Random(seed)
    oracles = oracles or {t: oracle(env_id, t) for t in tasks}
    kinds = {t: action_kind(env_id, i, oracles[t]) for i, t in enumerate(tasks)}
    # a few ways each task is explored, shared by members and epochs: prefixes repeat
    styles = {t: [[a for _ in range(rng.randint(1, 2)) for a in rng.choice(EXPLORE[kinds[t]])] for _ in range(3)]
              for t in tasks}
    out = []
    for epoch in range(epochs):
        for task_id in tasks:
            kind, solve = kinds[task_id], _solution(kinds[task_id], oracles[task_id])
            members = []
            for m in range(group):
                style = styles[task_id][rng.choices(range(3), weights=[3 + 2 * epoch, 2, 1])[0]]
                steps = list(solve)
                cut = last_real_step(steps)
                if rng.random() > 0.5 + 0.15 * epoch and cut is not None:
                    del steps[cut]  # a solution cut short: its last real step is missing
                if rng.random() < 0.3 / (1 + epoch):  # a detour in the middle of the solution
                    at = rng.randrange(len(steps))
                    steps[at:at] = rng.choice(EXPLORE[kind])
                actions = list(style) + steps
                slow = m == group - 1 and rng.random() < 0.5  # a straggler: long generations
                think_s = [round(think.draw(rng) * (2.0 if slow else 1.0), 3) for _ in actions]
                members.append({"actions": actions, "think": think_s})
            out.append({"epoch": epoch, "task": task_id, "kind": kind, "members": members})
    return out


# memory of the run's own workspaces ---------------------------------------------------
class WorkspaceMemorySampler(MemorySampler):
    """Samples :func:`workspace_memory` (plus ``extra()``: the prefix cache's resident
    snapshots not counted in it) in absolute bytes; ``parts`` keeps each sample's components."""

    relative = False

    def __init__(self, interval: float = 0.25, extra: Callable[[], int] | None = None, clock: float | None = None):
        self.extra = extra
        self.parts: list[dict] = []
        super().__init__(interval)
        if clock is not None:
            self._t0 = clock

    def read(self) -> int:
        parts = workspace_memory()
        parts["cache_resident"] = self.extra() if self.extra else 0
        self.parts.append(parts)
        return sum(v for k, v in parts.items() if k != "workspaces")


# figures ------------------------------------------------------------------------------
def running_curve(spans: list[tuple[float, float]], points: int = 200) -> list[tuple[float, int]]:
    """Rollouts still running over time: (t, how many spans hold t), from 0 to the last end."""
    if not spans:
        return []
    horizon = max(end for _, end in spans)
    ts = [horizon * i / points for i in range(points + 1)]
    return [(round(t, 3), sum(s <= t < e for s, e in spans)) for t in ts]


def memory_figures(trace: list[tuple[float, int]]) -> dict:
    """Peak (MB) and integral (GB-seconds, trapezoids) of a memory trace of (s, bytes)."""
    peak = max((m for _, m in trace), default=0)
    integral = sum((t1 - t0) * (m0 + m1) / 2 for (t0, m0), (t1, m1) in zip(trace, trace[1:], strict=False))
    return {"peak_mb": round(peak / 2**20, 1), "integral_gb_s": round(integral / 2**30, 2)}


# hot and cold restores ---------------------------------------------------------------
#: the kinds of restore :func:`measure_restores` times, in the order each round runs them
RESTORE_KINDS = ("spare", "hot", "cold")
#: the phases of a restore that :func:`measure_restores` times apart: the (module, function)
#: places each may be found at (the first found is wrapped while it measures). The env's first
#: observation after it is timed too ("observe"); what is left, "rest", is the records and
#: cgroup made before, the swap of the workspace's record and the connections after.
RESTORE_PHASES = {
    "tmpfs_copy": [("bunshin_gym.workspace.uffd", "prepare_images")],
    "monitor_start": [("bunshin_gym.workspace.uffd", "start")],
    "files": [("bunshin_gym.workspace.forking", "_lay_files"), ("bunshin_gym.workspace.snapshot", "_lay_files")],
    # the wait for `criu restore` to exit, once started
    "criu_restore": [("bunshin_gym.workspace.forking", "_finish_restore"),
                     ("bunshin_gym.workspace.snapshot", "_finish_restore")],
    "agent_ready": [("bunshin_gym.workspace.client", "AgentClient.wait_ready")],
    "verify": [("bunshin_gym.workspace.forking", "verify"), ("bunshin_gym.workspace.snapshot", "verify")],
    # the snapshot the workspace ran from, released (an ephemeral one waits for its users to go)
    "release_old": [("bunshin_gym.workspace.teardown", "release_snapshot"),
                    ("bunshin_gym.workspace.snapshot", "release_snapshot")],
}


class _PhaseTimer:
    """Seconds spent in each of :data:`RESTORE_PHASES` while active (the functions wrapped in
    place, restored on exit; the measurement runs one restore at a time), and in the methods
    of ``also`` ({phase: (object, method name)}: the env's first observation)."""

    def __init__(self, also: dict[str, tuple[Any, str]] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._also = also or {}

    def __enter__(self) -> _PhaseTimer:
        import importlib

        for phase, places in RESTORE_PHASES.items():
            for module, name in places:
                try:
                    owner: Any = importlib.import_module(module)
                    *outer, attr = name.split(".")
                    for part in outer:
                        owner = getattr(owner, part)
                    fn = getattr(owner, attr)
                except (ImportError, AttributeError):
                    continue  # moved: the next place, or the phase counts in "rest"
                self._saved.append((owner, attr, fn))
                setattr(owner, attr, self._timed(phase, fn))
                break
            else:
                log.warning("bench epoch: the restore phase %s was not found; it counts in 'rest'", phase)
        for phase, (owner, attr) in self._also.items():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, None))  # an instance attribute shadowing the method
            setattr(owner, attr, self._timed(phase, fn))
        return self

    def _timed(self, phase: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
        return run

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, fn in reversed(self._saved):
            if fn is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)


def measure_restores(env_id: str, task: str, actions: list, *, rounds: int = 5,
                     env_kwargs: dict | None = None) -> dict:
    """Seconds a restore of a cached snapshot takes hot and cold, in total and per phase
    (:data:`RESTORE_PHASES`), restored as the prefix cache restores (the env rolled back to
    it, a share workspace).

    Spare is a hot snapshot of which the cache keeps a clone restored ahead and frozen
    (:mod:`~bunshin_gym.rollout.spare_supply`, made untimed here as the cache makes it in
    the background): the rollback thaws and swaps it in. Hot is a snapshot the cache keeps
    resident without a spare (none made yet, or none fits the budget): its tmpfs copy of page images kept
    (:func:`~bunshin_gym.rollout.residency.keep_copy`) and its images in the page cache, so a
    restore maps the copy as it is. Cold is one the cache evicted
    (:func:`~bunshin_gym.rollout.residency.drop_snapshot`): copy dropped, images written back
    and dropped from the page cache, so a restore reads them from the pool and copies them
    again. Two sibling snapshots, one action each after the task's start, are restored in
    turn, hot and cold alternating, so that load drift hits both alike and the one restored
    is never the one the live workspace maps.

    The pool is a loop device over a file without direct I/O: the host caches that file too,
    so a cold restore also drops the host's cache of it
    (:func:`~bunshin_gym.workspace.pool.drop_backing_cache`) and reads from the disk. So do
    the other reads of the pool that btrfs's cache misses right after (the restored
    processes' files, faulted in as they run), as after an eviction under memory pressure."""
    import gymnasium as gym

    from bunshin_gym.rollout.residency import drop_snapshot, keep_copy, warm_snapshot
    from bunshin_gym.workspace import pool, spares, uffd

    if len(actions) < 2:
        raise ValueError("measure_restores needs two actions (one per sibling snapshot)")
    env = gym.make(env_id, memory_mode="share", **(env_kwargs or {}))
    snaps, sizes = [], []
    times: dict[str, list[float]] = {k: [] for k in RESTORE_KINDS}
    phases: dict[str, list[dict]] = {k: [] for k in RESTORE_KINDS}
    took_spare: list[bool] = []
    try:
        base = env.unwrapped
        env.reset(options={"task": task})
        for action in actions[:2]:
            base.rollback()  # to the task's start: the two snapshots are siblings
            env.step(action)
            snaps.append(base.snapshot(keep=True))
        sizes = [round(snap.workspace.size() / 2**20, 1) for snap in snaps]
        for _ in range(rounds):
            for heat in RESTORE_KINDS:
                for snap in snaps:
                    _settle()  # every kind alike: no reclaim of the last restore's predecessor runs beside
                    if heat in ("spare", "hot"):
                        keep_copy(snap.id, make=True)
                        warm_snapshot(snap.id)
                    if heat == "spare":  # as the cache keeps one of a hot snapshot restored before
                        snap.workspace.prepare_spares(1, mode="share")
                        ready = spares.pids(snap.workspace.id)
                    else:
                        drop_snapshot(snap.id)
                        deadline = time.monotonic() + 20  # the last restore's predecessor is reclaimed meanwhile
                        while uffd.has_image_copy(snap.id) and time.monotonic() < deadline:
                            uffd.release_images(snap_id=snap.id)
                            time.sleep(0.1)
                        pool.drop_backing_cache()  # else the images come back from the host's cache of the pool file
                    with _PhaseTimer({"observe": (base, "observe")}) as phase:
                        t0 = time.perf_counter()
                        base.rollback(snap)
                        base.workspace  # noqa: B018 - as the cache's restore: the workspace runs
                        total = time.perf_counter() - t0
                    times[heat].append(round(total, 3))
                    if heat == "spare":
                        took_spare.append(base.workspace.pid in ready)
                    known = {k: round(v, 3) for k, v in phase.seconds.items()}
                    phases[heat].append({**known, "rest": round(total - sum(phase.seconds.values()), 3)})
    finally:
        env.close()
        for snap in snaps:
            spares.discard(snap.workspace.id)
            uffd.keep_images(snap.id, keep=False)
            try:
                snap.workspace.delete()
            except Exception as e:  # noqa: BLE001 - a leftover snapshot is reported, the figures stand
                log.warning("bench epoch: deleting restore-measurement snapshot %s failed: %s", snap.id, e)
    out: dict = {k: {"times_s": v, "mean_s": round(sum(v) / len(v), 3) if v else None,
                     "median_s": round(statistics.median(v), 3) if v else None,
                     "phases_median_s": _median_phases(phases[k]), "phases_s": phases[k]}
                 for k, v in times.items()}
    out.update(task=task, rounds=rounds, images_mb=sizes, snapshots=[snap.id for snap in snaps],
               spares_taken=sum(took_spare), spares_tried=len(took_spare))
    return out


def _settle(timeout: float = 20.0) -> None:
    """Wait until the workspaces a rollback replaced are reclaimed (their records, owned by this
    process, name processes that no longer run until their reclaim is done). Measured without
    this, each hot restore ran beside the reclaim of the restore before it (its subvolume's
    deletion, its cgroup's removal), while a cold one waited for that reclaim to drop the
    snapshot's copy: the hot restores' CRIU phase came out 0.05-0.12 s slower."""
    from bunshin_gym.workspace import records

    me, deadline = os.getpid(), time.monotonic() + timeout
    while any(r.owner == me and not r.running() for r in records.all_records()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _median_phases(rows: list[dict]) -> dict:
    names = [*RESTORE_PHASES, "observe", "rest"]
    return {n: round(statistics.median(r.get(n, 0.0) for r in rows), 3) for n in names} if rows else {}


TARGETS = [
    ("share-base peak memory <= 0.6x copy-base (paper 0.70x)", "memory"),
    ("copy-base epoch >= 1.3x longer than share-base (paper 1.3x)", "epoch_time"),
    ("full >= 1.25x faster than share-base (paper 1.22x)", "epoch_time"),
    ("full peak memory within 5% of share-base", "memory"),
    (">= 65% of tool calls served by cache or speculation by epoch 3 (full; paper 65%)", "hit_rate"),
    ("rewards identical across modes, every epoch", "rewards"),
    ("a restore from a hot snapshot is cheaper than from disk (cold)", "restores"),
    ("no rollout's workspace fails, in any mode", "failures"),
]


def evaluate_targets(res: dict) -> list[dict]:
    """Each target with the measured figure and whether it is met (None: not measurable in this run)."""
    m = res["modes"]
    tot = {k: sum(e["wall_s"] for e in v["epochs"]) for k, v in m.items()}
    peak = {k: max(e["memory"]["peak_mb"] for e in v["epochs"]) for k, v in m.items()}
    out = []

    def add(i: int, value: str, ok: bool | None) -> None:
        name, figure = TARGETS[i]
        out.append({"target": name, "figure": figure, "measured": value, "ok": ok})

    if "copy-base" in m and "share-base" in m and peak["copy-base"]:
        r = peak["share-base"] / peak["copy-base"]
        add(0, f"{r:.2f}x ({peak['share-base']} / {peak['copy-base']} MB)", r <= 0.6)
        r = tot["copy-base"] / tot["share-base"]
        add(1, f"{r:.2f}x ({tot['copy-base']:.1f} / {tot['share-base']:.1f} s, all epochs)", r >= 1.3)
    if "full" in m and "share-base" in m:
        r = tot["share-base"] / tot["full"]
        add(2, f"{r:.2f}x ({tot['share-base']:.1f} / {tot['full']:.1f} s, all epochs)", r >= 1.25)
        r = peak["full"] / peak["share-base"] if peak["share-base"] else float("inf")
        add(3, f"{r:.3f}x ({peak['full']} / {peak['share-base']} MB)", r <= 1.05)
    if "full" in m:
        e = m["full"]["epochs"][-1]
        add(4, f"{e['served_fraction'] * 100:.1f}% in epoch {e['epoch']}", e["served_fraction"] >= 0.65
            if e["epoch"] >= 3 else None)
    first = next(iter(m.values()))
    same = all(a["rewards"] == b["rewards"] for v in m.values() for a, b in zip(v["epochs"], first["epochs"],
                                                                                 strict=True))
    add(5, "identical" if same else "DIFFER", same)
    r = res.get("restores")
    if r and (r.get("spare") or {}).get("median_s") and r["cold"].get("median_s"):
        spare, hot, cold = r["spare"]["median_s"], r["hot"]["median_s"], r["cold"]["median_s"]
        every = r["spares_taken"] == r["spares_tried"]  # else some "spare" restores were plain ones
        add(6, f"median with a spare {spare} s, hot without {hot} s, cold {cold} s ({cold / spare:.2f}x; spares "
               f"taken {r['spares_taken']}/{r['spares_tried']})", spare < cold and every)
    elif r and r["hot"].get("median_s") and r["cold"].get("median_s"):  # medians: a loaded host's outliers
        hot, cold = r["hot"]["median_s"], r["cold"]["median_s"]
        add(6, f"median hot {hot} s, cold {cold} s ({cold / hot:.2f}x; means {r['hot']['mean_s']}, "
               f"{r['cold']['mean_s']})", hot < cold)
    elif r and r["hot"]["mean_s"] and r["cold"]["mean_s"]:  # a run saved before medians were
        hot, cold = r["hot"]["mean_s"], r["cold"]["mean_s"]
        add(6, f"hot {hot} s, cold {cold} s ({cold / hot:.2f}x)", hot < cold)
    failed = {k: sum(len(e.get("workspace_failures", ())) for e in v["epochs"]) for k, v in m.items()}
    if all("workspace_failures" in e for v in m.values() for e in v["epochs"]):  # not in older runs
        add(7, ", ".join(f"{k} {n}" for k, n in failed.items()) + " failed", not any(failed.values()))
    return out


def _mark(ok: bool | None) -> str:
    return "ok" if ok else "-" if ok is None else "NO"


# running ------------------------------------------------------------------------------
class _ModeState:
    """What a mode keeps across epochs: its log, and in full mode the prefix cache."""

    def __init__(self, mode: str, work: Path, cache_budget: int | None = None):
        self.mode = mode
        self.log = TrajectoryLog(work / f"{mode}-log.jsonl")
        # each epoch's Speculation is trained anew on the log; what forks and turns took carries over
        self.spec_timing = ForkTiming()
        budget = {} if cache_budget is None else {"memory_budget": cache_budget}
        self.cache = PrefixCache(work / f"{mode}-cache", snapshot_every=2, log=self.log,
                                 snapshot_policy=SNAPSHOT_POLICY, **budget) \
            if mode == "full" else None


def run_epoch(state: _ModeState, recs: list[dict], *, env_id: str, group: int, parallel: int,
              min_speculate_s: float, spec_memory_fraction: float | None = SPEC_MEMORY_FRACTION) -> dict:
    """Every group of one epoch in one mode; ``parallel`` groups at a time (0: all at once, as a
    batch of rollouts runs)."""
    mode = state.mode
    spec = None
    entries = TrajectoryLog.load(state.log.path)
    if mode in ("spec", "full") and entries:
        spec = Speculation.from_log(entries, min_duration=min_speculate_s, memory_fraction=spec_memory_fraction,
                                    timing=state.spec_timing)
    clock = time.perf_counter()
    results: list[list] = [[] for _ in recs]
    spans: list[tuple[float, float]] = []
    from bunshin_gym.workspace import uffd

    resident = (lambda: state.cache.residency.bytes_outside(uffd.has_image_copy)) if state.cache else None

    def one(k: int) -> None:
        rec = recs[k]
        start = time.perf_counter() - clock
        kwargs = env_kwargs(env_id, rec["kind"], memory_mode_of(mode))
        results[k] = [(start, *r) for r in replay_group(rec, group, state.cache, spec,
                                                        None if state.cache else state.log, env_id=env_id,
                                                        env_kwargs=kwargs, kind=rec["kind"], clock=clock)]

    with WorkspaceMemorySampler(extra=resident, clock=clock) as mem, \
            ThreadPoolExecutor(max_workers=parallel or len(recs) or 1, thread_name_prefix="group") as pool:
        list(pool.map(one, range(len(recs))))
    wall = time.perf_counter() - clock
    served = {"cache": 0, "speculation": 0, "executed": 0}
    rewards = []
    failures = []  # episodes a failed workspace ended (reward 0): none is expected in any mode
    for k, group_res in enumerate(results):
        for member, (start, reward, _wall, kinds, end, failure) in enumerate(group_res):
            rewards.append(reward)
            if failure is not None:
                failures.append({"task": recs[k]["task"], "member": member, "error": failure})
            spans.append((round(start, 2), round(end, 2)))
            for kind in kinds:
                served[kind] += 1
    total = sum(served.values())
    trace = [(round(t, 2), m) for t, m in mem.samples]
    return {
        "epoch": recs[0]["epoch"] + 1 if recs else 0, "wall_s": round(wall, 2), "served": served,
        "served_fraction": round((served["cache"] + served["speculation"]) / total, 3) if total else 0.0,
        "rewards": rewards, "workspace_failures": failures, "member_spans": spans, "running": running_curve(spans),
        "memory": memory_figures(trace),
        "memory_trace": [(t, round(m / 2**20, 1)) for t, m in trace],
        "memory_parts_at_peak": _parts_at_peak(mem),
        "memory_parts_trace": _parts_trace(mem),
        "cache": state.cache.stats.as_dict() if state.cache else None,
        "cache_budget_mb": round(state.cache.residency.budget / 2**20, 1) if state.cache else None,
        "speculation": spec.stats.as_dict() if spec else None,
    }


def _parts_trace(mem: WorkspaceMemorySampler) -> list[list]:
    """Per sample: seconds, then MB of cgroups, page images, monitors and cache-resident
    snapshots, and the number of workspaces (:data:`PARTS_COLUMNS`)."""
    return [[t, *(round(p[k] / 2**20, 1) for k in PARTS_COLUMNS[1:-1]), p["workspaces"]]
            for (t, _), p in zip(mem.samples, mem.parts, strict=False)]


#: the columns of a ``memory_parts_trace`` row
PARTS_COLUMNS = ("s", "cgroups", "page_images", "monitors", "cache_resident", "workspaces")


def _parts_at_peak(mem: WorkspaceMemorySampler) -> dict:
    if not mem.samples:
        return {}
    i = max(range(len(mem.samples)), key=lambda j: mem.samples[j][1])
    parts = mem.parts[min(i, len(mem.parts) - 1)]
    return {k: (v if k == "workspaces" else round(v / 2**20, 1)) for k, v in parts.items()}


@dataclass
class Size:
    tasks: int
    group: int
    epochs: int


QUICK = Size(tasks=2, group=2, epochs=2)
DEFAULT = Size(tasks=4, group=4, epochs=3)
PAPER = Size(tasks=8, group=8, epochs=3)


def run(json_path: str | None = None, *, env_id: str = OSWORLD, tasks: list[str] | None = None,
        size: Size = DEFAULT, seed: int = 7, modes: tuple[str, ...] = MODES, think: ThinkTime | None = None,
        parallel: int = 0, min_speculate_s: float = 0.8, cache_budget_mb: int | None = None,
        replay: str | None = None, figures: str | None = None, restore_rounds: int = 5) -> dict:
    """Run the benchmark; write the JSON, the printed table (``.txt``) and a PNG per figure
    next to ``json_path`` (or under ``figures``, a path prefix). ``restore_rounds`` rounds of
    hot and cold restores are measured after the epochs (:func:`measure_restores`; 0: none).
    ``cache_budget_mb`` None leaves the prefix cache's budget sized from the run."""
    if env_id not in TASKS:
        raise ValueError(f"bench epoch: unknown env {env_id!r} (one of {OSWORLD}, {WEBARENA})")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"bench epoch: unknown modes {bad} (known: {', '.join(MODES)})")
    think = think or ThinkTime()
    if replay:
        prev = json.loads(Path(replay).read_text())
        trajectories, env_id = prev["trajectories"], prev["env"]
        tasks = list(dict.fromkeys(r["task"] for r in trajectories))
        size = Size(len(tasks), len(trajectories[0]["members"]), 1 + max(r["epoch"] for r in trajectories))
        seed, think = prev["seed"], ThinkTime(**prev["think"])
    else:
        tasks = tasks or TASKS[env_id][:size.tasks]
        trajectories = make_trajectories(env_id, tasks, group=size.group, epochs=size.epochs, seed=seed, think=think)
    calls = sum(len(m["actions"]) for r in trajectories for m in r["members"])
    load = os.getloadavg()
    print(f"bench epoch: {env_id}, {len(tasks)} tasks x G={size.group} x {size.epochs} epochs, {calls} tool calls "
          f"per mode; modes {', '.join(modes)}; {parallel or 'all'} group(s) at a time; load average {load[0]:.1f}")
    print(f"think time: {think.describe()}")
    work = Path(tempfile.mkdtemp(prefix="bunshin-bench-epoch-"))
    states = {m: _ModeState(m, work, None if cache_budget_mb is None else cache_budget_mb << 20) for m in modes}
    res: dict = {"env": env_id, "tasks": tasks, "group": size.group, "epochs": size.epochs, "seed": seed,
                 "think": asdict(think), "think_distribution": think.describe(), "parallel": parallel,
                 "min_speculate_s": min_speculate_s, "cache_budget_mb": cache_budget_mb,
                 "spec_memory_fraction": SPEC_MEMORY_FRACTION, "snapshot_policy": SNAPSHOT_POLICY,
                 "modes": {m: {"epochs": []} for m in modes}, "load_average": {}}
    t_run = time.perf_counter()
    with boots.keep():
        res["boot_s"] = boot_modes(env_id, modes, trajectories[0])
        _run_epochs(res, states, trajectories, modes, size, env_id, parallel, min_speculate_s, restore_rounds, work)
    res["run_s"] = round(time.perf_counter() - t_run, 1)
    res["load_average"] = {"start": [round(x, 2) for x in load], "end": [round(x, 2) for x in os.getloadavg()]}
    res["targets"] = evaluate_targets(res)
    res["noise"] = run_to_run_noise(res)
    text = summarise(res)
    print(text)
    res["trajectories"] = trajectories
    prefix = figures or (json_path.rsplit(".", 1)[0] if json_path else None)
    if prefix:
        Path(prefix + ".txt").parent.mkdir(parents=True, exist_ok=True)
        Path(prefix + ".txt").write_text(text + "\n")
        res["figures"] = plot(res, prefix)
    return write("epoch", res, json_path)


def _run_epochs(res: dict, states: dict, trajectories: list[dict], modes: tuple[str, ...], size: Size,
                env_id: str, parallel: int, min_speculate_s: float, restore_rounds: int, work: Path) -> None:
    """The epochs, every mode taking its turn in each, then the restores; the work folder is removed."""
    try:
        for epoch in range(size.epochs):
            recs = [r for r in trajectories if r["epoch"] == epoch]
            # the modes take turns, in an order rotated each epoch, so load drift hits all alike
            order = list(modes[epoch % len(modes):]) + list(modes[:epoch % len(modes)])
            for mode in order:
                e = run_epoch(states[mode], recs, env_id=env_id, group=size.group, parallel=parallel,
                              min_speculate_s=min_speculate_s)
                e["load_average_1m"] = round(os.getloadavg()[0], 2)
                res["modes"][mode]["epochs"].append(e)
                print(f"  {mode:>10} epoch {epoch + 1}: {e['wall_s']:7.1f} s, served "
                      f"{e['served_fraction'] * 100:5.1f}% (cache {e['served']['cache']}, spec "
                      f"{e['served']['speculation']}, executed {e['served']['executed']}), peak "
                      f"{e['memory']['peak_mb']} MB, {e['memory']['integral_gb_s']} GB*s, load {e['load_average_1m']}",
                      flush=True)
        if restore_rounds:
            first = trajectories[0]
            res["restores"] = measure_restores(env_id, first["task"], first["members"][0]["actions"],
                                               rounds=restore_rounds, env_kwargs=env_kwargs(env_id, first["kind"]))
            print(f"  restores of a cached snapshot ({res['restores']['images_mb']} MB of images): median with a "
                  f"spare {res['restores']['spare']['median_s']} s, hot {res['restores']['hot']['median_s']} s, "
                  f"cold {res['restores']['cold']['median_s']} s", flush=True)
    finally:
        for st in states.values():
            if st.cache is not None:
                st.cache.clear()
        shutil.rmtree(work, ignore_errors=True)


def memory_mode_of(mode: str) -> str:
    """The memory mode of a benchmark mode's forks (copy-base: private copies, as plain CRIU)."""
    return "copy" if mode == "copy-base" else "share"


def env_kwargs(env_id: str, kind: str, memory_mode: str | None = None) -> dict:
    """``gym.make`` arguments of the run's envs: the env's own, the desktop group's action
    kind, and the memory mode (None: the env's default)."""
    kwargs = dict(ENV_KWARGS[env_id])
    if env_id == OSWORLD:
        kwargs["action_space"] = kind
    if memory_mode is not None:
        kwargs["memory_mode"] = memory_mode
    return kwargs


def boot_modes(env_id: str, modes: tuple[str, ...], first: dict) -> dict[str, float]:
    """Boot each memory mode's workspace once (an env reset on the first group's task, then
    closed; the open :func:`~bunshin_gym.core.boots.keep` block keeps the boot): seconds each."""
    took: dict[str, float] = {}
    for memory_mode in dict.fromkeys(map(memory_mode_of, modes)):
        t0 = time.perf_counter()
        env = gym.make(env_id, **env_kwargs(env_id, first["kind"], memory_mode))
        try:
            env.reset(options={"task": first["task"]})
        finally:
            env.close()
        took[memory_mode] = round(time.perf_counter() - t0, 2)
        print(f"  booted the {memory_mode} workspace once for the run: {took[memory_mode]} s", flush=True)
    return took


def summarise(res: dict) -> str:
    """The printed table: per mode and epoch, then the targets with ok/NO."""
    rows = []
    for mode, m in res["modes"].items():
        for e in m["epochs"]:
            rows.append([mode, e["epoch"], e["wall_s"], e["served"]["cache"], e["served"]["speculation"],
                         e["served"]["executed"], f"{e['served_fraction'] * 100:.1f}%", e["memory"]["peak_mb"],
                         e["memory"]["integral_gb_s"], f"{sum(e['rewards']) / max(1, len(e['rewards'])):.3f}",
                         len(e.get("workspace_failures", ())), e.get("load_average_1m", "")])
    lines = [f"{res['env']}: {len(res['tasks'])} tasks x G={res['group']} x {res['epochs']} epochs "
             f"({res['parallel'] or 'all'} group(s) at a time); think time {res['think_distribution']}",
             f"load average (1, 5, 15 min) at start {res['load_average'].get('start')}, "
             f"at end {res['load_average'].get('end')}",
             "booted once for the whole run, before the epochs (no epoch pays a boot): "
             + (", ".join(f"{m} {s} s" for m, s in res["boot_s"].items()) if res.get("boot_s") else "not recorded"),
             "",
             table(rows, ["mode", "epoch", "wall s", "cache", "spec", "executed", "served", "peak MB", "GB*s",
                          "mean reward", "failed", "load"]), ""]
    lines.append(table([[t["figure"], t["target"], t["measured"], _mark(t["ok"])] for t in res["targets"]],
                       ["figure", "target", "measured", "ok"]))
    r = res.get("restores")
    if r and r["hot"].get("phases_median_s"):
        names = list(r["hot"]["phases_median_s"])
        lines += ["", f"restores of a cached snapshot ({r['images_mb']} MB of images, {len(r['hot']['times_s'])} "
                  "each, alternating), median seconds per phase:",
                  table([[k, r[k]["median_s"], *r[k]["phases_median_s"].values()] for k in RESTORE_KINDS if k in r],
                        ["restore", "total", *names])]
    failures = [(mode, e["epoch"], f) for mode, m in res["modes"].items() for e in m["epochs"]
                for f in e.get("workspace_failures", ())]
    if failures:
        lines += ["", "episodes ended by a failed workspace:"]
        lines += [f"  {mode} epoch {epoch}: {f['task']} member {f['member']}: {f['error']}"
                  for mode, epoch, f in failures]
    noise = run_to_run_noise(res)
    if noise is not None:
        lines.append(f"\nrun-to-run noise: spec's epoch 1 runs exactly as share-base's (no log to speculate from "
                     f"yet): {noise['spec_s']} s vs {noise['share_base_s']} s, a ratio of {noise['ratio']}")
    return "\n".join(lines)


def run_to_run_noise(res: dict) -> dict | None:
    """Spec's first epoch has no log, so it runs as share-base does: the two epochs' times
    differ only by noise (load on a shared host), the yardstick for the time targets."""
    m = res["modes"]
    if "spec" not in m or "share-base" not in m or m["spec"]["epochs"][0].get("speculation"):
        return None
    a, b = m["spec"]["epochs"][0]["wall_s"], m["share-base"]["epochs"][0]["wall_s"]
    return {"spec_s": a, "share_base_s": b, "ratio": round(a / b, 3) if b else None}


def refigure(json_path: str) -> dict:
    """Recompute the targets, the table and the figures of a saved run (no rerun)."""
    res = json.loads(Path(json_path).read_text())
    res["targets"] = evaluate_targets(res)
    res["noise"] = run_to_run_noise(res)
    prefix = json_path.rsplit(".", 1)[0]
    text = summarise(res)
    Path(prefix + ".txt").write_text(text + "\n")
    res["figures"] = plot(res, prefix)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(text)
    return res


def plot(res: dict, prefix: str) -> dict[str, str]:
    """One PNG per figure; each title carries its targets' ok/NO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks: dict[str, list[str]] = {}
    for t in res["targets"]:
        marks.setdefault(t["figure"], []).append(f"{t['target']}: {t['measured']} [{_mark(t['ok'])}]")
    modes, out = res["modes"], {}

    def save(fig, ax, name: str, title: str) -> None:
        ax.set_title("\n".join([title, *marks.get(name, [])]), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}-{name.replace('_', '-')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out[name] = path

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(modes)
    for k, (mode, m) in enumerate(modes.items()):
        ax.bar([e["epoch"] + (k - len(modes) / 2 + 0.5) * width for e in m["epochs"]],
               [e["wall_s"] for e in m["epochs"]], width, label=mode)
    ax.set(xlabel="epoch", ylabel="wall time (s)")
    save(fig, ax, "epoch_time", f"epoch wall time, {res['env']}")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, m in modes.items():
        offset, xs, ys = 0.0, [], []
        for e in m["epochs"]:
            xs += [offset + t for t, _ in e["running"]]
            ys += [n for _, n in e["running"]]
            offset += e["wall_s"]
        ax.plot(xs, ys, label=mode)
    ax.set(xlabel="s (epochs back to back)", ylabel="rollouts running")
    save(fig, ax, "running", "rollouts still running over time")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, m in modes.items():
        offset, xs, ys = 0.0, [], []
        for e in m["epochs"]:
            xs += [offset + t for t, _ in e["memory_trace"]]
            ys += [mb for _, mb in e["memory_trace"]]
            offset += e["wall_s"]
        peak = max(e["memory"]["peak_mb"] for e in m["epochs"])
        integral = sum(e["memory"]["integral_gb_s"] for e in m["epochs"])
        ax.plot(xs, ys, label=f"{mode} (peak {peak} MB, {integral:.1f} GB*s)")
    ax.set(xlabel="s (epochs back to back)", ylabel="MB (workspaces' cgroups + page images + monitors)")
    save(fig, ax, "memory", "memory of the run's workspaces over time")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, m in modes.items():
        ax.plot([e["epoch"] for e in m["epochs"]], [100 * e["served_fraction"] for e in m["epochs"]], marker="o",
                label=mode)
    ax.set(xlabel="epoch", ylabel="% of tool calls served (cache or speculation)", ylim=(0, 100))
    save(fig, ax, "hit_rate", "tool calls served from the cache or speculation")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (mode, m) in enumerate(modes.items()):
        ax.plot([e["epoch"] + 0.03 * k for e in m["epochs"]],
                [sum(e["rewards"]) / max(1, len(e["rewards"])) for e in m["epochs"]], marker="os^D"[k % 4],
                label=mode)
    ax.set(xlabel="epoch", ylabel="mean reward")
    save(fig, ax, "rewards", "reward per epoch and mode (must be identical)")
    return out

