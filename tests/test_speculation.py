"""The Spec Tool Selector and speculative execution in forks, on real workspaces."""

from __future__ import annotations

import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import SpecToolSelector, Speculation, TrajectoryLog, signature

SLOW = "sleep 1; echo done > /home/user/spec.txt; cat /home/user/spec.txt"


def log_entries(episodes: dict[str, list[str]], repeat: int = 5, duration: float = 1.0) -> list[dict]:
    out = []
    for r in range(repeat):
        for task, actions in episodes.items():
            for depth, a in enumerate(actions):
                out.append({"task": task, "episode": f"{task}-{r}", "depth": depth, "signature": signature(a),
                            "action": a, "duration": duration})
    return out


def test_selector_learns_next_calls_and_saves(tmp_path):
    entries = log_entries({
        "t/a": ["ls", "cat a.txt", "wc -l a.txt", "DONE"],
        "t/b": ["ls", "cat b.txt", "rm b.txt", "DONE"],
    })
    sel = SpecToolSelector.train(entries)
    assert sel.accuracy(entries) >= 0.95
    assert sel.predict("t/b", [signature("ls")], k=2)[0][1] == "cat b.txt"
    assert [p[1] for p in sel.predict("t/a", [signature("ls")], k=3)] == ["cat a.txt", "wc -l a.txt", "DONE"]
    sel.save(tmp_path / "sel.npz")
    again = SpecToolSelector.load(tmp_path / "sel.npz")
    assert again.predict("t/a", [], k=4) == sel.predict("t/a", [], k=4)


def speculative_env(duration: float, min_duration: float = 0.5):
    entries = log_entries({"shell/make-dir": [SLOW, "DONE"]}, duration=duration)
    spec = Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                       min_duration=min_duration)
    return spec, spec.wrap(gym.make("Bunshin-Shell-v0"))


def test_a_matching_prediction_is_served_from_the_fork_and_its_state_adopted():
    spec, env = speculative_env(duration=1.0)
    try:
        env.reset(options={"task": "shell/make-dir"})
        time.sleep(4)  # the policy "thinks" while the fork runs the predicted call
        obs, _, _, _, info = env.step(SLOW)
        assert info.get("speculation") == "hit" and obs["output"] == "done\n"
        assert spec.stats.matched == 1 and spec.stats.launched >= 1
        base = env.unwrapped
        assert base.steps == 1
        assert base.workspace.exec("cat /home/user/spec.txt").text == "done\n"  # the fork's state
        _, reward, terminated, _, _ = env.step("DONE")
        assert terminated and reward == 0.0
    finally:
        env.close()


def test_a_mismatch_discards_the_speculative_fork():
    spec, env = speculative_env(duration=1.0)
    try:
        env.reset(options={"task": "shell/make-dir"})
        time.sleep(4)
        obs, _, _, _, info = env.step("echo other")
        assert "speculation" not in info and obs["output"] == "other\n"
        assert spec.stats.mismatched == 1
        assert env.unwrapped.workspace.exec("test -e /home/user/spec.txt").exit_code == 1
    finally:
        env.close()


@pytest.mark.parametrize("duration", [0.01])
def test_fast_calls_are_not_worth_a_fork(duration):
    spec, env = speculative_env(duration=duration)
    try:
        env.reset(options={"task": "shell/make-dir"})
        env.step(SLOW)
        assert spec.stats.launched == 0 and spec.stats.skipped_fast >= 1
    finally:
        env.close()
