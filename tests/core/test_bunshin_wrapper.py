"""BunshinWrapper forwards clone/snapshot/rollback; fork_api reaches them through any stack."""

from __future__ import annotations

import gymnasium as gym

import bunshin_gym  # noqa: F401
from bunshin_gym import BunshinWrapper, fork_api
from bunshin_gym.testing import fake_factory


class CountSteps(BunshinWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.count = 0

    def step(self, action):
        self.count += 1
        return self.env.step(action)


def make():
    return gym.make("Bunshin-Shell-v0", task="shell/make-dir", workspace_factory=fake_factory)


def test_user_wrapper_clones_come_back_wrapped():
    env = CountSteps(make())
    env.reset()
    env.step("ls")
    a, b = env.clone(2)
    assert isinstance(a, CountSteps) and isinstance(b, CountSteps)
    assert a.unwrapped is not env.unwrapped and a.unwrapped is not b.unwrapped
    a.step("pwd")
    assert a.unwrapped.steps == 2 and env.unwrapped.steps == 1


def test_fork_methods_reach_through_gymnasium_wrappers():
    env = gym.wrappers.TimeLimit(CountSteps(make()), max_episode_steps=5)
    env.reset()
    env.step("ls")
    snap = fork_api(env).snapshot()
    env.step("pwd")
    fork_api(env).rollback(snap)
    assert env.unwrapped.steps == 1
    (twin,) = fork_api(env).clone(1)
    assert twin.unwrapped.steps == 1


def test_wrapper_over_wrapper_forwards():
    env = CountSteps(gym.wrappers.RecordEpisodeStatistics(make()))
    env.reset()
    (twin,) = env.clone()
    assert isinstance(twin, CountSteps)
