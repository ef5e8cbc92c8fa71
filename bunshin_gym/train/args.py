"""The arguments of ``bunshin train``: one dataclass, every field a ``--option``.

Apart from :mod:`bunshin_gym.train.main` so that the CLI builds its parser without importing
torch and TRL (seconds) on every ``bunshin`` command.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


def arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    env_id: str = arg("Bunshin-Shell-v0", "env to train in")
    api: str = arg("rollout_func", "how TRL drives the env: 'rollout_func' (bunshin's group rollouts, token-exact) or "
                   "'environment_factory' (TRL's own tool loop over bunshin_gym.integrations.trl's env classes)")
    screen_size: str = arg("", "desktop env: the screen as WxH, e.g. 800x600 (default: the env's 1920x1080)")
    a11y_tree: bool = arg(True, "desktop env: show the accessibility tree as text (a vision-language policy "
                          "sees the screenshot either way)")
    tasks: str = arg("all", "comma-separated task ids, or 'all' (the env's shipped task set)")
    policy: str = arg("tiny", "'tiny' (built here, offline), 'tiny-vl' (a tiny vision-language Qwen3-VL built here, "
                      "offline, for desktop screenshots; needs --api environment_factory) or the path of a local "
                      "Hugging Face causal LM or image-text-to-text model")
    server_url: str = arg("", "sample rollouts from a server, e.g. http://127.0.0.1:8000/v1: TRL's vLLM server "
                          "(trl vllm-serve; TRL pushes the weights every step; needs vllm and CUDA here), or with "
                          "--server-off-policy any OpenAI-compatible one")
    server_model: str = arg("", "the served model's name (with --server-url)")
    server_off_policy: bool = arg(False, "allow a --server-url whose weights nothing updates (not TRL's vLLM server): "
                                  "its samples are off-policy")
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


def add_arguments(parser: Any) -> None:
    """Every field of :class:`Args` as a ``--option`` (booleans as ``--x/--no-x``)."""
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
