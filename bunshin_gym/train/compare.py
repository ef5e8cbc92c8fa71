"""``bunshin bench train``: the BunshinRL paper's Fig. 11, reward per GRPO step with Base and Full.

The main job (``bunshin train`` at its default size) runs several times from the same seed,
one after the other in one process: **base** rolls out with plain share forks (no prefix
cache, no speculation: ``--no-cache --no-speculation``), **full** with the prefix cache and
speculation (the defaults). Two base runs give the run-to-run noise: the same seed does
not repeat bit for bit, since sampled turns see real env output and the rollout threads
interleave differently. Full must agree with Base within that noise.

The runs take turns as base, full, base, so that load drift on a shared host hits the base
pair and the full run alike. Agreement is judged on the per-step reward curves:

- noise: the root mean square of the per-step difference of the two base runs;
- full's distance: the root mean square of full's per-step difference from the mean of the
  base runs. For runs drawn alike this is expected to be sqrt(3)/2 (0.87) of the noise
  (a single run against the mean of two), so it must come out no larger than the noise.

The same is reported for the mean reward over all steps and for the evaluations before and
after training.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from bunshin_gym.bench.report import table, write, write_text_beside
from bunshin_gym.train.args import Args

__all__ = ["MODES", "agreement", "mode_args", "plot", "run", "summarise"]

logger = logging.getLogger(__name__)

#: what each rollout mode changes in :class:`Args`
MODES = {"base": {"cache": False, "speculation": False}, "full": {"cache": True, "speculation": True}}
DEFAULT_RUNS = ("base", "full", "base")


def mode_args(mode: str, base: Args, out_dir: Path) -> Args:
    """The main job's arguments for one run in ``mode`` (``base`` or ``full``)."""
    if mode not in MODES:
        raise ValueError(f"bench train: unknown rollout mode {mode!r} (one of {', '.join(MODES)})")
    return dataclasses.replace(base, out_dir=str(out_dir), quiet=True, **MODES[mode])


def _rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0


def agreement(runs: list[dict]) -> dict:
    """Full against Base within the run-to-run noise of two Base runs (see the module docs).

    ``runs``: each with ``mode`` and ``rewards`` (per step). Needs two base runs and a full
    one; the first two base runs and the first full run are compared."""
    base = [r for r in runs if r["mode"] == "base"]
    full = [r for r in runs if r["mode"] == "full"]
    if len(base) < 2 or not full:
        raise ValueError(f"bench train needs two base runs and a full one, got {[r['mode'] for r in runs]}")
    b1, b2, f = base[0]["rewards"], base[1]["rewards"], full[0]["rewards"]
    n = min(len(b1), len(b2), len(f))
    if n == 0:
        raise ValueError("bench train: a run has no GRPO steps")
    b1, b2, f = b1[:n], b2[:n], f[:n]
    mean_b = [(x + y) / 2 for x, y in zip(b1, b2, strict=True)]
    noise = _rms([x - y for x, y in zip(b1, b2, strict=True)])
    dist = _rms([x - y for x, y in zip(f, mean_b, strict=True)])
    avg = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {
        "steps": n,
        "noise_rms_base_vs_base": round(noise, 4),
        "full_rms_vs_base_mean": round(dist, 4),
        "ratio": round(dist / noise, 3) if noise else None,
        "expected_ratio_if_alike": round(math.sqrt(3) / 2, 3),
        "ok": dist <= noise,
        "mean_reward": {"base_1": round(avg(b1), 4), "base_2": round(avg(b2), 4), "full": round(avg(f), 4)},
        "mean_reward_noise": round(abs(avg(b1) - avg(b2)), 4),
        "mean_reward_full_vs_base_mean": round(abs(avg(f) - avg(mean_b)), 4),
    }
    evals = [r.get("eval_after") for r in (base[0], base[1], full[0])]
    if all(e is not None for e in evals):
        out["eval_after"] = {"base_1": evals[0], "base_2": evals[1], "full": evals[2],
                             "noise": round(abs(evals[0] - evals[1]), 4),
                             "full_vs_base_mean": round(abs(evals[2] - (evals[0] + evals[1]) / 2), 4)}
    return out


def _run_entry(mode: str, label: str, report: dict, load: tuple[float, ...]) -> dict:
    steps = report["steps"]
    ev = report.get("eval") or {}
    t = report["totals"]
    return {
        "mode": mode, "label": label, "rewards": [round(s["reward"], 4) for s in steps],
        "rollout_s_per_step": [round(s["rollout_s"], 2) for s in steps],
        "eval_before": (ev.get("before") or {}).get("mean"), "eval_after": (ev.get("after") or {}).get("mean"),
        "rollout_s": round(t["rollout_s"], 1), "wall_s": round(report["wall_s"], 1),
        "peak_workspace_mb": round(t["peak_workspace_mb"], 1), "cache": t["cache"], "speculation": t["speculation"],
        "out_dir": report["out_dir"], "load_average_start": [round(x, 2) for x in load],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def run(json_path: str | None = None, *, base: Args | None = None, runs: tuple[str, ...] = DEFAULT_RUNS,
        out_root: Path | None = None, train: Callable[[Args], dict] | None = None) -> dict:
    """Train once per entry of ``runs`` (``base``/``full``) from ``base``'s seed and size
    (default: the main job's defaults); write the JSON, the table (``.txt``) and the PNG
    (``-rewards.png``) next to ``json_path``. ``train`` replaces the main job (tests)."""
    from bunshin_gym.config import paths

    base = base or Args()
    for mode in runs:
        if mode not in MODES:
            raise ValueError(f"bench train: unknown rollout mode {mode!r} (one of {', '.join(MODES)})")
    if train is None:
        from bunshin_gym.train.main import main as train
    out_root = out_root or paths().home / "train" / time.strftime("fig11-%Y%m%d-%H%M%S")
    load0 = os.getloadavg()
    print(f"bench train: {len(runs)} runs ({', '.join(runs)}) of the main job, {base.env_id}, seed {base.seed}, "
          f"{base.steps} GRPO steps, G={base.num_generations}; runs under {out_root}; load average {load0[0]:.1f}",
          flush=True)
    entries = []
    t_run = time.perf_counter()
    for i, mode in enumerate(runs, 1):
        label = f"{mode}-{sum(m == mode for m in runs[:i])}"
        load = os.getloadavg()
        report = train(mode_args(mode, base, out_root / label))
        entries.append(_run_entry(mode, label, report, load))
        e = entries[-1]
        print(f"  {label:>7}: mean reward per step {sum(e['rewards']) / max(1, len(e['rewards'])):.3f}, eval "
              f"{e['eval_before']} -> {e['eval_after']}, rollouts {e['rollout_s']} s, run {e['wall_s']} s, "
              f"load {e['load_average_end'][0]}", flush=True)
    res: dict = {"env": base.env_id, "seed": base.seed, "config": dataclasses.asdict(base), "modes": MODES,
                 "runs": entries, "run_s": round(time.perf_counter() - t_run, 1),
                 "load_average": {"start": [round(x, 2) for x in load0],
                                  "end": [round(x, 2) for x in os.getloadavg()]}}
    res["agreement"] = agreement(entries)
    text = summarise(res)
    print(text)
    if json_path:
        res["figure"] = plot(res, write_text_beside(json_path, text) + "-rewards.png")
    return write("train", res, json_path)


def summarise(res: dict) -> str:
    """The printed table: reward per step of every run, then the agreement."""
    runs = res["runs"]
    n = max(len(r["rewards"]) for r in runs)
    rows = [[i + 1, *(r["rewards"][i] if i < len(r["rewards"]) else "" for r in runs)] for i in range(n)]
    a = res["agreement"]
    lines = [f"{res['env']}: the main job from seed {res['seed']}, {res['config']['steps']} GRPO steps, "
             f"G={res['config']['num_generations']}; base = no prefix cache, no speculation; full = both",
             f"load average (1, 5, 15 min) at start {res['load_average']['start']}, "
             f"at end {res['load_average']['end']}",
             "", "mean reward per GRPO step (training rollouts):",
             table(rows, ["step", *(r["label"] for r in runs)]), "",
             table([[r["label"], f"{sum(r['rewards']) / max(1, len(r['rewards'])):.3f}", r["eval_before"],
                     r["eval_after"], r["rollout_s"], r["wall_s"], r["cache"].get("hit_rate", "-"),
                     r["speculation"].get("matched", "-"), r["load_average_end"][0]] for r in runs],
                   ["run", "mean reward", "eval before", "eval after", "rollout s", "run s", "cache hit rate",
                    "spec matched", "load"]), "",
             f"run-to-run noise (RMS of base-1 minus base-2 per step): {a['noise_rms_base_vs_base']}",
             f"full's distance (RMS of full minus the base mean per step): {a['full_rms_vs_base_mean']} "
             f"(ratio {a['ratio']}; runs drawn alike give about {a['expected_ratio_if_alike']})",
             f"mean reward over the steps: base {a['mean_reward']['base_1']} / {a['mean_reward']['base_2']}, "
             f"full {a['mean_reward']['full']} (noise {a['mean_reward_noise']}, full vs base mean "
             f"{a['mean_reward_full_vs_base_mean']})"]
    if "eval_after" in a:
        e = a["eval_after"]
        lines.append(f"evaluation after: base {e['base_1']} / {e['base_2']}, full {e['full']} (noise {e['noise']}, "
                     f"full vs base mean {e['full_vs_base_mean']})")
    lines.append(f"target: full agrees with base within the run-to-run noise: {'ok' if a['ok'] else 'NO'}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    """Reward per step of every run, the noise band of the two base runs shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = [r for r in res["runs"] if r["mode"] == "base"]
    if len(base) >= 2:
        n = min(len(base[0]["rewards"]), len(base[1]["rewards"]))
        lo = [min(base[0]["rewards"][i], base[1]["rewards"][i]) for i in range(n)]
        hi = [max(base[0]["rewards"][i], base[1]["rewards"][i]) for i in range(n)]
        ax.fill_between(range(1, n + 1), lo, hi, color="tab:blue", alpha=0.15, label="between the base runs")
    styles = {"base": ("tab:blue", "o"), "full": ("tab:red", "s")}
    for k, r in enumerate(res["runs"]):
        color, marker = styles[r["mode"]]
        ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=color, marker=marker, markersize=3,
                linestyle="-" if k < 2 else "--", label=r["label"])
    a = res["agreement"]
    ax.set(xlabel="GRPO step", ylabel="mean reward (training rollouts)")
    ax.set_title(f"reward per step, base vs full, seed {res['seed']} ({res['env']})\n"
                 f"full vs base mean RMS {a['full_rms_vs_base_mean']}, base-vs-base noise RMS "
                 f"{a['noise_rms_base_vs_base']} [{'ok' if a['ok'] else 'NO'}]", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

