"""``bunshin train``: GRPO with TRL over bunshin envs, top to bottom (CleanRL style).

1. the task set and the policy (the tiny offline model by default, or a local HF model);
2. the rollout engine: trajectory log, prefix cache, speculation, group envs;
3. a short supervised warm start from the oracle solutions, played through the real envs;
4. an evaluation, GRPO steps (TRL's ``GRPOTrainer`` with :class:`BunshinRollout`), an evaluation;
5. the report: reward per step, rollout time, peak memory, cache and speculation rates, plots.

:func:`main` reads in that order; the pieces it calls follow it in this file. The arguments
are :class:`~bunshin_gym.train.args.Args` (their own module, so that the CLI builds its
parser without importing torch and TRL).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from transformers import PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

from bunshin_gym.config import paths
from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, StepLog, TrajectoryLog
from bunshin_gym.train import report as reporting
from bunshin_gym.train.args import Args, add_arguments, args_from
from bunshin_gym.train.chat import COMPACT_SYSTEM, ChatFormat
from bunshin_gym.train.policies import LocalGenerator, OpenAICompatibleGenerator, load_hf_policy
from bunshin_gym.train.rewards import env_reward, tool_call_reward, tool_format_reward
from bunshin_gym.train.rollout import BunshinRollout, peak_rss_mb, tasks_dataset
from bunshin_gym.train.server import OFF_POLICY, TRL_VLLM, ServerInfo
from bunshin_gym.train.server import choose as choose_server
from bunshin_gym.train.tiny import build_tiny_policy, shell_corpus
from bunshin_gym.train.tools import adapter_for
from bunshin_gym.train.warmstart import load_tasks, oracle_episodes, warm_start

__all__ = ["Args", "add_arguments", "args_from", "factory_steps", "main"]

API_CHOICES = ("rollout_func", "environment_factory")


def main(args: Args) -> dict:
    """Run ``bunshin train`` and return its report (also written to the run directory)."""
    # 0. set-up ---------------------------------------------------------------------------------
    if args.api not in API_CHOICES:
        raise ValueError(f"--api must be 'rollout_func' or 'environment_factory', not {args.api!r}")
    factory_api = args.api == "environment_factory"
    if not factory_api and is_vl_policy(args.policy):
        raise ValueError(f"--policy {args.policy} is a vision-language model: TRL {trl_version()} carries no images "
                         "from a rollout_func into its loss pass, so train it with --api environment_factory "
                         "(its reset and tool results carry the screenshots)")
    env_options(args)  # bad desktop options fail here, before anything is built
    server = choose_server(args.server_url, off_policy_ok=args.server_off_policy, factory_api=factory_api)
    t_start = time.perf_counter()
    quiet_libraries()
    seed_everything(args.seed, args.threads)
    out = Path(args.out_dir or paths().home / "train" / time.strftime("run-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    say: Callable[..., None] = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))

    # 1. tasks and policy ---------------------------------------------------------------------
    adapter = adapter_for(args.env_id)
    task_ids = task_ids_of(args)
    tasks = load_tasks(args.env_id, task_ids)
    model, proc, fmt = load_policy(args, list(tasks.values()), adapter, out)
    say(f"policy {args.policy}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{len(task_ids)} tasks of {args.env_id}; output in {out}")

    # 2. the rollout engine ---------------------------------------------------------------------
    engine = Engine.build(args, fmt, adapter, model, out, server)
    report: dict = {"config": dataclasses.asdict(args), "tasks": task_ids, "out_dir": str(out),
                    "sampling": {"kind": server.kind if server else "local",
                                 "detail": server.detail if server else "the trainer's own model"}}
    try:
        # 3. warm start from the oracle solutions ---------------------------------------------
        report["warm_start"] = warm_start_phase(args, engine, model, proc, fmt, tasks, adapter, say)

        # 4. evaluate, train, evaluate ----------------------------------------------------------
        report["eval"] = {"episodes_per_task": args.eval_episodes,
                          "before": evaluate(args, engine, task_ids, "before", say)}
        first_train = len(engine.rollout.history)
        trainer = make_trainer(args, engine, model, proc, task_ids, out)
        start = [p.detach().clone() for p in model.parameters()]
        probe = vision_probe(model) if fmt.multimodal else None
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            if probe is not None:
                probe.detach()
        train_wall = time.perf_counter() - t0
        update_norm = float(sum((p.detach() - q).pow(2).sum()
                                for p, q in zip(model.parameters(), start, strict=True)) ** 0.5)
        if probe is not None:
            report["vision"] = vision_report(probe, model, start)
        trainer.progress_bar.close()
        report["eval"]["after"] = evaluate(args, engine, task_ids, "after", say)

        # 5. report --------------------------------------------------------------------------------
        logs = [h for h in trainer.state.log_history if "loss" in h]
        if factory_api:
            steps = factory_steps(logs, trainer.reward_func_names)
        else:
            steps = rollout_steps(engine.rollout.history[first_train:first_train + args.steps], logs)
        rollout_s = sum(s["rollout_s"] for s in steps)
        report["steps"] = steps
        report["totals"] = {
            "rollout_s": rollout_s, "rollout_s_per_step": rollout_s / max(1, len(steps)),
            "generate_s": sum(s["generate_s"] for s in steps), "train_s": train_wall - rollout_s,
            "peak_rss_mb": peak_rss_mb(), "update_norm": update_norm,
            "peak_workspace_mb": max([r.workspace_mb for r in engine.rollout.history] or [0.0]),
            "cache": engine.cache.stats.as_dict() if engine.cache else {},
            "speculation": engine.spec.stats.as_dict() if engine.spec else {},
        }
        report["wall_s"] = time.perf_counter() - t_start
        reporting.write(report, out)
        say("\n" + reporting.summary(report))
        return report
    finally:
        engine.close(keep_cache=args.keep_cache)


# 0. set-up ---------------------------------------------------------------------------------------
def quiet_libraries() -> None:
    # TRL reads it when a trainer is made with rollout_func / environment_factory (experimental)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # TRL toggles gradient checkpointing through names transformers has deprecated: one warning per
    # step would break the progress bar
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")


def trl_version() -> str:
    import trl

    return trl.__version__


def is_vl_policy(policy: str) -> bool:
    from bunshin_gym.train.tiny_vl import is_vl_model_dir

    return policy == "tiny-vl" or (policy != "tiny" and is_vl_model_dir(policy))


def env_options(args: Args) -> dict:
    """``gym.make`` arguments of the env from the desktop options (other envs take none)."""
    if args.env_id != "Bunshin-OSWorld-v0":
        if args.screen_size or not args.a11y_tree:
            raise ValueError("--screen-size and --no-a11y-tree are options of the desktop env (Bunshin-OSWorld-v0)")
        return {}
    opts: dict[str, Any] = {"require_a11y_tree": args.a11y_tree}
    if args.screen_size:
        try:
            w, h = (int(v) for v in args.screen_size.lower().split("x"))
        except ValueError:
            raise ValueError(f"--screen-size must be WxH, e.g. 800x600, not {args.screen_size!r}") from None
        opts["screen_size"] = (w, h)
    return opts


def vision_probe(model: Any) -> Any:
    from bunshin_gym.train.vision import VisionProbe

    return VisionProbe(model).attach()


def vision_report(probe: Any, model: Any, start: list) -> dict:
    """How many screenshots the vision tower encoded in the loss pass (gradients on) and in
    generation, and how far the GRPO steps moved its weights."""
    from bunshin_gym.train.vision import vision_tower

    tower = {id(p) for p in vision_tower(model).parameters()}
    moved = sum(float((p.detach() - q).pow(2).sum())
                for p, q in zip(model.parameters(), start, strict=True) if id(p) in tower)
    grids = probe.images(grad=True)
    return {"images_loss_pass": len(grids), "images_generation": len(probe.images(grad=False)),
            "grids_loss_pass": sorted({tuple(g) for g in grids}), "vision_update_norm": moved ** 0.5}


def trl_vllm_options(server: ServerInfo | None) -> dict:
    """GRPOConfig options: TRL's vLLM server mode (on CUDA, where its weight sync runs) or CPU."""
    if server is None or server.kind != TRL_VLLM:
        return {"use_cpu": True}
    return {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": server.base_url, "use_cpu": False}


def seed_everything(seed: int, threads: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)


# 1. tasks and policy -----------------------------------------------------------------------------
def task_ids_of(args: Args) -> list[str]:
    """The ``--tasks`` list; ``all`` is the shell env's shipped task set."""
    if args.tasks != "all":
        return [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.env_id != "Bunshin-Shell-v0":
        raise ValueError("--tasks all is the shell task set; name the tasks of other envs")
    from bunshin_gym.envs.shell.env import shipped_tasks  # the envs package loads on demand

    return [t.id for t in shipped_tasks()]


def load_policy(args: Args, tasks: list[Any], adapter: Any, out: Path) -> tuple[Any, Any, ChatFormat]:
    """The model, its processor and the chat format: the tiny policy is built here, on a corpus
    of the tasks' own text (it has no tool schemas in its prompt: they would not fit); the tiny
    vision-language policy on what TRL's prompts for the env class hold."""
    from bunshin_gym.train.tiny_vl import build_tiny_vl_policy, is_vl_model_dir, load_vl_policy

    if args.policy == "tiny-vl":
        from bunshin_gym.integrations.trl import environment_class
        from bunshin_gym.train.vision import desktop_corpus

        corpus = desktop_corpus(environment_class(args.env_id), tasks)
        path = build_tiny_vl_policy(corpus, out / "tiny-vl-policy", hidden=args.tiny_hidden, layers=args.tiny_layers,
                                    seed=args.seed)
        model, proc = load_vl_policy(path)
        return model, proc, ChatFormat(proc, tools=adapter.tools)
    if args.policy != "tiny" and is_vl_model_dir(args.policy):
        model, proc = load_vl_policy(args.policy)
        return model, proc, ChatFormat(proc, tools=adapter.tools)
    if args.policy == "tiny":
        path = build_tiny_policy(shell_corpus(tasks, adapter) + [COMPACT_SYSTEM], out / "tiny-policy",
                                 hidden=args.tiny_hidden, layers=args.tiny_layers, seed=args.seed)
        model, proc = load_hf_policy(str(path))
        return model, proc, ChatFormat(proc, tools=None, system=COMPACT_SYSTEM)
    model, proc = load_hf_policy(args.policy)
    return model, proc, ChatFormat(proc, tools=adapter.tools)


# 2. the rollout engine ---------------------------------------------------------------------------
@dataclass
class Engine:
    """What rolls the episodes out: logs, prefix cache, speculation, the group rollout for
    TRL's ``rollout_func`` and, with ``--api environment_factory``, TRL's env class."""

    step_log: StepLog
    cache: PrefixCache | None
    spec: Speculation | None
    rollout: BunshinRollout
    evaluator: Any
    env_cls: Any = None
    server: ServerInfo | None = None  # where rollouts are sampled, when not from the trainer's own model

    @classmethod
    def build(cls, args: Args, fmt: ChatFormat, adapter: Any, model: Any, out: Path,
              server: ServerInfo | None = None) -> Engine:
        log = TrajectoryLog(out / "trajectories.jsonl")
        step_log = StepLog(out)  # every group, step and member's end, for `bunshin explore`
        cache = PrefixCache(out / "prefix-cache", log=log) if args.cache else None
        spec = (Speculation(SpecToolSelector.train([]), min_duration=args.spec_min_duration)
                if args.speculation else None)
        # an off-policy server samples every rollout; TRL's vLLM server is reached through the trainer
        # (BunshinRollout asks it per call, after TRL pushed the step's weights)
        off_policy = (OpenAICompatibleGenerator(args.server_url, args.server_model, fmt, temperature=args.temperature)
                      if server is not None and server.kind == OFF_POLICY else None)
        rollout = BunshinRollout(fmt, env_id=args.env_id, num_generations=args.num_generations, cache=cache,
                                 speculation=spec, generator=off_policy, adapter=adapter, max_turns=args.max_turns,
                                 max_turn_tokens=args.max_turn_tokens,
                                 max_completion_tokens=args.max_completion_tokens,
                                 max_groups=args.max_groups, env_kwargs={"step_log": step_log})
        env_cls = None
        if args.api == "environment_factory":
            from bunshin_gym.integrations.trl import environment_class

            env_cls = environment_class(args.env_id).configure(cache=cache, speculation=spec,
                                                               multimodal=fmt.multimodal, **env_options(args))
        evaluator = off_policy or LocalGenerator(model, fmt, temperature=args.temperature)
        return cls(step_log, cache, spec, rollout, evaluator, env_cls, server)

    def close(self, *, keep_cache: bool) -> None:
        if self.env_cls is not None:
            self.env_cls.close_all()
        self.rollout.close()
        if self.cache is not None and not keep_cache:
            self.cache.clear()


# 3. warm start -----------------------------------------------------------------------------------
def warm_start_phase(args: Args, engine: Engine, model: Any, proc: Any, fmt: ChatFormat, tasks: dict[str, Any],
                     adapter: Any, say: Callable[..., None]) -> dict:
    """Fit the policy on the oracle solutions' tool calls; its report entry."""
    t0 = time.perf_counter()
    engine.step_log.epoch = "warm start (oracle)"
    if not args.warm_start_steps:
        oracle: list = []
    elif engine.env_cls is not None and fmt.multimodal:
        from bunshin_gym.train import vision

        # the prompt TRL renders holds the reset's screenshot: fit the first call with its pixels
        examples = vision.first_call_examples(engine.env_cls, proc, tasks)
        losses = vision.warm_start(model, examples, steps=args.warm_start_steps, lr=args.warm_start_lr,
                                   target_loss=args.warm_start_loss, seed=args.seed)
        return warm_start_entry(examples, losses, t0, say)
    elif engine.env_cls is not None:
        from bunshin_gym.integrations.trl import first_call_examples

        # TRL renders its own prompts (tool schemas from the env class): fit the first call on those
        to_call, sayable = factory_call_mapper(args.env_id, adapter)
        oracle = first_call_examples(engine.env_cls, proc, sayable(tasks), to_call)
    else:
        oracle = oracle_episodes(engine.rollout, tasks)
    losses = warm_start(model, oracle, steps=args.warm_start_steps, lr=args.warm_start_lr, pad_id=fmt.pad_id,
                        target_loss=args.warm_start_loss, seed=args.seed)
    return warm_start_entry(oracle, losses, t0, say)


def factory_call_mapper(env_id: str, adapter: Any) -> tuple[Callable[[Any], Any], Callable[[dict], dict]]:
    """How an oracle action becomes a call of the env class's tools, and which tasks' first
    oracle action can be said so. The desktop class has one tool per action kind (its oracles
    are pyautogui code), the others take the adapter's calls."""
    if env_id != "Bunshin-OSWorld-v0":
        return adapter.from_action, lambda tasks: tasks
    from bunshin_gym.train.vision import desktop_call

    def sayable(tasks: dict) -> dict:
        return {t: task for t, task in tasks.items() if (task.oracle() or [None])[0] is not None
                and desktop_call(task.oracle()[0]) is not None}

    return desktop_call, sayable


def warm_start_entry(oracle: list, losses: list[float], t0: float, say: Callable[..., None]) -> dict:
    entry = {"episodes": len(oracle), "oracle_reward": [getattr(e, "reward", None) for e in oracle],
             "steps": len(losses), "loss_first": losses[0] if losses else None,
             "loss_last": losses[-1] if losses else None, "wall_s": time.perf_counter() - t0}
    if losses:
        say(f"warm start: {len(oracle)} oracle episodes, {len(losses)} steps, loss {losses[0]:.2f} -> "
            f"{losses[-1]:.3f} ({entry['wall_s']:.0f} s)")
    return entry


# 4. evaluate and train ---------------------------------------------------------------------------
def evaluate(args: Args, engine: Engine, task_ids: list[str], name: str, say: Callable[..., None]) -> dict | None:
    """Mean reward of ``--eval-episodes`` sampled episodes per task (None when there are none,
    and with ``environment_factory``, whose prompts are TRL's, not the ones evaluated here)."""
    if not args.eval_episodes or engine.env_cls is not None:
        return None
    torch.manual_seed(args.seed + 1000)
    engine.step_log.epoch = f"eval {name}"
    res = engine.rollout.run(task_ids, engine.evaluator, group_size=args.eval_episodes)
    per_task = {t: float(np.mean([e.reward for e in res.episodes if e.task_id == t])) for t in task_ids}
    say(f"evaluation {name}: mean reward {res.mean_reward:.3f} ({len(res.episodes)} episodes, {res.wall_s:.0f} s)")
    return {"mean": res.mean_reward, "per_task": per_task, "wall_s": res.wall_s}


class ScaledAdvantageGRPOTrainer(GRPOTrainer):
    """GRPO with negative advantages scaled by ``negative_scale`` (1.0: unchanged). A tiny
    memorising policy degrades under the push-down of its failed samples (measured, seed 1,
    15 steps of 12 groups at lr 3e-4: eval 0.58 -> 0.45); keeping only the push-up of the
    episodes that beat their group's mean raised it (0.58 -> 0.77) with the same settings."""

    negative_scale = 1.0
    progress_bar: Any = None

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.negative_scale != 1.0:
            adv = out["advantages"]
            out["advantages"] = torch.where(adv < 0, adv * self.negative_scale, adv)
        return out


class StepProgress(TrainerCallback):
    """A progress bar per GRPO step (reward and rollout time of the last step), and the step
    log's epoch name set before the step's rollouts."""

    def __init__(self, bar: Any, engine: Engine):
        self.bar, self.engine = bar, engine

    def on_step_begin(self, a, state, control, **kw):
        self.engine.step_log.epoch = f"GRPO step {state.global_step + 1}"  # the step's rollouts come next

    def on_step_end(self, a, state, control, **kw):
        self.bar.update(1)
        history = self.engine.rollout.history
        if history and self.engine.env_cls is None:
            self.bar.set_postfix(reward=f"{history[-1].mean_reward:.2f}", rollout=f"{history[-1].wall_s:.1f}s")


def make_trainer(args: Args, engine: Engine, model: Any, proc: Any, task_ids: list[str],
                 out: Path) -> ScaledAdvantageGRPOTrainer:
    """TRL's trainer over the engine: bunshin's group rollouts as ``rollout_func`` (the env's
    reward, plus the optional format reward), or TRL's tool loop over the env class (which owns
    the reward, ``get_reward``)."""
    factory_api = engine.env_cls is not None
    G = args.num_generations
    groups = args.groups_per_step or len(task_ids)
    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=args.steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup", warmup_steps=args.lr_warmup_steps, optim="adamw_torch",
        per_device_train_batch_size=G * groups,
        num_generations=G, max_completion_length=args.max_completion_tokens, temperature=args.temperature,
        beta=0.0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=args.seed, dataloader_num_workers=0,
        # with environment_factory TRL appends the env class's get_reward (weight 1) after these
        reward_weights=(([args.format_reward] if factory_api else [1.0, args.format_reward])
                        if args.format_reward else None),
        max_tool_calling_iterations=args.max_turns,
        **trl_vllm_options(engine.server),
    )
    bar = tqdm(total=args.steps, desc="GRPO", unit="step", disable=args.quiet)
    repeats = -(-groups // len(task_ids))
    if factory_api:
        from bunshin_gym.integrations.trl import task_rows

        trainer = ScaledAdvantageGRPOTrainer(model=model, args=config,
                                             reward_funcs=[tool_call_reward] if args.format_reward else None,
                                             train_dataset=task_rows(task_ids, repeats=repeats),
                                             processing_class=proc, environment_factory=engine.env_cls,
                                             callbacks=[StepProgress(bar, engine)])
    else:
        rewards = [env_reward] + ([tool_format_reward] if args.format_reward else [])
        trainer = ScaledAdvantageGRPOTrainer(model=model, reward_funcs=rewards, args=config,
                                             train_dataset=tasks_dataset(task_ids, repeats=repeats),
                                             processing_class=proc, rollout_func=engine.rollout,
                                             callbacks=[StepProgress(bar, engine)])
    trainer.negative_scale = args.negative_advantages
    trainer.progress_bar = bar
    trainer.remove_callback(PrinterCallback)
    return trainer


# 5. report ---------------------------------------------------------------------------------------
def rollout_steps(history: list[Any], logs: list[dict]) -> list[dict]:
    """Per-step report entries of a rollout_func run, from bunshin's own rollout records."""
    steps = []
    for i, res in enumerate(history):
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
    return steps


def factory_steps(logs: list[dict], reward_names: list[str]) -> list[dict]:
    """Per-step report entries of an environment_factory run, from TRL's logged metrics (the
    env class's reward column, its step time); what only bunshin's rollout_func records
    (per-task rewards, generation time, cache per step) is left empty."""
    name = reward_names[-1]
    return [{"step": i + 1, "reward": float(h.get(f"rewards/{name}/mean", 0.0)), "per_task": {},
             "rollout_s": float(h.get("step_time", 0.0)), "generate_s": 0.0, "cache": {}, "speculation": {},
             "workspace_mb": 0.0, "tool_calls": float(h.get("tools/call_frequency", 0.0)),
             "malformed_turns": 0, "truncated_turns": 0, "loss": h.get("loss")} for i, h in enumerate(logs)]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    main(args_from(ap.parse_args()))
