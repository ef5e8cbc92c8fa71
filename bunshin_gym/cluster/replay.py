"""A policy that replays recorded actions (benchmarks, tests): it pickles, so a group of it
runs on any host of the cluster."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplayPolicy:
    """Member ``i`` plays ``actions[i]`` in order, each after ``think[i][k]`` seconds (the
    policy's think time; 0 when not given); past its last action it answers ``DONE``."""

    actions: tuple[tuple[str, ...], ...]
    think: tuple[tuple[float, ...], ...] = ()
    think_scale: float = 1.0

    @classmethod
    def from_members(cls, members: list[dict], think_scale: float = 1.0) -> ReplayPolicy:
        """From ``bunshin bench rollout``'s recorded members (``{"actions": [...], "think": [...]}``)."""
        return cls(tuple(tuple(m["actions"]) for m in members), tuple(tuple(m.get("think", ())) for m in members),
                   think_scale)

    def __call__(self, member: int, observation: Any, history: list) -> str:
        k = len(history)
        if member >= len(self.actions):
            raise ValueError(f"member {member}: the replay has {len(self.actions)} members")
        think = self.think[member] if member < len(self.think) else ()
        if k < len(think):
            time.sleep(think[k] * self.think_scale)
        mine = self.actions[member]
        return mine[k] if k < len(mine) else "DONE"
