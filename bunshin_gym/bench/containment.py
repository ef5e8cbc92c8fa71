"""``bunshin bench containment``: what workspace containment costs, before and after in one run.

Issue 13's measure: containment (user namespace, capabilities, seccomp, masked /proc,
devices cgroup, per-snapshot ``/.snap`` views) may cost at most 10% of fan-out time, frozen
time and step latency, and must not change the memory ratios.

"Before" is a git worktree of ``--before REV``, by default ``7213947``, the last commit
of main without any containment; "after" is the tree this module is imported from. Both
run the same measures, each in its own subprocess with ``PYTHONPATH`` set to its tree (same
venv, CRIU build and snapshot pool; the old tree's runtime layer is built on first use,
keyed by its own source hash):

- ``bunshin bench fork`` of the base image, 300 MB heap, ``--counts 16 --modes copy,share``:
  fan-out time of 16 clones, frozen time of a first and of a delta snapshot, rollback time,
  distinct-page memory of the 16 clones after restore and after activity;
- step latency of ``Bunshin-Shell-v0``: ``STEPS`` steps of ``echo hi`` after a few warm-up
  steps, wall time around ``env.step`` (the old tree has no ``last_step_timing``, so the same
  measure is taken on both sides; the new one's ``step_s`` is kept in the JSON too). The two
  sides' envs live at once and take turns of ``STEP_BATCH`` steps, so that their steps are
  paired in time (:func:`paired_steps`).

The runs interleave before/after/before/after (``rounds`` of each), so that drift on a
shared machine hits both sides. Times are compared by the best round of each side (other
load only ever adds time), memory by the mean of the rounds; every round's figure and the
load average around it are kept in the JSON.

Example:
    >>> from bunshin_gym.bench import containment
    >>> containment.run("bench/results/containment.json")
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.bench.report import table, write

#: the last commit of main before any containment (the "before" side by default)
DEFAULT_BEFORE = "7213947"
#: containment may cost at most this factor of fan-out time, frozen time and step latency
TIME_GOAL = 1.10
#: a share/copy memory ratio counts as unchanged within this relative difference (or within
#: the round-to-round spread of either side, if that is larger: that is the noise)
MEMORY_RATIO_TOLERANCE = 0.05
STEPS = 100
WARMUP_STEPS = 5
FORK_ARGS = ("--image", "base", "--heap-mb", "300", "--counts", "16", "--modes", "copy,share")
FORK_N = "16"
RUN_TIMEOUT_S = 1800

# Runs in the measured tree's own interpreter setup (python -c), so it may use only what
# both trees have: gymnasium and the env id. It steps on command ("go N" on stdin: N steps,
# their wall times as a JSON line on stdout), so that the two sides can take turns.
STEP_WORKER = r"""
import json, sys, time
import gymnasium as gym
import bunshin_gym
warmup = int(sys.argv[1])
env = gym.make("Bunshin-Shell-v0", max_steps=10**6)
try:
    env.reset(options={"task": "shell/hello-file"})
    for _ in range(warmup):
        env.step("echo hi")
    print(json.dumps({"package": bunshin_gym.__file__}), flush=True)
    for line in sys.stdin:
        if not line.startswith("go "):
            break
        wall, inner = [], []
        for _ in range(int(line.split()[1])):
            t0 = time.perf_counter()
            obs, _, _, _, info = env.step("echo hi")
            wall.append(time.perf_counter() - t0)
            if "error" in info or obs["output"].strip() != "hi":
                raise SystemExit(f"step failed: {info} {obs['output']!r}")
            timing = getattr(env.unwrapped, "last_step_timing", None)
            if timing:
                inner.append(timing["step_s"])
        print(json.dumps({"step_s": wall, "last_step_timing_step_s": inner}), flush=True)
finally:
    env.close()
"""
#: steps per turn when the two sides take turns (:func:`paired_steps`)
STEP_BATCH = 5


@dataclass(frozen=True)
class Metric:
    """One compared figure: where it is read in a side's summary and how it is judged."""

    key: str
    label: str
    kind: str  # "time" (goal: after <= TIME_GOAL x before), "ratio" (unchanged within noise), "info"


METRICS: tuple[Metric, ...] = (
    Metric("fanout_copy_s", "fan-out 16 clones, copy (s)", "time"),
    Metric("fanout_share_s", "fan-out 16 clones, share (s)", "time"),
    Metric("frozen_first_copy_ms", "frozen, first snapshot, copy (ms)", "time"),
    Metric("frozen_first_share_ms", "frozen, first snapshot, share (ms)", "time"),
    Metric("frozen_delta_copy_ms", "frozen, delta snapshot, copy (ms)", "time"),
    Metric("frozen_delta_share_ms", "frozen, delta snapshot, share (ms)", "time"),
    Metric("rollback_copy_ms", "rollback median, copy (ms)", "time"),
    Metric("rollback_share_ms", "rollback median, share (ms)", "time"),
    Metric("step_median_ms", "shell step median (ms)", "time"),
    Metric("step_p90_ms", "shell step p90 (ms)", "time"),
    Metric("unique_restore_copy_mb", "16 clones after restore, copy (unique MB)", "info"),
    Metric("unique_restore_share_mb", "16 clones after restore, share (unique MB)", "info"),
    Metric("unique_activity_copy_mb", "16 clones after activity, copy (unique MB)", "info"),
    Metric("unique_activity_share_mb", "16 clones after activity, share (unique MB)", "info"),
    Metric("ratio_restore", "share/copy memory after restore", "ratio"),
    Metric("ratio_activity", "share/copy memory after activity", "ratio"),
)


# What one round measures ------------------------------------------------------------------
def fork_figures(fork: dict, n: str = FORK_N) -> dict[str, float]:
    """The compared figures of one ``bench fork`` JSON (modes copy and share, ``n`` clones)."""
    out: dict[str, float] = {}
    for mode in ("copy", "share"):
        m = fork["modes"][mode]
        row = m["by_n"][n]
        out[f"fanout_{mode}_s"] = row["fanout_s"]
        out[f"frozen_first_{mode}_ms"] = m["first_snapshot"]["frozen_ms"]
        out[f"frozen_delta_{mode}_ms"] = row["delta_snapshot"]["frozen_ms"]
        out[f"rollback_{mode}_ms"] = row["rollback"]["median_ms"]
        out[f"unique_restore_{mode}_mb"] = row["after_restore"]["unique"]
        out[f"unique_activity_{mode}_mb"] = row["after_activity"]["unique"]
    out["ratio_restore"] = round(out["unique_restore_share_mb"] / out["unique_restore_copy_mb"], 4)
    out["ratio_activity"] = round(out["unique_activity_share_mb"] / out["unique_activity_copy_mb"], 4)
    return out


def step_figures(steps: dict) -> dict[str, float]:
    """Median and p90 (same rule as :func:`bunshin_gym.bench.report.summary`) of the step times."""
    s = sorted(steps["step_s"])
    if not s:
        raise ValueError("no step times")
    return {"step_median_ms": round(statistics.median(s) * 1e3, 3),
            "step_p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 3)}


# Comparing the sides ----------------------------------------------------------------------
def combine(rounds: list[dict[str, float]], kind: str, key: str) -> float:
    """One side's figure over its rounds: the best (least) time, the mean of anything else."""
    values = [r[key] for r in rounds]
    return min(values) if kind == "time" else round(statistics.fmean(values), 4)


def judge(metric: Metric, before: list[dict[str, float]], after: list[dict[str, float]]) -> dict:
    """Before, after, after/before and whether the goal holds, for one metric."""
    b, a = combine(before, metric.kind, metric.key), combine(after, metric.kind, metric.key)
    row = {"label": metric.label, "kind": metric.kind, "before": b, "after": a,
           "ratio": round(a / b, 3) if b else None,
           "before_rounds": [r[metric.key] for r in before], "after_rounds": [r[metric.key] for r in after]}
    if metric.kind == "time":
        row["goal"] = f"<= {TIME_GOAL:.2f}x"
        row["ok"] = row["ratio"] is not None and row["ratio"] <= TIME_GOAL
    elif metric.kind == "ratio":
        noise = max(MEMORY_RATIO_TOLERANCE * b, _spread(row["before_rounds"]), _spread(row["after_rounds"]))
        row["goal"] = f"|after-before| <= {noise:.4f}"
        row["ok"] = abs(a - b) <= noise
    else:
        row["goal"], row["ok"] = "-", None
    return row


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def compare(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, dict]:
    """Every metric of :data:`METRICS` judged; ``before`` and ``after`` hold one dict per round."""
    if not before or not after:
        raise ValueError("need at least one round of each side")
    return {m.key: judge(m, before, after) for m in METRICS}


def render(rows: dict[str, dict]) -> str:
    """The side-by-side table of :func:`compare`'s rows."""
    def fmt(v: float) -> str:
        return f"{v:.4f}" if abs(v) < 1 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"

    out = []
    for r in rows.values():
        ok = "-" if r["ok"] is None else "yes" if r["ok"] else "NO"
        out.append([r["label"], fmt(r["before"]), fmt(r["after"]),
                    "-" if r["ratio"] is None else f"{r['ratio']:.3f}x", r["goal"], ok,
                    " / ".join(map(fmt, r["before_rounds"])), " / ".join(map(fmt, r["after_rounds"]))])
    return table(out, ["measure", "before", "after", "after/before", "goal", "ok", "before rounds", "after rounds"])


# Trees and subprocesses -------------------------------------------------------------------
def current_tree() -> Path:
    """The repository this module belongs to (the "after" side)."""
    return Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def worktree(rev: str, repo: Path | None = None) -> Path:
    """A checkout of ``rev``: an existing worktree of the repository at that commit with no
    tracked changes, else a new detached one under the temp dir. Its ``bunshin_gym/envs``
    links to the top-level ``envs/`` (what the editable install maps), so that it imports
    with only ``PYTHONPATH`` set."""
    repo = repo or current_tree()
    try:
        sha = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise ValueError(f"--before {rev!r} is not a commit of {repo}: {e.stderr.strip()}") from e
    tree = None
    for block in _git(repo, "worktree", "list", "--porcelain").split("\n\n"):
        fields = dict(line.split(" ", 1) for line in block.splitlines() if " " in line)
        path = Path(fields.get("worktree", ""))
        if fields.get("HEAD") == sha and path != repo and path.is_dir() and \
                not _git(path, "status", "--porcelain", "--untracked-files=no"):
            tree = path
            break
    if tree is None:
        tree = Path(tempfile.gettempdir()) / f"bunshin-before-{sha[:12]}"
        if not tree.exists():
            _git(repo, "worktree", "add", "--detach", str(tree), sha)
    link = tree / "bunshin_gym" / "envs"
    if (tree / "envs").is_dir() and not link.exists():
        link.symlink_to("../envs")
    return tree


def _side_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(tree: Path) -> str:
    """The path ``bunshin_gym.workspace`` imports from with ``tree`` on PYTHONPATH; it must be
    the tree's own (else both sides would measure the same code)."""
    out = subprocess.run([sys.executable, "-c", "import bunshin_gym.workspace as w; print(w.__file__)"],
                         cwd=tree, env=_side_env(tree), check=True, capture_output=True, text=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"with PYTHONPATH={tree}, bunshin_gym.workspace imports from {out}")
    return out


def _run(cmd: list[str], tree: Path, log: Path) -> None:
    # cwd is the tree: python -m / -c put the working directory first on sys.path
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=_side_env(tree), stdout=f, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... in {tree} exited {proc.returncode}; log {log}:\n{tail}")


def paired_steps(sides: dict[str, Path], work: Path, tag: str, steps: int = STEPS,
                 batch: int = STEP_BATCH) -> dict[str, dict]:
    """Shell step latency of every side, taken in turns of ``batch`` steps (before, after,
    before, ...): both envs live at once and only one steps at a time, so each side's steps
    sit next to the other's in time and load on a shared host hits both alike (a side
    measured for a minute after the other saw other load). Returns per side the step times
    and the package path the worker imported."""
    procs, docs = {}, {}
    try:
        for side, tree in sides.items():
            log = (work / f"steps-{tag}-{side}.log").open("w")
            procs[side] = subprocess.Popen([sys.executable, "-c", STEP_WORKER, str(WARMUP_STEPS)], cwd=tree,
                                           env=_side_env(tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, text=True)
            log.close()
        for side, proc in procs.items():
            docs[side] = {**_reply(proc, side, work, tag), "step_s": [], "last_step_timing_step_s": []}
        done = 0
        while done < steps:
            n = min(batch, steps - done)
            for side, proc in procs.items():
                proc.stdin.write(f"go {n}\n")
                proc.stdin.flush()
                got = _reply(proc, side, work, tag)
                docs[side]["step_s"] += got["step_s"]
                docs[side]["last_step_timing_step_s"] += got["last_step_timing_step_s"]
            done += n
        for proc in procs.values():
            proc.stdin.close()
        for side, proc in procs.items():
            if proc.wait(timeout=120):
                raise RuntimeError(f"the step worker of {side} exited {proc.returncode}; "
                                   f"log {work / f'steps-{tag}-{side}.log'}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for side, tree in sides.items():
        if not Path(docs[side]["package"]).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the step worker of {side} ran {docs[side]['package']}, not the code of {tree}")
    return docs


def _reply(proc: subprocess.Popen, side: str, work: Path, tag: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        log = work / f"steps-{tag}-{side}.log"
        raise RuntimeError(f"the step worker of {side} exited {proc.returncode}; log {log}:\n"
                           f"{log.read_text()[-3000:]}")
    return json.loads(line)


def measure(tree: Path, work: Path, tag: str, steps_doc: dict) -> dict:
    """One round of one side: the fork bench (a subprocess) and this side's share of the
    round's paired shell steps."""
    load0, t0 = os.getloadavg(), time.monotonic()
    fork_json = work / f"fork-{tag}.json"
    _run([sys.executable, "-m", "bunshin_gym.cli", "bench", "fork", *FORK_ARGS, "--json", str(fork_json),
          "--plot", str(work / f"fork-{tag}.png")], tree, work / f"fork-{tag}.log")
    fork = json.loads(fork_json.read_text())
    figures = {**fork_figures(fork), **step_figures(steps_doc)}
    if steps_doc["last_step_timing_step_s"]:
        figures["inner_step_median_ms"] = round(statistics.median(steps_doc["last_step_timing_step_s"]) * 1e3, 3)
    # the frozen times split into freeze / files / dump / thaw: where a difference comes from
    snapshots = {mode: {"first": m["first_snapshot"], "delta": m["by_n"][FORK_N]["delta_snapshot"]}
                 for mode, m in fork["modes"].items()}
    return {"tag": tag, "figures": figures, "snapshot_timings": snapshots, "wall_s": round(time.monotonic() - t0, 1),
            "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()]}


def run(json_path: str | None = None, *, before: str = DEFAULT_BEFORE, rounds: int = 2,
        steps: int = STEPS) -> dict:
    """Measure ``before`` (a git revision) and the current tree, interleaved, ``rounds`` each."""
    if rounds < 1 or steps < 1:
        raise ValueError("rounds and steps must be at least 1")
    after_tree = current_tree()
    before_tree = worktree(before, after_tree)
    sides = {"before": before_tree, "after": after_tree}
    imports = {side: check_imports(tree) for side, tree in sides.items()}
    load_start = [round(x, 2) for x in os.getloadavg()]
    print(f"bench containment: before = {before} ({_git(before_tree, 'rev-parse', '--short', 'HEAD')}, "
          f"{before_tree}), after = {_git(after_tree, 'rev-parse', '--short', 'HEAD')} ({after_tree}); "
          f"{rounds} rounds each, interleaved; load {load_start}")
    work = Path(tempfile.mkdtemp(prefix="bunshin-bench-containment-"))
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(rounds):
        steps_docs = paired_steps(sides, work, f"round{i + 1}", steps)
        for side, tree in sides.items():
            print(f"  round {i + 1} {side:<6} ...", end="", flush=True)
            r = measure(tree, work, f"{side}{i + 1}", steps_docs[side])
            runs[side].append(r)
            f = r["figures"]
            print(f" {r['wall_s']:6.1f} s  fan-out copy {f['fanout_copy_s']} s share {f['fanout_share_s']} s  "
                  f"step median {f['step_median_ms']} ms  load {r['load_start'][0]} -> {r['load_end'][0]}")
    shutil.rmtree(work)  # kept only when a run failed: its error names the log there
    rows = compare([r["figures"] for r in runs["before"]], [r["figures"] for r in runs["after"]])
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"\ncontainment's cost: before = {before}, after = current tree; times: best of {rounds} rounds, "
          f"memory: mean; load average {load_start} at start, {load_end} at end")
    print(render(rows))
    judged = [r for r in rows.values() if r["ok"] is not None]
    print(f"\nwithin the goal: {sum(r['ok'] for r in judged)} of {len(judged)}"
          + "".join(f"\n  over: {r['label']} {r['ratio']}x" for r in judged if not r["ok"]))
    results = {"before": {"rev": before, "commit": _git(before_tree, "rev-parse", "HEAD"), "tree": str(before_tree)},
               "after": {"commit": _git(after_tree, "rev-parse", "HEAD"), "tree": str(after_tree)},
               "imports": imports, "fork_args": list(FORK_ARGS), "steps": steps, "rounds": rounds,
               "combine": "time: min over rounds; memory and ratios: mean over rounds",
               "time_goal": TIME_GOAL, "memory_ratio_tolerance": MEMORY_RATIO_TOLERANCE,
               "load_start": load_start, "load_end": load_end, "runs": runs, "compare": rows}
    return write("containment", results, json_path)
