"""Bunshin-Shell-v0 on real workspaces: tasks, episode rules, clone, snapshot and rollback."""

from __future__ import annotations

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.core.env import ResetNeeded
from bunshin_gym.envs.shell.env import shipped_tasks


@pytest.fixture(scope="module")
def env():
    e = gym.make("Bunshin-Shell-v0")
    yield e
    e.close()


@pytest.mark.parametrize("task", shipped_tasks(), ids=lambda t: t.id)
def test_oracle_scores_one_and_giving_up_scores_zero(env, task):
    env.reset(options={"task": task})
    reward, terminated = 0.0, False
    for action in task.oracle():
        _, reward, terminated, truncated, info = env.step(action)
        assert "error" not in info, info
    assert terminated and reward == 1.0
    env.reset(options={"task": task})
    _, reward, terminated, _, _ = env.step("DONE")
    assert terminated and reward == 0.0


def test_observation_carries_output_and_exit_code(env):
    obs, info = env.reset(options={"task": "shell/count-files"})
    assert obs["instruction"] == info["instruction"] and obs["exit_code"] == -1
    obs, *_ = env.step("ls /data; exit 3")
    assert "f7.txt" in obs["output"] and obs["exit_code"] == 3
    assert obs in env.observation_space


def test_malformed_actions_become_errors_and_the_episode_goes_on(env):
    env.reset(options={"task": "shell/make-dir"})
    for bad in ("   ", 42, None):
        obs, reward, terminated, truncated, info = env.step(bad)
        assert "error" in info and obs["output"].startswith("error") and not terminated
    obs, *_ = env.step("echo still here")
    assert obs["output"] == "still here\n"


def test_a_command_timeout_is_reported_and_the_workspace_survives():
    env = gym.make("Bunshin-Shell-v0", command_timeout=0.5)
    try:
        env.reset(options={"task": "shell/make-dir"})
        obs, _, _, _, info = env.step("sleep 30")
        assert info["timed_out"] and obs["exit_code"] == -9
        assert env.step("echo ok")[0]["output"] == "ok\n"
    finally:
        env.close()


def test_truncation_at_max_steps_scores_the_final_state(env):
    env.reset(options={"task": "shell/make-dir"})
    for _ in range(env.max_steps - 1):
        assert env.step("true")[3] is False
    _, reward, terminated, truncated, _ = env.step("mkdir -p /home/user/projects/alpha")
    assert truncated and not terminated and reward == 1.0
    with pytest.raises(ResetNeeded, match="ended"):
        env.step("true")


def test_clones_keep_the_episode_and_diverge(env):
    env.reset(options={"task": "shell/hello-file"})
    env.step("echo draft > /home/user/hello.txt")
    a, b = env.clone(2)
    try:
        assert a.steps == b.steps == env.steps == 1
        assert a.step("cat hello.txt")[0]["output"] == "draft\n"
        _, r_a, *_ = a.step("echo hello world > hello.txt")
        assert a.step("DONE")[1] == 1.0
        assert b.step("DONE")[1] == 0.0
        assert env.step("cat hello.txt")[0]["output"] == "draft\n"
        a.close()  # closing a clone never affects the others
        assert b.rollback()["output"] == ""  # b's reset snapshot is the source's
        assert b.step("cat hello.txt")[0]["exit_code"] != 0
    finally:
        a.close()
        b.close()


def test_clones_and_a_rollback_run_their_next_command_under_the_pid_the_source_does(env):
    """What ``echo $$`` prints is part of the state a clone continues (tests/workspace/
    test_pid_namespace.py): the same call gives the same observation in the source, its clones
    and after a rollback to the snapshot they were made from."""
    env.reset(options={"task": "shell/make-dir"})
    for _ in range(5):
        env.step("true")
    snap = env.snapshot()
    a, b = env.clone(2)
    try:
        outputs = [e.step("echo $$")[0]["output"] for e in (env, a, b)]
        assert outputs[0] == outputs[1] == outputs[2], outputs
        env.rollback(snap)
        assert env.step("echo $$")[0]["output"] == outputs[0]
    finally:
        a.close()
        b.close()


def test_snapshot_and_rollback_restore_files_and_episode_state(env):
    env.reset(options={"task": "shell/sum-numbers"})
    env.step("echo 1 > sum.txt")
    snap = env.snapshot()
    env.step("echo 2 > sum.txt")
    env.step("rm numbers.txt")
    obs = env.rollback(snap)
    assert env.steps == 1 and obs["output"] == "" and obs["exit_code"] == 0
    assert env.step("cat sum.txt; wc -l < numbers.txt")[0]["output"] == "1\n100\n"
    env.rollback()
    assert env.steps == 0
    assert env.step("cat sum.txt")[0]["exit_code"] != 0
