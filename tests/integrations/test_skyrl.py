"""The bunshin envs registered with skyrl_gym and made by skyrl_gym.make, stepped with model text
the way SkyRL's generator does (init(prompt), then step(output) until done), on real workspaces."""

from __future__ import annotations

import pytest
import skyrl_gym

import bunshin_gym.integrations.skyrl as bsky
from bunshin_gym.train.tools import call_text

PROMPT = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Solve the task."}]


def test_registered_with_skyrl_gym():
    assert {"bunshin-shell", "bunshin-desktop", "bunshin-web"} <= set(skyrl_gym.registry)
    assert bsky.register() == ["bunshin-shell", "bunshin-desktop", "bunshin-web"]  # idempotent


def test_samples_of_a_prompt_share_the_set_up_and_are_scored_by_the_checker():
    a = skyrl_gym.make("bunshin-shell", env_config={"max_turns": 4}, extras={"task": "shell/hello-file"})
    b = skyrl_gym.make("bunshin-shell", env_config={"max_turns": 4}, extras={"task": "shell/hello-file"})
    try:
        prompt, info = a.init(PROMPT)
        assert info == {"task_id": "shell/hello-file"} and prompt[0] == PROMPT[0]
        assert prompt[-1]["content"].startswith("Solve the task.\n\nCreate /home/user/hello.txt")
        b.init(PROMPT)
        assert b.member.env.unwrapped._owned is a.member.env.unwrapped._owned  # b is a clone of a's set-up
        out = a.step("I will write it.\n" + call_text("shell", {"command": "echo hello world > hello.txt"}))
        assert not out["done"] and out["reward"] == 0.0 and "[exit code 0]" in out["observations"][0]["content"]
        out = a.step(call_text("done", {}))
        assert out["done"] and out["reward"] == 1.0 and out["observations"] == [] and out["metadata"]["success"]
        assert a.get_metrics() == {"reward": 1.0, "turns": 2}
        # b: malformed output costs a turn and says what was wrong; b never solves it
        out = b.step("no call here")
        assert "error: no tool call found" in out["observations"][0]["content"] and not out["done"]
        out = b.step(call_text("shell", {"command": "cat hello.txt"}))
        assert "No such file" in out["observations"][0]["content"]  # a's file is not in b's fork
        b.step(call_text("shell", {"command": "true"}))
        out = b.step(call_text("shell", {"command": "true"}))
        assert out["done"] and out["reward"] == 0.0 and out["metadata"]["turn"] == 4  # max_turns reached
    finally:
        a.close()
        b.close()
    assert a.member.env is None and b.member.env is None


def test_bad_extras_are_clear_errors():
    with pytest.raises(ValueError, match="extras\\['task'\\]"):
        skyrl_gym.make("bunshin-shell", env_config={}, extras={"reward_spec": {}})
    with pytest.raises(ValueError, match="max_turns"):
        skyrl_gym.make("bunshin-shell", env_config={}, extras={"task": "shell/hello-file", "max_turns": 0})
