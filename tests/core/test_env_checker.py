"""gymnasium's own env checker on each env family: over the FakeWorkspace test double and
on the real envs (real workspaces; the checker samples random actions and steps twice from
the same seed, so a step's info must not carry wall-clock times)."""

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


# the real envs, on real workspaces --------------------------------------------------------
def _check_real(env_id: str, **kwargs) -> None:
    env = gym.make(env_id, **kwargs)
    try:
        check_env(env, skip_render_check=True)
        # what left the step info is still there, out of the determinism contract
        env.reset(seed=3)
        env.step(env.action_space.sample())
        timing = env.unwrapped.last_step_timing
        assert timing["step_s"] > 0 and all(v >= 0 for v in timing.values())
    finally:
        env.close()


def test_real_shell_env_passes_gymnasium_checker():
    _check_real("Bunshin-Shell-v0", task="shell/count-files")


def test_real_shell_env_reports_command_time_outside_the_step_info():
    env = gym.make("Bunshin-Shell-v0", task="shell/count-files")
    try:
        env.reset()
        _, _, _, _, info = env.step("sleep 0.3")
        assert "duration" not in info
        assert 0.3 <= env.unwrapped.last_step_timing["command_s"] <= env.unwrapped.last_step_timing["step_s"]
    finally:
        env.close()


def test_real_osworld_env_passes_gymnasium_checker():
    """computer_13 actions, the accessibility tree on (the env's defaults); ~35 s."""
    _check_real("Bunshin-OSWorld-v0", task="osworld/terminal-mkdir-projects")


@pytest.mark.slow
def test_real_osworld_env_with_pyautogui_and_the_terminal_passes_gymnasium_checker():
    """The other action space (random code strings) and the terminal transcript; ~40 s."""
    _check_real("Bunshin-OSWorld-v0", task="osworld/terminal-mkdir-projects", action_space="pyautogui",
                require_terminal=True)


@pytest.mark.slow
def test_real_webarena_env_passes_gymnasium_checker():
    _check_real("Bunshin-WebArena-v0", task="webarena/1001")
