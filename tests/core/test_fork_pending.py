"""``fork_pending``: lazy clones forked together, on the real shell env."""

from __future__ import annotations

import threading

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core import fork_pending


@pytest.fixture
def source():
    env = gym.make("Bunshin-Shell-v0", max_steps=10**6)
    env.reset(options={"task": "shell/make-dir"})
    env.step("echo source > /tmp/who")
    yield env
    env.close()


def test_lazy_clones_forked_together_each_get_their_own_workspace_of_the_source_state(source):
    clones = source.unwrapped.clone(4, lazy=True)
    try:
        assert all(c._ws is None for c in clones)  # lazy: nothing forked yet
        assert fork_pending(clones[:3]) == 3
        ids = {c.workspace.id for c in clones[:3]}
        assert len(ids) == 3 and source.unwrapped.workspace.id not in ids
        assert clones[3]._ws is None  # not asked for: still pending
        for i, c in enumerate(clones):  # the fourth forks on first use, as before
            obs, _, _, _, info = c.step(f"cat /tmp/who; echo {i} > /tmp/who; cat /tmp/who")
            assert "error" not in info and obs["output"].split() == ["source", str(i)], obs
        assert fork_pending(clones) == 0  # nothing pending any more
        assert source.step("cat /tmp/who")[0]["output"].strip() == "source"
    finally:
        for c in clones:
            c.close()


def test_clones_keep_the_memory_mode_they_were_asked_for(source):
    (copy_clone,) = source.unwrapped.clone(1, lazy=True, mode="copy")
    try:
        fork_pending([copy_clone])
        assert copy_clone.workspace._rec.memory_mode == "copy" and source.unwrapped.memory_mode == "share"
    finally:
        copy_clone.close()


def test_a_clone_used_by_another_thread_meanwhile_gets_one_workspace(source):
    clones = source.unwrapped.clone(2, lazy=True)
    try:
        t = threading.Thread(target=lambda: clones[0].step("true"))
        t.start()
        fork_pending(clones)
        t.join()
        assert clones[0].workspace.id != clones[1].workspace.id
        from bunshin_gym.rollout.runmemory import workspace_memory

        assert workspace_memory()["workspaces"] == 3  # the source and one each: none forked twice
    finally:
        for c in clones:
            c.close()
