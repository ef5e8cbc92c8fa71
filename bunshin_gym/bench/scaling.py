"""``bunshin bench scaling``: the BunshinRL paper's Fig. 2, peak memory against concurrent rollouts.

At each count N (default 8, 16, 32 and 64) N rollouts of the desktop env run at once, in
N / G groups of G (default 8) members: each group's set-up workspace (the source) is reset
to its task and its members are forked from it (``bench epoch``'s recorded trajectories,
one epoch). No member takes its first action before all N are forked (a barrier): on a
loaded host the groups' set-ups drift apart, and without it the first groups finished
before the last had forked (measured: 32 "concurrent" rollouts never all live at once).
Two modes per count, side by side:

- **copy-base**: the members are private-copy forks (as plain CRIU: every clone restores
  its own copy of the memory);
- **share-base**: the members are share forks (memory shared copy-on-write).

Memory is that of the run's own workspaces, sampled over time, as ``bench epoch`` samples
it (:class:`~bunshin_gym.bench.epoch.WorkspaceMemorySampler`): the sum of their cgroups'
charge, the tmpfs page images their share clones map and their userfaultfd monitors, the
sources included while they run; never host-wide. Each point's peak comes with its parts at
the peak. A group's source runs until its members are forked, then is parked (closed, its
state a snapshot: ``GroupVectorEnv(park_root=True)``, the default since 2026-12-02), so at the
barrier only the members run; a share clone's page images are what stays of the source in
memory. ``bench/results/scaling-osworld.txt`` (2026-12-01) predates parking: its sources ran
throughout (9, 18, 36 and 72 workspaces).

Counts run in rising order, the two modes taking turns first. Before a count runs, each
mode's peak is projected from its last count (per rollout, linearly); a count whose
projection would take the host's memory in use past ``host_fraction`` (80%) of its total
is not run for that mode and the stop is reported, with the projection.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bunshin_gym.bench.epoch import (
    ENV_KWARGS,
    OSWORLD,
    TASKS,
    ThinkTime,
    WorkspaceMemorySampler,
    _parts_at_peak,
    _parts_trace,
    make_trajectories,
    memory_figures,
    running_curve,
)
from bunshin_gym.bench.report import table, write, write_text_beside
from bunshin_gym.workspace.memstat import meminfo

__all__ = ["COUNTS", "MODES", "plot", "project", "refigure", "run", "summarise"]

log = logging.getLogger(__name__)

MODES = ("copy-base", "share-base")
COUNTS = (8, 16, 32, 64)


def project(points: list[dict], count: int) -> int | None:
    """Bytes a mode's peak is projected to reach at ``count`` rollouts, linearly per rollout
    from its largest count measured so far (None when nothing was measured)."""
    if not points:
        return None
    last = max(points, key=lambda p: p["rollouts"])
    return int(last["peak_mb"] * 2**20 * count / last["rollouts"])


def run_concurrently(recs: list[dict], *, env_id: str, group: int, mode: str,
                     barrier_timeout_s: float = 1800.0) -> dict:
    """Every group of ``recs`` at once in ``mode`` (``copy-base``: private-copy forks,
    ``share-base``: share forks), each member held before its first action until every
    member of every group is forked; memory sampled as ``bench epoch`` samples it."""
    import gymnasium as gym

    n = len(recs) * group
    barrier = threading.Barrier(n)
    kwargs = dict(ENV_KWARGS[env_id], memory_mode="copy" if mode == "copy-base" else "share")
    clock = time.perf_counter()
    released: list[float] = []
    results: list[list] = [[] for _ in recs]

    def one(k: int) -> None:
        rec = recs[k]
        members = rec["members"]
        env_kwargs = dict(kwargs, action_space=rec["kind"]) if env_id == OSWORLD else kwargs
        ends = [0.0] * group
        try:
            envs = gym.make_vec(env_id, num_envs=group, vectorization_mode="vector_entry_point", **env_kwargs)
        except BaseException:
            barrier.abort()  # the others would wait for members that never come
            raise

        def policy(i: int, obs: object, hist: list) -> object:
            if not hist:
                if barrier.wait(barrier_timeout_s) == 0:
                    released.append(time.perf_counter() - clock)
            time.sleep(members[i]["think"][len(hist)])
            return members[i]["actions"][len(hist)]

        def on_step(i: int, step: object) -> None:
            ends[i] = time.perf_counter() - clock

        try:
            trajs = envs.run_group(policy, options={"task": rec["task"]}, on_step=on_step)
        except Exception as e:  # noqa: BLE001 - a group whose set-up fails is reported; the others go on
            barrier.abort()
            log.warning("bench scaling: group %s (%s) failed: %s", k, rec["task"], e)
            results[k] = [(0.0, 0.0, f"group set-up failed: {e}")]
            return
        finally:
            envs.close()
        results[k] = [(t.reward, ends[t.member], t.error) for t in trajs]

    with WorkspaceMemorySampler(clock=clock) as mem, \
            ThreadPoolExecutor(max_workers=len(recs), thread_name_prefix="group") as pool:
        list(pool.map(one, range(len(recs))))
    wall = time.perf_counter() - clock
    start = released[0] if released else 0.0
    spans = [(round(start, 2), round(end, 2)) for rs in results for _, end, _ in rs]
    trace = [(round(t, 2), m) for t, m in mem.samples]
    return {"wall_s": round(wall, 2), "all_forked_s": round(start, 2),
            "rewards": [r for rs in results for r, _, _ in rs],
            "errors": [e for rs in results for _, _, e in rs if e], "running": running_curve(spans),
            "memory": memory_figures(trace), "memory_trace": [(t, round(m / 2**20, 1)) for t, m in trace],
            "memory_parts_at_peak": _parts_at_peak(mem), "memory_parts_trace": _parts_trace(mem)}


def _host_used() -> tuple[int, int]:
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


def run(json_path: str | None = None, *, counts: tuple[int, ...] = COUNTS, group: int = 8,
        modes: tuple[str, ...] = MODES, seed: int = 7, think: ThinkTime | None = None,
        host_fraction: float = 0.8, env_id: str = OSWORLD) -> dict:
    """Measure every count in every mode; write the JSON, the table (``.txt``) and the PNG
    next to ``json_path``."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"bench scaling: unknown modes {bad} (known: {', '.join(MODES)})")
    if group < 1 or any(c < group or c % group for c in counts):
        raise ValueError(f"bench scaling: every count must be a multiple of the group size {group}, got {counts}")
    if max(counts) // group > len(TASKS[env_id]):
        raise ValueError(f"bench scaling: {max(counts)} rollouts in groups of {group} need "
                         f"{max(counts) // group} tasks; {env_id} ships {len(TASKS[env_id])} in the bench's list")
    think = think or ThinkTime()
    load0 = os.getloadavg()
    print(f"bench scaling: {env_id}, {', '.join(map(str, counts))} concurrent rollouts in groups of G={group}; "
          f"modes {', '.join(modes)}; stop where a projection passes {host_fraction:.0%} of host memory; "
          f"load average {load0[0]:.1f}", flush=True)
    print(f"think time: {think.describe()}", flush=True)
    points: dict[str, list[dict]] = {m: [] for m in modes}
    stopped: dict[str, dict] = {}
    trajectories: dict[int, list[dict]] = {}
    t_run = time.perf_counter()
    for k, count in enumerate(sorted(counts)):
        tasks = TASKS[env_id][:count // group]
        recs = make_trajectories(env_id, tasks, group=group, epochs=1, seed=seed, think=think)
        trajectories[count] = recs
        order = list(modes) if k % 2 == 0 else list(reversed(modes))  # drift hits both alike
        for mode in order:
            if mode in stopped:
                continue
            want = project(points[mode], count)
            used, total = _host_used()
            if want is not None and used + want > host_fraction * total:
                stopped[mode] = {"at": count, "projected_mb": round(want / 2**20, 1),
                                 "host_used_mb": round(used / 2**20, 1), "host_total_mb": round(total / 2**20, 1),
                                 "reason": f"{count} rollouts projected at {want / 2**20:.0f} MB with the host "
                                           f"using {used / 2**20:.0f} of {total / 2**20:.0f} MB: past "
                                           f"{host_fraction:.0%}"}
                print(f"  {mode:>10} {count:>3} rollouts: not run, {stopped[mode]['reason']}", flush=True)
                continue
            load = os.getloadavg()
            e = run_concurrently(recs, env_id=env_id, group=group, mode=mode)
            used_after, _ = _host_used()
            point = {"rollouts": count, "groups": len(recs), "peak_mb": e["memory"]["peak_mb"],
                     "all_forked_s": e["all_forked_s"], "errors": e["errors"],
                     "per_rollout_mb": round(e["memory"]["peak_mb"] / count, 1),
                     "integral_gb_s": e["memory"]["integral_gb_s"], "parts_at_peak": e["memory_parts_at_peak"],
                     "most_workspaces": max((row[-1] for row in e["memory_parts_trace"]), default=0),
                     "most_running": max((n for _, n in e["running"]), default=0), "wall_s": e["wall_s"],
                     "rewards": e["rewards"], "memory_trace": e["memory_trace"],
                     "load_average_1m": [round(load[0], 2), round(os.getloadavg()[0], 2)],
                     "host_used_mb_after": round(used_after / 2**20, 1)}
            points[mode].append(point)
            print(f"  {mode:>10} {count:>3} rollouts: peak {point['peak_mb']} MB ({point['per_rollout_mb']} per "
                  f"rollout; parts {point['parts_at_peak']}), {point['most_workspaces']} workspaces at most, "
                  f"{point['most_running']} running at most, {point['wall_s']} s, load "
                  f"{point['load_average_1m']}", flush=True)
            if json_path:  # what is measured so far survives a run stopped before its end
                _save(json_path, _results(env_id, group, counts, seed, host_fraction, think, points, stopped,
                                          trajectories, t_run, load0), partial=True)
    res = _results(env_id, group, counts, seed, host_fraction, think, points, stopped, trajectories, t_run, load0)
    return _save(json_path, res)


def refigure(json_path: str) -> dict:
    """The table and the PNG of a saved run again (no rerun)."""
    res = json.loads(Path(json_path).read_text())
    return _save(json_path, res, partial=res.get("partial", False))


def _results(env_id: str, group: int, counts: tuple[int, ...], seed: int, host_fraction: float, think: ThinkTime,
             points: dict, stopped: dict, trajectories: dict, t_run: float, load0: tuple[float, ...]) -> dict:
    return {"env": env_id, "group": group, "counts": list(counts), "seed": seed, "host_fraction": host_fraction,
            "think": think.describe(), "modes": points, "stopped": stopped,
            "run_s": round(time.perf_counter() - t_run, 1),
            "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]},
            "trajectories": {str(c): t for c, t in trajectories.items()}}


def _save(json_path: str | None, res: dict, *, partial: bool = False) -> dict:
    """The table (printed unless ``partial``, and ``.txt``), the PNG and the JSON of ``res``."""
    res["ratios"] = ratios(res["modes"])
    res["partial"] = partial
    text = summarise(res)
    if not partial:
        print(text)
    if json_path:
        res["figure"] = plot(res, write_text_beside(json_path, text) + ".png")
    if partial:
        if json_path:
            Path(json_path).write_text(json.dumps(res, indent=1))
        return res
    return write("scaling", res, json_path)


def ratios(points: dict[str, list[dict]]) -> list[dict]:
    """share-base's peak over copy-base's at each count both measured."""
    copy = {p["rollouts"]: p for p in points.get("copy-base", [])}
    out = []
    for p in points.get("share-base", []):
        c = copy.get(p["rollouts"])
        if c and c["peak_mb"]:
            out.append({"rollouts": p["rollouts"], "share_mb": p["peak_mb"], "copy_mb": c["peak_mb"],
                        "ratio": round(p["peak_mb"] / c["peak_mb"], 3)})
    return out


def summarise(res: dict) -> str:
    rows = []
    for mode, pts in res["modes"].items():
        for p in pts:
            parts = p["parts_at_peak"]
            rows.append([mode, p["rollouts"], p["groups"], p["peak_mb"], p["per_rollout_mb"], parts.get("cgroups"),
                         parts.get("page_images"), parts.get("monitors"), p["most_workspaces"], p["most_running"],
                         p["wall_s"], f"{p['load_average_1m'][0]}-{p['load_average_1m'][1]}"])
    lines = [f"{res['env']}: concurrent rollouts in groups of G={res['group']} (sources included)"
             f"{' (partial: the run was still going)' if res.get('partial') else ''}; think time "
             f"{res['think']}",
             f"load average (1, 5, 15 min) at start {res['load_average']['start']}, "
             f"at end {res['load_average']['end']}",
             "", table(rows, ["mode", "rollouts", "groups", "peak MB", "MB/rollout", "cgroups", "page images",
                              "monitors", "workspaces", "running", "wall s", "load"]), ""]
    if res["ratios"]:
        lines.append(table([[r["rollouts"], r["share_mb"], r["copy_mb"], f"{r['ratio']:.2f}x"] for r in res["ratios"]],
                           ["rollouts", "share-base MB", "copy-base MB", "share / copy"]))
    for mode, s in res["stopped"].items():
        lines.append(f"{mode} stopped at {s['at']} rollouts: {s['reason']}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    """Peak memory against concurrent rollouts, one line per mode (the paper's Fig. 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, pts in res["modes"].items():
        if pts:
            ax.plot([p["rollouts"] for p in pts], [p["peak_mb"] / 1024 for p in pts], marker="o", label=mode)
    for r in res["ratios"]:
        ax.annotate(f"{r['ratio']:.2f}x", (r["rollouts"], r["share_mb"] / 1024), textcoords="offset points",
                    xytext=(0, -12), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(res["counts"], [str(c) for c in res["counts"]])
    ax.set(xlabel="concurrent rollouts", ylabel="peak memory (GiB)")
    ax.set_ylim(bottom=0)
    stops = "; ".join(f"{m} stopped at {s['at']}" for m, s in res["stopped"].items())
    ax.set_title(f"peak memory vs concurrent rollouts, {res['env']} (G={res['group']}, sources included)\n"
                 "the workspaces' cgroups + their tmpfs page images + their monitors"
                 + (" (partial run)" if res.get("partial") else "") + (f"\n{stops}" if stops else ""), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
