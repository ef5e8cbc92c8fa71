"""``bunshin train``: GRPO with TRL over bunshin envs, top to bottom (CleanRL style).

1. the task set and the policy (the tiny offline model by default, or a local HF model);
2. the rollout engine: trajectory log, prefix cache, speculation, group envs;
3. a short supervised warm start from the oracle solutions, played through the real envs;
4. an evaluation, GRPO steps (TRL's ``GRPOTrainer`` with :class:`BunshinRollout`), an evaluation;
5. the report: reward per step, rollout time, peak memory, cache and speculation rates, plots.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    env_id: str = arg("Bunshin-Shell-v0", "env to train in")
    api: str = arg("rollout_func", "how TRL drives the env: 'rollout_func' (bunshin's group rollouts, token-exact) or "
                   "'environment_factory' (TRL's own tool loop over bunshin_gym.integrations.trl's env classes)")
    tasks: str = arg("all", "comma-separated task ids, or 'all' (the env's shipped task set)")
    policy: str = arg("tiny", "'tiny' (built here, offline) or the path of a local Hugging Face causal LM")
    server_url: str = arg("", "OpenAI-compatible server (vLLM...) to sample rollouts from, e.g. http://127.0.0.1:8000/v1")
    server_model: str = arg("", "the served model's name (with --server-url)")
    steps: int = arg(20, "GRPO steps")
    num_generations: int = arg(4, "G: episodes per GRPO group")
    groups_per_step: int = arg(0, "GRPO groups per step (0: one per task, so every step covers every task once)")
    learning_rate: float = arg(3e-4, "GRPO learning rate (AdamW, constant after the warm-up)")
    lr_warmup_steps: int = arg(3, "GRPO steps of linear learning-rate warm-up (Adam's first steps are sign-like)")
    temperature: float = arg(0.7, "sampling temperature of rollouts (and of TRL's log-probabilities)")
    negative_advantages: float = arg(0.0, "scale of negative GRPO advantages (1: plain GRPO; 0: learn only from "
                                     "the episodes that beat their group's mean)")
    format_reward: float = arg(0.0, "weight of a reward for well-formed tool calls (shaping; 0: env reward only)")
    warm_start_steps: int = arg(200, "at most this many supervised warm-start steps on the oracle solutions (0: none)")
    warm_start_loss: float = arg(0.05, "stop the warm start at this loss: a partly trained policy leaves GRPO work")
    warm_start_lr: float = arg(5e-3, "warm-start learning rate")
    max_turns: int = arg(4, "model turns per episode (malformed ones count)")
    max_turn_tokens: int = arg(48, "tokens per model turn (a longer turn is cut and closed)")
    max_completion_tokens: int = arg(256, "tokens per episode after the prompt")
    eval_episodes: int = arg(8, "sampled episodes per task in the evaluations before and after (0: none)")
    cache: bool = arg(True, "serve repeated tool-call prefixes from the prefix cache")
    speculation: bool = arg(True, "speculate predicted tool calls in forks")
    spec_min_duration: float = arg(0.0, "speculate only calls whose recorded duration is at least this (s)")
    max_groups: int = arg(4, "groups rolled out at once")
    tiny_hidden: int = arg(128, "tiny policy: hidden size")
    tiny_layers: int = arg(2, "tiny policy: layers")
    threads: int = arg(2, "torch CPU threads")
    seed: int = arg(1, "random seed")
    out_dir: str = arg("", "where the report goes (default $BUNSHIN_HOME/train/run-TIME)")
    keep_cache: bool = arg(False, "keep the prefix cache's snapshots after the run")
    quiet: bool = arg(False, "no progress bar and no printed report")


def main(args: Args) -> dict:
    # 0. set-up ---------------------------------------------------------------------------------
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import numpy as np
    import torch
    from tqdm import tqdm
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from bunshin_gym.config import paths
    from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, StepLog, TrajectoryLog
    from bunshin_gym.train import report as reporting
    from bunshin_gym.train.chat import COMPACT_SYSTEM, ChatFormat
    from bunshin_gym.train.policies import LocalGenerator, OpenAICompatibleGenerator, load_hf_policy
    from bunshin_gym.train.rewards import env_reward, tool_format_reward
    from bunshin_gym.train.rollout import BunshinRollout, peak_rss_mb, tasks_dataset

    class ScaledAdvantageGRPOTrainer(GRPOTrainer):
        """GRPO with negative advantages scaled by ``negative_scale`` (1.0: unchanged). A tiny
        memorising policy degrades under the push-down of its failed samples (measured, seed 1,
        15 steps of 12 groups at lr 3e-4: eval 0.58 -> 0.45); keeping only the push-up of the
        episodes that beat their group's mean raised it (0.58 -> 0.77) with the same settings."""

        negative_scale = 1.0

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.negative_scale != 1.0:
                adv = out["advantages"]
                out["advantages"] = torch.where(adv < 0, adv * self.negative_scale, adv)
            return out
    from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus
    from bunshin_gym.train.tools import adapter_for
    from bunshin_gym.train.warmstart import load_tasks, oracle_episodes, warm_start

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # TRL toggles gradient checkpointing through names transformers has deprecated: one warning per
    # step would break the progress bar
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    if args.api not in ("rollout_func", "environment_factory"):
        raise ValueError(f"--api must be 'rollout_func' or 'environment_factory', not {args.api!r}")
    factory_api = args.api == "environment_factory"
    t_start = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir or paths().home / "train" / time.strftime("run-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))

    # 1. tasks and policy ---------------------------------------------------------------------
    adapter = adapter_for(args.env_id)
    if args.tasks == "all":
        if args.env_id != "Bunshin-Shell-v0":
            raise ValueError("--tasks all is the shell task set; name the tasks of other envs")
        from bunshin_gym.envs.shell.env import shipped_tasks

        task_ids = [t.id for t in shipped_tasks()]
    else:
        task_ids = [t.strip() for t in args.tasks.split(",") if t.strip()]
    tasks = load_tasks(args.env_id, task_ids)
    if args.policy == "tiny":
        path = build_tiny_policy(shell_corpus(list(tasks.values()), adapter) + [COMPACT_SYSTEM], out / "tiny-policy",
                                 hidden=args.tiny_hidden, layers=args.tiny_layers, seed=args.seed)
        model, proc = load_hf_policy(str(path))
        fmt = ChatFormat(proc, tools=None, system=COMPACT_SYSTEM)
    else:
        model, proc = load_hf_policy(args.policy)
        fmt = ChatFormat(proc, tools=adapter.tools)
    say(f"policy {args.policy}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{len(task_ids)} tasks of {args.env_id}; output in {out}")

    # 2. the rollout engine ---------------------------------------------------------------------
    log = TrajectoryLog(out / "trajectories.jsonl")
    step_log = StepLog(out)  # every group, step and member's end, for `bunshin explore`
    cache = PrefixCache(out / "prefix-cache", log=log) if args.cache else None
    spec = (Speculation(SpecToolSelector.train([]), min_duration=args.spec_min_duration)
            if args.speculation else None)
    server = (OpenAICompatibleGenerator(args.server_url, args.server_model, fmt, temperature=args.temperature)
              if args.server_url else None)
    rollout = BunshinRollout(fmt, env_id=args.env_id, num_generations=args.num_generations, cache=cache,
                             speculation=spec, generator=server, adapter=adapter, max_turns=args.max_turns,
                             max_turn_tokens=args.max_turn_tokens, max_completion_tokens=args.max_completion_tokens,
                             max_groups=args.max_groups, env_kwargs={"step_log": step_log})
    evaluator = server or LocalGenerator(model, fmt, temperature=args.temperature)
    report: dict = {"config": dataclasses.asdict(args), "tasks": task_ids, "out_dir": str(out)}
    env_cls = None
    if factory_api:
        from bunshin_gym.integrations.trl import environment_class, first_call_examples

        env_cls = environment_class(args.env_id).configure(cache=cache, speculation=spec)
    try:
        # 3. warm start from the oracle solutions ---------------------------------------------
        t0 = time.perf_counter()
        step_log.epoch = "warm start (oracle)"
        if factory_api:
            # TRL renders its own prompts (tool schemas from the env class): fit the first call on those
            oracle = (first_call_examples(env_cls, proc, tasks, adapter.from_action) if args.warm_start_steps
                      else [])
        else:
            oracle = oracle_episodes(rollout, tasks) if args.warm_start_steps else []
        losses = warm_start(model, oracle, steps=args.warm_start_steps, lr=args.warm_start_lr, pad_id=fmt.pad_id,
                            target_loss=args.warm_start_loss, seed=args.seed)
        report["warm_start"] = {"episodes": len(oracle), "oracle_reward": [getattr(e, "reward", None) for e in oracle],
                                "steps": len(losses), "loss_first": losses[0] if losses else None,
                                "loss_last": losses[-1] if losses else None, "wall_s": time.perf_counter() - t0}
        if losses:
            say(f"warm start: {len(oracle)} oracle episodes, {len(losses)} steps, loss {losses[0]:.2f} -> "
                f"{losses[-1]:.3f} ({report['warm_start']['wall_s']:.0f} s)")

        # 4. evaluate, train, evaluate ----------------------------------------------------------
        def evaluate(name: str) -> dict | None:
            if not args.eval_episodes or factory_api:  # the rollout_func path's prompts: not the ones trained
                return None
            torch.manual_seed(args.seed + 1000)
            step_log.epoch = f"eval {name}"
            res = rollout.run(task_ids, evaluator, group_size=args.eval_episodes)
            per_task = {t: float(np.mean([e.reward for e in res.episodes if e.task_id == t])) for t in task_ids}
            say(f"evaluation {name}: mean reward {res.mean_reward:.3f} ({len(res.episodes)} episodes, "
                f"{res.wall_s:.0f} s)")
            return {"mean": res.mean_reward, "per_task": per_task, "wall_s": res.wall_s}

        report["eval"] = {"episodes_per_task": args.eval_episodes, "before": evaluate("before")}
        first_train = len(rollout.history)
        G = args.num_generations
        groups = args.groups_per_step or len(task_ids)
        config = GRPOConfig(
            output_dir=str(out / "trl"), max_steps=args.steps, learning_rate=args.learning_rate,
            lr_scheduler_type="constant_with_warmup", warmup_steps=args.lr_warmup_steps, optim="adamw_torch",
            per_device_train_batch_size=G * groups,
            num_generations=G, max_completion_length=args.max_completion_tokens, temperature=args.temperature,
            beta=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
            seed=args.seed, dataloader_num_workers=0,
            reward_weights=[1.0, args.format_reward] if args.format_reward and not factory_api else None,
            max_tool_calling_iterations=args.max_turns,
        )
        bar = tqdm(total=args.steps, desc="GRPO", unit="step", disable=args.quiet)

        class Progress(TrainerCallback):
            def on_step_begin(self, a, state, control, **kw):
                step_log.epoch = f"GRPO step {state.global_step + 1}"  # the step's rollouts come next

            def on_step_end(self, a, state, control, **kw):
                bar.update(1)
                if rollout.history and not factory_api:
                    last = rollout.history[-1]
                    bar.set_postfix(reward=f"{last.mean_reward:.2f}", rollout=f"{last.wall_s:.1f}s")

        repeats = -(-groups // len(task_ids))
        if factory_api:
            from bunshin_gym.integrations.trl import task_rows

            # the env class owns the reward (get_reward); TRL runs the tool loop
            trainer = ScaledAdvantageGRPOTrainer(model=model, reward_funcs=None, args=config,
                                                 train_dataset=task_rows(task_ids, repeats=repeats),
                                                 processing_class=proc, environment_factory=env_cls,
                                                 callbacks=[Progress()])
        else:
            rewards = [env_reward] + ([tool_format_reward] if args.format_reward else [])
            trainer = ScaledAdvantageGRPOTrainer(model=model, reward_funcs=rewards, args=config,
                                                 train_dataset=tasks_dataset(task_ids, repeats=repeats),
                                                 processing_class=proc, rollout_func=rollout, callbacks=[Progress()])
        from transformers import PrinterCallback

        trainer.negative_scale = args.negative_advantages
        trainer.remove_callback(PrinterCallback)
        start = [p.detach().clone() for p in model.parameters()]
        t0 = time.perf_counter()
        trainer.train()
        train_wall = time.perf_counter() - t0
        update_norm = float(sum((p.detach() - q).pow(2).sum()
                                for p, q in zip(model.parameters(), start, strict=True)) ** 0.5)
        bar.close()
        report["eval"]["after"] = evaluate("after")

        # 5. report --------------------------------------------------------------------------------
        logs = [h for h in trainer.state.log_history if "loss" in h]
        steps = factory_steps(logs, trainer.reward_func_names) if factory_api else []
        for i, res in enumerate([] if factory_api else rollout.history[first_train:first_train + args.steps]):
            per_task: dict[str, list[float]] = {}
            for e in res.episodes:
                per_task.setdefault(e.task_id, []).append(e.reward)
            steps.append({"step": i + 1, "reward": res.mean_reward,
                          "per_task": {t: float(np.mean(v)) for t, v in per_task.items()},
                          "rollout_s": res.wall_s, "generate_s": res.generate_s, "cache": res.cache,
                          "speculation": res.speculation, "workspace_mb": res.workspace_mb,
                          "malformed_turns": sum(e.malformed for e in res.episodes),
                          "truncated_turns": sum(e.truncated_turns for e in res.episodes),
                          "loss": logs[i].get("loss") if i < len(logs) else None})
        rollout_s = sum(s["rollout_s"] for s in steps)
        report["steps"] = steps
        report["totals"] = {
            "rollout_s": rollout_s, "rollout_s_per_step": rollout_s / max(1, len(steps)),
            "generate_s": sum(s["generate_s"] for s in steps), "train_s": train_wall - rollout_s,
            "peak_rss_mb": peak_rss_mb(), "update_norm": update_norm,
            "peak_workspace_mb": max([r.workspace_mb for r in rollout.history] or [0.0]),
            "cache": cache.stats.as_dict() if cache else {}, "speculation": spec.stats.as_dict() if spec else {},
        }
        report["wall_s"] = time.perf_counter() - t_start
        reporting.write(report, out)
        say("\n" + reporting.summary(report))
        return report
    finally:
        if env_cls is not None:
            env_cls.close_all()
        rollout.close()
        if cache is not None and not args.keep_cache:
            cache.clear()


def factory_steps(logs: list[dict], reward_names: list[str]) -> list[dict]:
    """Per-step report entries of an environment_factory run, from TRL's logged metrics (the
    env class's reward column, its step time); what only bunshin's rollout_func records
    (per-task rewards, generation time, cache per step) is left empty."""
    name = reward_names[-1]
    return [{"step": i + 1, "reward": float(h.get(f"rewards/{name}/mean", 0.0)), "per_task": {},
             "rollout_s": float(h.get("step_time", 0.0)), "generate_s": 0.0, "cache": {}, "speculation": {},
             "workspace_mb": 0.0, "tool_calls": float(h.get("tools/call_frequency", 0.0)),
             "malformed_turns": 0, "truncated_turns": 0, "loss": h.get("loss")} for i, h in enumerate(logs)]


def add_arguments(parser: Any) -> None:
    """Every field of :class:`Args` as a ``--option`` (booleans as ``--x/--no-x``)."""
    import argparse

    for f in dataclasses.fields(Args):
        name = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__)
            parser.add_argument(name, type=kind, default=f.default,
                                help=f"{f.metadata['help']} (default: {f.default})")


def args_from(namespace: Any) -> Args:
    return Args(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(Args)})


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    main(args_from(ap.parse_args()))
