"""A GRPO group outlives a failed member: a member whose policy or env raises, or whose
workspace is killed in the middle of a step, ends with a failed step (error observation,
reward 0, truncated) and a failed trajectory; the other members finish their episodes."""

from __future__ import annotations

import os
import signal
import threading

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.testing import fake_factory

ORACLE = ["ls /data | wc -l > /home/user/answer.txt", "DONE"]


def oracle_policy(i, obs, history):
    return ORACLE[len(history)]


@pytest.fixture
def fake_group():
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=3, vectorization_mode="vector_entry_point",
                        workspace_factory=fake_factory)
    yield envs
    envs.close()


def test_a_member_whose_policy_raises_fails_alone(fake_group):
    seen = []

    def policy(i, obs, history):
        if i == 1 and len(history) == 1:
            raise RuntimeError("the policy of member 1 broke")
        return oracle_policy(i, obs, history)

    trajs = fake_group.run_group(policy, options={"task": "shell/count-files"},
                                 on_step=lambda i, step: seen.append((i, step.truncated)))
    assert [t.failed for t in trajs] == [False, True, False]
    assert "RuntimeError: the policy of member 1 broke" in trajs[1].error
    assert isinstance(trajs[1].exception, RuntimeError)
    last = trajs[1].steps[-1]
    assert last.truncated and last.reward == 0.0 and last.info["member_failed"]
    assert "the policy of member 1 broke" in last.observation["output"]  # the env's error observation
    assert fake_group.single_observation_space.contains(last.observation)
    assert (1, True) in seen  # whoever tracks the group by on_step sees the member end
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]
    assert not fake_group.active.any()


def test_a_member_whose_env_raises_fails_alone_in_run_group_and_in_step(fake_group):
    fake_group.reset(options={"task": "shell/count-files"})

    def broken_step(action):
        raise OSError("the member's env broke")

    fake_group.members[2].step = broken_step
    trajs = fake_group.run_group(oracle_policy)
    assert [t.failed for t in trajs] == [False, False, True]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0]

    fake_group.reset(options={"task": "shell/count-files"})
    fake_group.members[0].step = broken_step
    obs, rewards, terms, truncs, infos = fake_group.step([ORACLE[0]] * 3)
    assert list(fake_group.active) == [False, True, True]
    assert truncs[0] and "OSError: the member's env broke" in infos["member_info"][0]["error"]
    obs, rewards, terms, truncs, infos = fake_group.step([ORACLE[1]] * 3)
    assert list(rewards) == [0.0, 1.0, 1.0] and not fake_group.active.any()


def test_a_member_whose_workspace_is_killed_mid_step_fails_alone():
    """Real workspaces: member 1's workspace is SIGKILLed while its command runs; that step
    returns an error observation, the other members finish with the oracle's reward."""
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=3, vectorization_mode="vector_entry_point")
    try:
        envs.reset(options={"task": "shell/count-files"})
        victim = envs.members[1].unwrapped.workspace
        killer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))

        def policy(i, obs, history):
            if i == 1 and not history:
                killer.start()
                return "sleep 20; echo survived"
            return oracle_policy(i, obs, history)

        trajs = envs.run_group(policy)
        killer.join()
        assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]
        assert [t.failed for t in trajs] == [False, True, False]
        step = trajs[1].steps[-1]
        assert step.info["workspace_failed"] and step.truncated and not step.terminated
        assert "the workspace failed" in step.observation["output"] and step.observation["exit_code"] == -1
        assert "survived" not in step.observation["output"]
        assert len(trajs[1].steps) == 1 and step.tool_s < 15  # it did not wait for the command
    finally:
        envs.close()


def test_a_desktop_killed_mid_action_gives_an_error_observation_and_resets_after():
    """The desktop env: its workspace SIGKILLed while a pyautogui action runs. The step
    returns (no exception, no input-server restart loop), truncated, with an observation of
    the space; the next reset brings a working desktop back."""
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False,
                   task="osworld/terminal-mkdir-projects")
    try:
        env.reset()
        killer = threading.Timer(1.0, os.kill, (env.unwrapped.workspace.pid, signal.SIGKILL))
        killer.start()
        obs, reward, terminated, truncated, info = env.step("import time\ntime.sleep(8)")
        killer.join()
        assert info["workspace_failed"] and truncated and not terminated and reward == 0.0, info
        assert env.observation_space.contains(obs)
        env.reset()
        obs, _, _, _, info = env.step("pyautogui.moveTo(5, 5)")
        assert "error" not in info and obs["screenshot"].any()
    finally:
        env.close()
