"""The training report: JSON, a PNG of the curves, and the curve printed as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BAR = 30


def text_curve(rewards: list[float], label: str = "reward") -> str:
    """One line per step: the value and a bar (rewards are in [0, 1])."""
    lines = [f"step  {label:>6}"]
    for i, r in enumerate(rewards, 1):
        n = max(0, min(BAR, round(r * BAR)))
        lines.append(f"{i:>4}  {r:>6.3f}  {'#' * n}{'.' * (BAR - n)}")
    return "\n".join(lines)


def summary(report: dict) -> str:
    """The printed report."""
    steps = report["steps"]
    rewards = [s["reward"] for s in steps]
    out = [f"bunshin train: {report['config']['env_id']} on {len(report['tasks'])} tasks, policy "
           f"{report['config']['policy']}, G={report['config']['num_generations']}, {len(steps)} GRPO steps "
           f"in {report['wall_s']:.0f} s", "", "mean reward per GRPO step (training rollouts):",
           text_curve(rewards)]
    if rewards:
        k = max(1, len(rewards) // 3)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        out.append(f"first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({last - first:+.3f})")
    ev = report.get("eval") or {}
    if ev.get("before") and ev.get("after"):
        out += ["", f"evaluation ({ev['episodes_per_task']} sampled episodes per task):",
                f"{'task':<24} {'before':>7} {'after':>7}"]
        for task in report["tasks"]:
            out.append(f"{task:<24} {ev['before']['per_task'].get(task, 0):>7.2f} "
                       f"{ev['after']['per_task'].get(task, 0):>7.2f}")
        out.append(f"{'mean':<24} {ev['before']['mean']:>7.3f} {ev['after']['mean']:>7.3f}")
    t = report["totals"]
    out += ["", f"rollout time: {t['rollout_s']:.1f} s total, {t['rollout_s_per_step']:.2f} s per step "
                f"(generation {t['generate_s']:.1f} s); training steps {t['train_s']:.1f} s; "
                f"warm start {report['warm_start']['wall_s']:.1f} s",
            f"peak memory: trainer process {t['peak_rss_mb']:.0f} MB (VmHWM); live workspaces "
            f"{t['peak_workspace_mb']:.0f} MB distinct resident pages",
            f"prefix cache: hit rate {t['cache'].get('hit_rate', 0):.3f} ({t['cache'].get('hits', 0)} hits, "
            f"{t['cache'].get('misses', 0)} misses, {t['cache'].get('snapshots', 0)} snapshots)",
            f"speculation: {t['speculation'].get('launched', 0)} launched, {t['speculation'].get('matched', 0)} "
            f"matched, {t['speculation'].get('mismatched', 0)} mismatched (accuracy "
            f"{t['speculation'].get('accuracy', 0):.3f}), {t['speculation'].get('skipped_cached', 0)} skipped: "
            f"cached, {t['speculation'].get('skipped_fast', 0)} skipped: fast",
            f"report: {report['files']['json']}  plot: {report['files']['png']}"]
    vis = report.get("vision")
    if vis:
        grids = ", ".join("x".join(map(str, g)) for g in vis["grids_loss_pass"]) or "none"
        out.insert(-1, f"screenshots: {vis['images_loss_pass']} encoded in the loss pass (patch grids {grids}), "
                       f"{vis['images_generation']} in generation; vision tower moved by "
                       f"{vis['vision_update_norm']:.3g} (L2)")
    return "\n".join(out)


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(x, [s["reward"] for s in steps], marker="o", label="mean env reward")
    ev = report.get("eval") or {}
    if ev.get("before"):
        ax.axhline(ev["before"]["mean"], color="grey", ls="--", label="eval before")
    if ev.get("after"):
        ax.axhline(ev["after"]["mean"], color="green", ls="--", label="eval after")
    ax.set(xlabel="GRPO step", ylabel="reward", title="reward", ylim=(-0.05, 1.05))
    ax.legend()
    ax = axes[1]
    ax.plot(x, [s["rollout_s"] for s in steps], marker="o", label="rollout")
    ax.plot(x, [s["generate_s"] for s in steps], marker="o", label="generation")
    ax.set(xlabel="GRPO step", ylabel="seconds", title="rollout time")
    ax.legend()
    ax = axes[2]
    ax.plot(x, [s["cache"].get("hit_rate", 0) for s in steps], marker="o", label="prefix-cache hit rate")
    ax.plot(x, [s["speculation"].get("accuracy", 0) for s in steps], marker="o", label="speculation accuracy")
    ax.set(xlabel="GRPO step", ylabel="rate", title="cache and speculation", ylim=(-0.05, 1.05))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["files"] = {"json": str(out / "report.json"), "png": str(out / "report.png")}
    plot(report, report["files"]["png"])
    Path(report["files"]["json"]).write_text(json.dumps(report, indent=1, default=_default))
    return report


def _default(v: Any) -> Any:
    return str(v)
