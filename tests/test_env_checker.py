"""gymnasium's own env checker on each env family, over the FakeWorkspace test double
(the checker samples random actions; the real workspaces are tested in the env tests)."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.testing import FakeWorkspace, fake_factory


def test_shell_env_passes_gymnasium_checker():
    env = gym.make("Bunshin-Shell-v0", task="shell/count-files", workspace_factory=fake_factory)
    check_env(env, skip_render_check=True)
    env.close()


def test_fake_clone_and_rollback_follow_the_env_contract():
    env = gym.make("Bunshin-Shell-v0", task="shell/count-files", workspace_factory=fake_factory)
    env.reset(seed=1)
    env.step("echo one")
    (twin,) = env.clone(1)
    assert twin.steps == env.steps == 1
    assert isinstance(twin.workspace, FakeWorkspace) and twin.workspace is not env.workspace
    twin.step("echo two")
    assert env.steps == 1 and twin.steps == 2
    env.rollback()
    assert env.steps == 0 and env.observe()["output"] == ""
    with pytest.raises(Exception, match="reset"):
        gym.make("Bunshin-Shell-v0", workspace_factory=fake_factory).step("ls")
