"""For the same action sequence, observations, rewards and the final workspace state are
identical with and without the rollout wrappers (prefix cache, speculation, both)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, TrajectoryLog, signature

SHELL_ACTIONS = ["sleep 0.5; ls /data", "ls /data | wc -l > answer.txt", "cat answer.txt", "DONE"]


def final_state(env) -> str:
    ws = env.workspace if hasattr(type(env), "workspace") else env.unwrapped.workspace
    return ws.exec("cd /home/user && find . -type f | sort | xargs -r md5sum; ls -la --time-style=+ /data").text


def think(env) -> None:
    """The policy's think time: long enough for a speculated call to have run."""
    e = env
    while isinstance(e, gym.Wrapper):
        if hasattr(e, "wait_speculation"):
            e.wait_speculation(timeout=60)
        e = e.env


def run(env, actions):
    env.reset(options={"task": "shell/count-files"})
    trace = []
    for a in actions:
        think(env)
        obs, reward, term, trunc, _ = env.step(a)
        trace.append((obs, reward, term, trunc))
    return trace, final_state(env)


def same(a, b) -> bool:
    return all(
        x[1:] == y[1:] and x[0].keys() == y[0].keys()
        and all(np.array_equal(x[0][k], y[0][k]) if isinstance(x[0][k], np.ndarray) else x[0][k] == y[0][k]
                for k in x[0])
        for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference():
    env = gym.make("Bunshin-Shell-v0")
    try:
        return run(env, SHELL_ACTIONS)
    finally:
        env.close()


def selector_for(actions) -> Speculation:
    entries = [{"task": "shell/count-files", "episode": f"e{r}", "depth": d, "signature": signature(a),
                "action": a, "duration": 1.0} for r in range(3) for d, a in enumerate(actions)]
    return Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries), min_duration=0.0)


@pytest.mark.parametrize("wrappers", ["cache", "speculation", "cache+speculation"])
def test_same_actions_same_observations_rewards_and_final_state(tmp_path, reference, wrappers):
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1) if "cache" in wrappers else None
    spec = selector_for(SHELL_ACTIONS) if "speculation" in wrappers else None
    try:
        for _epoch in range(2):  # the second run is served by the cache / speculation
            env = gym.make("Bunshin-Shell-v0")
            if spec is not None:
                env = spec.wrap(env)
            if cache is not None:
                env = cache.wrap(env)
            try:
                trace, state = run(env, SHELL_ACTIONS)
            finally:
                env.close()
            assert same(trace, reference[0])
            assert state == reference[1]
        if cache is not None:
            assert cache.stats.hits >= len(SHELL_ACTIONS)
        if spec is not None and cache is None:
            assert spec.stats.matched >= 1
    finally:
        if cache is not None:
            cache.clear()
