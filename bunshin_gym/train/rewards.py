"""Reward functions for ``GRPOTrainer``: the env's own reward, handed over by the rollout."""

from __future__ import annotations


def env_reward(completions: list, env_reward: list[float] | None = None, **kwargs) -> list[float]:
    """The reward the env gave each episode (its checker's score at the episode's end)."""
    if env_reward is None:
        raise ValueError("env_reward needs the rollout_func's env_reward field (use BunshinRollout)")
    return [float(r) for r in env_reward]


def tool_format_reward(completions: list, malformed: list[int] | None = None, turns: list[int] | None = None,
                       **kwargs) -> list[float]:
    """Share of an episode's turns that held a well-formed tool call (optional shaping)."""
    if malformed is None or turns is None:
        return [0.0] * len(completions)
    return [1.0 - m / t if t else 0.0 for m, t in zip(malformed, turns, strict=True)]


def tool_call_reward(completions: list, **kwargs) -> list[float]:
    """Share of an episode's assistant turns that called a tool, for TRL's own tool loop
    (``environment_factory``), whose completions are the episode's messages (optional shaping)."""
    out = []
    for messages in completions:
        turns = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"] \
            if isinstance(messages, list) else []
        out.append(sum(1 for m in turns if m.get("tool_calls")) / len(turns) if turns else 0.0)
    return out
