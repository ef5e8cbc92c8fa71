"""A short supervised warm start from the tasks' oracle solutions.

The oracle's episodes are played through the same rollout path as training (real envs,
prefix cache, trajectory log), with a scripted generator writing the oracle's tool calls,
so the token records (prompt, completion, ``env_mask``) are exactly what GRPO will see.
The model is then fitted on the turns it must write (``env_mask`` 1) for a few steps: far
enough that sampling finds the reward sometimes, which GRPO needs (a group whose rewards
are all equal teaches nothing).
"""

from __future__ import annotations

from typing import Any

from bunshin_gym.train.policies import ScriptedGenerator
from bunshin_gym.train.rollout import BunshinRollout, Episode
from bunshin_gym.train.tools import call_text


def load_tasks(env_id: str, task_ids: list[str]) -> dict[str, Any]:
    import gymnasium as gym

    env = gym.make(env_id)
    try:
        return {t: env.unwrapped.load_task(t) for t in task_ids}
    finally:
        env.close()


def oracle_episodes(rollout: BunshinRollout, tasks: dict[str, Any]) -> list[Episode]:
    """One oracle episode per task that ships an oracle, played through ``rollout``."""
    oracles = {t: rollout.adapter.env_oracle(task.oracle() or []) for t, task in tasks.items()}
    with_oracle = [t for t, actions in oracles.items() if actions]

    def script(ep: Episode) -> str:
        actions = oracles[ep.task_id]
        action = actions[min(ep.turns, len(actions) - 1)]
        return call_text(*rollout.adapter.from_action(action))

    result = rollout.run(with_oracle, ScriptedGenerator(script, rollout.fmt))
    seen, out = set(), []
    for ep in result.episodes:
        if ep.task_id not in seen:
            seen.add(ep.task_id)
            out.append(ep)
    return out


def warm_start(model: Any, episodes: list[Episode], *, steps: int, lr: float, pad_id: int, target_loss: float = 0.0,
               seed: int = 0) -> list[float]:
    """Fit ``model`` on the model-written tokens of ``episodes`` (full batch, Adam) for at most
    ``steps`` steps, stopping once the loss is at or below ``target_loss``; the losses."""
    import torch

    if steps <= 0 or not episodes:
        return []
    torch.manual_seed(seed)
    seqs = [e.prompt_ids + e.completion_ids for e in episodes]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attn = torch.zeros_like(ids)
    for i, (e, s) in enumerate(zip(episodes, seqs, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        mask = torch.tensor([0] * len(e.prompt_ids) + e.env_mask, dtype=torch.bool)
        labels[i, :len(s)][mask] = ids[i, :len(s)][mask]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if losses[-1] <= target_loss:
            break
    return losses
