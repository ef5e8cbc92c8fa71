"""``bunshin bench rollout``: rollout epochs in Base, Spec and Full mode, side by side.

It replays a recorded set of GRPO-style trajectories (generated from a seed, saved with
the results): for each task a group of G members whose tool calls share prefixes (they
explore alike, then diverge), with realistic tool latencies (slow calls sleep inside the
workspace), policy think times and a few stragglers. Each epoch replays every group in:

- **Base**: the group's members are forks of the set-up workspace (memory shared), no more;
- **Spec**: plus speculative tool execution with a selector trained on earlier epochs' log;
- **Full**: plus the tool-prefix cache, persisted across epochs.

It reports per mode and epoch: wall time, tool calls served by the cache, by speculation,
and executed, peak memory, and the rewards (which must be identical in all modes).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import gymnasium as gym

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.bench.report import table, write
from bunshin_gym.envs.shell.env import load_shell_task
from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, TrajectoryLog, signature
from bunshin_gym.rollout.observation import observation_text
from bunshin_gym.workspace.memstat import used_memory

TASKS = ["shell/count-files", "shell/grep-errors", "shell/sum-numbers", "shell/find-largest"]
# exploration calls an agent makes on these tasks, with the latency the tool has (seconds)
PROBES = [
    ("ls -la", 0.1), ("pwd", 0.05), ("cat /etc/os-release", 0.1), ("df -h /", 0.3), ("ps aux | head", 0.3),
    ("find / -maxdepth 2 -type d 2>/dev/null | head -n 20", 1.2), ("du -sh /usr 2>/dev/null", 1.5),
    ("grep -r TODO /etc 2>/dev/null | head -n 3", 1.0), ("apt list --installed 2>/dev/null | wc -l", 2.0),
]


def make_trajectories(seed: int, epochs: int, group: int, tasks: list[str]) -> list[dict]:
    """The recorded set: per epoch and task, G members' actions and think times."""
    rng = random.Random(seed)
    out = []
    # each task has a few "styles" of exploring; members and epochs draw from them, so groups
    # share prefixes and later epochs revisit earlier ones (as a policy that converges does)
    styles = {t: [rng.sample(PROBES, k=rng.randint(2, 3)) for _ in range(3)] for t in tasks}
    for epoch in range(epochs):
        for task_id in tasks:
            oracle = load_shell_task(task_id).oracle()
            members = []
            for m in range(group):
                style = styles[task_id][rng.choices(range(3), weights=[4, 2, 1 + epoch])[0]]
                probes = list(style)
                if rng.random() < 0.25:  # an individual detour
                    probes.insert(rng.randrange(len(probes) + 1), rng.choice(PROBES))
                actions = [f"sleep {lat}; {cmd}" for cmd, lat in probes]
                solve = oracle[:-1] if rng.random() < 0.7 else ["echo 0 > /home/user/answer.txt"]
                actions += solve + ["DONE"]
                straggler = m == group - 1 and rng.random() < 0.5
                think = [round(rng.uniform(0.8, 2.0) * (2.0 if straggler else 1.0), 2) for _ in actions]
                members.append({"actions": actions, "think": think})
            out.append({"epoch": epoch, "task": task_id, "members": members})
    return out


class MemorySampler:
    """Samples memory every ``interval`` seconds in a thread: host memory in use above what it
    was at the start, unless a subclass's :meth:`read` counts something narrower."""

    relative = True  # samples are read() less the first reading

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.base = self.read() if self.relative else 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int:
        return used_memory()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, self.read() - self.base))
            time.sleep(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mb(self) -> float:
        return round(max((m for _, m in self.samples), default=0) / 2**20, 1)


def replay_group(rec: dict, group: int, cache: PrefixCache | None, spec: Speculation | None,
                 log: TrajectoryLog | None, *, env_id: str = "Bunshin-Shell-v0", env_kwargs: dict | None = None,
                 kind: str = "shell", clock: float | None = None
                 ) -> list[tuple[float, float, list[str], float, str | None]]:
    """Replay one recorded group (``rec["members"]``: each member's actions and think times).

    Per member: reward, wall time, how each call was served ("cache", "speculation",
    "executed"), when it ended (seconds after ``clock``, a ``perf_counter`` reading;
    default: the group's start), and the error of a workspace that failed under it (None:
    none did; the episode then ended early with reward 0, which a benchmark must report)."""
    members = rec["members"]
    clock = time.perf_counter() if clock is None else clock
    envs = gym.make_vec(env_id, num_envs=group, vectorization_mode="vector_entry_point",
                        cache=cache, speculation=spec, **(env_kwargs or {}))
    kinds: list[list[str]] = [[] for _ in range(group)]
    ends = [0.0] * group
    failures: list[str | None] = [None] * group
    seen: list[object] = [None] * group  # the observation each member's next call is made from

    def policy(i, obs, hist):
        seen[i] = obs
        time.sleep(members[i]["think"][len(hist)])
        return members[i]["actions"][len(hist)]

    def on_step(i, step):
        info = step.info
        served = "cache" if info.get("cache") == "hit" else "speculation" if info.get("speculation") == "hit" \
            else "executed"
        if log is not None:  # a cache logs by itself
            log.record(task=rec["task"], episode=f"{rec['epoch']}-{rec['task']}-{i}", depth=len(kinds[i]),
                       signature=signature(step.action, kind), action=step.action, duration=step.tool_s,
                       served=served, observation=observation_text(seen[i]))
        kinds[i].append(served)
        ends[i] = time.perf_counter() - clock
        if info.get("workspace_failed"):
            failures[i] = str(info.get("error"))

    try:
        trajs = envs.run_group(policy, options={"task": rec["task"]}, on_step=on_step)
    finally:
        envs.close()
    return [(t.reward, t.wall_s, kinds[t.member], ends[t.member], failures[t.member]) for t in trajs]


def run_mode(mode: str, trajectories: list[dict], epochs: int, group: int, work: Path) -> dict:
    log = TrajectoryLog(work / f"{mode}-log.jsonl")
    cache = PrefixCache(work / f"{mode}-cache", snapshot_every=2, log=log) if mode == "full" else None
    res = {"epochs": []}
    for epoch in range(epochs):
        spec = None
        entries = TrajectoryLog.load(log.path)
        if mode in ("spec", "full") and entries:
            selector = SpecToolSelector.train(entries)
            spec = Speculation(selector, durations=TrajectoryLog.durations(entries), min_duration=0.5)
        served = {"cache": 0, "speculation": 0, "executed": 0}
        rewards, running = [], []
        t_epoch = time.perf_counter()
        with MemorySampler() as mem:
            for rec in (r for r in trajectories if r["epoch"] == epoch):
                offset = time.perf_counter() - t_epoch
                for reward, wall_s, kinds, _, _ in replay_group(rec, group, cache, spec, None if cache else log):
                    rewards.append(reward)
                    running.append((round(offset, 2), round(offset + wall_s, 2)))
                    for kind in kinds:
                        served[kind] += 1
        wall = time.perf_counter() - t_epoch
        total = sum(served.values())
        res["epochs"].append({
            "epoch": epoch + 1, "wall_s": round(wall, 2), "served": served,
            "served_fraction": round((served["cache"] + served["speculation"]) / total, 3) if total else 0,
            "peak_memory_mb": mem.peak_mb, "rewards": rewards, "member_spans": running,
            "memory_trace": mem.samples[::4], "cache": cache.stats.as_dict() if cache else None,
            "speculation": spec.stats.as_dict() if spec else None,
        })
        e = res["epochs"][-1]
        print(f"  {mode:>4} epoch {epoch + 1}: {wall:6.1f} s, served {e['served_fraction'] * 100:5.1f}% "
              f"(cache {served['cache']}, spec {served['speculation']}, executed {served['executed']}), "
              f"peak {mem.peak_mb} MB")
    if cache is not None:
        cache.clear()
    return res


def run(json_path: str | None = None, *, epochs: int = 3, group: int = 4, tasks: list[str] | None = None,
        seed: int = 7, modes: tuple[str, ...] = ("base", "spec", "full"), plot: str | None = None) -> dict:
    tasks = tasks or TASKS
    trajectories = make_trajectories(seed, epochs, group, tasks)
    calls = sum(len(m["actions"]) for r in trajectories for m in r["members"])
    print(f"bench rollout: {len(tasks)} tasks x G={group} x {epochs} epochs, {calls} tool calls per mode; "
          f"modes {', '.join(modes)}")
    work = Path(tempfile.mkdtemp(prefix="bunshin-bench-rollout-"))
    results = {"tasks": tasks, "group": group, "epochs": epochs, "seed": seed, "modes": {}}
    try:
        for mode in modes:
            results["modes"][mode] = run_mode(mode, trajectories, epochs, group, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _summarise(results)
    results["trajectories"] = trajectories
    if plot:
        _plot(results, plot)
        results["plot"] = plot
    return write("rollout", results, json_path)


def _summarise(res: dict) -> None:
    modes = res["modes"]
    rows = []
    for mode, m in modes.items():
        for e in m["epochs"]:
            rows.append([mode, e["epoch"], e["wall_s"], e["served"]["cache"], e["served"]["speculation"],
                         e["served"]["executed"], f"{e['served_fraction'] * 100:.1f}%", e["peak_memory_mb"],
                         f"{sum(e['rewards']) / len(e['rewards']):.3f}"])
    print("\n" + table(rows, ["mode", "epoch", "wall s", "cache", "spec", "executed", "served", "peak MB",
                              "mean reward"]))
    if "base" in modes:
        last = res["epochs"] - 1
        base_t = modes["base"]["epochs"][last]["wall_s"]
        base_mem = max(e["peak_memory_mb"] for e in modes["base"]["epochs"])
        res["summary"] = {}
        for mode, m in modes.items():
            res["summary"][mode] = {
                "speedup_last_epoch": round(base_t / m["epochs"][last]["wall_s"], 3),
                "served_fraction_last_epoch": m["epochs"][last]["served_fraction"],
                "peak_memory_vs_base": round(max(e["peak_memory_mb"] for e in m["epochs"]) / base_mem, 3)
                if base_mem else None,
                "rewards_identical_to_base": all(
                    a["rewards"] == b["rewards"] for a, b in zip(m["epochs"], modes["base"]["epochs"], strict=True)),
            }
        print("\nepoch", res["epochs"], "vs base: " + "; ".join(
            f"{k} {v['speedup_last_epoch']:.2f}x faster, {v['served_fraction_last_epoch'] * 100:.0f}% served, "
            f"peak memory {v['peak_memory_vs_base']}x, rewards identical: {v['rewards_identical_to_base']}"
            for k, v in res["summary"].items()))
        print("targets: Full >= 1.4x faster than Base per epoch; >= 75% served by epoch 3; "
              "peak memory of Full within 5% of Base; rewards identical")


def _plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    last = res["epochs"] - 1
    for mode, m in res["modes"].items():
        e = m["epochs"][last]
        spans = e["member_spans"]
        horizon = max(end for _, end in spans)
        ts = [horizon * i / 200 for i in range(201)]
        axes[0].plot(ts, [sum(s <= t < end for s, end in spans) for t in ts], label=mode)
        trace = e["memory_trace"]
        axes[1].plot([t for t, _ in trace], [m_ / 2**20 for _, m_ in trace], label=mode)
        axes[2].plot([x["epoch"] for x in m["epochs"]], [100 * x["served_fraction"] for x in m["epochs"]],
                     marker="o", label=mode)
    axes[0].set(title=f"rollouts still running (epoch {last + 1})", xlabel="s", ylabel="members")
    axes[1].set(title=f"memory over time (epoch {last + 1})", xlabel="s", ylabel="MB above idle")
    axes[2].set(title="tool calls served from cache or speculation", xlabel="epoch", ylabel="%")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    print(json.dumps(run()["summary"], indent=1))
