"""Env ids are registered in one place and gym.make gives the env with its fork methods."""

from __future__ import annotations

import gymnasium as gym
import pytest

from bunshin_gym.envs.shell.env import ShellEnv
from bunshin_gym.registration import ENVS
from bunshin_gym.testing import fake_factory


@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_every_id_is_registered_with_a_vector_entry_point(env_id):
    spec = gym.spec(env_id)
    assert spec.entry_point == ENVS[env_id]
    assert spec.vector_entry_point.env_id == env_id
    assert spec.disable_env_checker and not spec.order_enforce


def test_make_by_module_prefix_and_plain_id_give_the_same_env():
    a = gym.make("bunshin_gym:Bunshin-Shell-v0", workspace_factory=fake_factory)
    b = gym.make("Bunshin-Shell-v0", workspace_factory=fake_factory)
    assert type(a) is type(b) is ShellEnv  # no gymnasium wrapper hides clone/snapshot/rollback
    assert callable(a.clone) and callable(a.snapshot) and callable(a.rollback)


def test_unknown_task_is_a_clear_error():
    env = gym.make("Bunshin-Shell-v0", workspace_factory=fake_factory)
    with pytest.raises(ValueError, match="no shell task 'shell/nope'"):
        env.reset(options={"task": "shell/nope"})
    with pytest.raises(ValueError, match="needs a task"):
        env.reset()
