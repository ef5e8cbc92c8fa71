"""Same actions, same results with the rollout wrappers, on the desktop and the web shop:
a task's oracle run plain, then twice through the prefix cache and speculation (the second
time served from them), gives the same rewards, observations and final workspace state."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, TrajectoryLog, signature

CASES = {
    # env id: (make kwargs, task, command printing the workspace state the task changes)
    "Bunshin-OSWorld-v0": ({"action_space": "pyautogui", "require_a11y_tree": False, "require_terminal": True},
                           "osworld/terminal-mkdir-projects",
                           "cd /home/user && find . -path ./.cache -prune -o -type f -print -o -type d -print | sort"),
    "Bunshin-WebArena-v0": ({}, "webarena/1019",
                            "sqlite3 /var/lib/shop/shop.db 'select * from orders; select * from cart_items'"),
}


def think(env) -> None:
    e = env
    while isinstance(e, gym.Wrapper):
        if hasattr(e, "wait_speculation"):
            e.wait_speculation(timeout=120)
        e = e.env


def run(env, task: str, state_cmd: str):
    env.reset(options={"task": task})
    actions = list(env.unwrapped.task.oracle() if hasattr(env.unwrapped.task, "oracle") else [])
    actions = actions or list(env.unwrapped.oracle())
    trace = []
    for a in actions:
        think(env)
        obs, reward, term, trunc, _ = env.step(a)
        trace.append((obs, reward, term, trunc))
        if term or trunc:
            break
    ws = env.workspace if hasattr(type(env), "workspace") else env.unwrapped.workspace
    return actions, trace, ws.exec(state_cmd).text


def assert_same_observation(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            # a desktop screenshot: cursors blink between any two runs, cached or not
            assert a[k].shape == b[k].shape
            assert (a[k] == b[k]).all(axis=-1).mean() > 0.995, f"screenshots differ: {k}"
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("env_id", sorted(CASES))
def test_same_actions_same_results_through_cache_and_speculation(tmp_path, env_id):
    kwargs, task, state_cmd = CASES[env_id]
    plain = gym.make(env_id, **kwargs)
    try:
        actions, ref_trace, ref_state = run(plain, task, state_cmd)
    finally:
        plain.close()
    entries = [{"task": task, "episode": f"e{r}", "depth": d, "signature": signature(a), "action": a,
                "duration": 1.0} for r in range(3) for d, a in enumerate(actions)]
    spec = Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries), min_duration=0.0)
    cache = PrefixCache(tmp_path / "cache", snapshot_every=2)
    try:
        for _epoch in range(2):
            env = cache.wrap(spec.wrap(gym.make(env_id, **kwargs)))
            try:
                _, trace, state = run(env, task, state_cmd)
            finally:
                env.close()
            assert [t[1:] for t in trace] == [t[1:] for t in ref_trace]
            for (obs, *_), (ref, *_) in zip(trace, ref_trace, strict=True):
                assert_same_observation(obs, ref)
            assert state == ref_state
        assert cache.stats.hits >= len(actions)
    finally:
        cache.clear()
