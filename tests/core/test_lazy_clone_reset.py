"""Lazy clones right after a reset fork the reset snapshot instead of dumping the same state
again, and only then: on the real shell env."""

from __future__ import annotations

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.workspace.snapshot import SnapshotStore


def _snapshot_ids(ws_id: str) -> set[str]:
    """Snapshots taken of workspace ``ws_id`` (other sessions share the store)."""
    return {s.id for s in SnapshotStore().list() if s.meta.get("workspace") == ws_id}


@pytest.fixture
def env():
    e = gym.make("Bunshin-Shell-v0", max_steps=10**6)
    yield e
    e.close()


def test_lazy_clones_right_after_reset_fork_the_reset_snapshot_and_take_none(env):
    env.reset(options={"task": "shell/make-dir"})
    before = _snapshot_ids(env.unwrapped._ws.id)
    clones = env.unwrapped.clone(2, lazy=True)
    try:
        assert _snapshot_ids(env.unwrapped._ws.id) == before  # no second dump of the state the reset snapshot holds
        assert all(c._pending.workspace.id == env.unwrapped._reset_snap.workspace.id for c in clones)
        obs, _, _, _, info = clones[0].step("ls /home/user; echo clone > /tmp/who; cat /tmp/who")
        assert "error" not in info and obs["output"].split()[-1] == "clone"
        assert env.step("cat /tmp/who 2>/dev/null || echo none")[0]["output"].strip() == "none"
    finally:
        for c in clones:
            c.close()


@pytest.mark.parametrize("change", ["step", "exec", "rollback-elsewhere"])
def test_a_lazy_clone_after_a_change_since_reset_snapshots_the_changed_state(env, change):
    base = env.unwrapped
    env.reset(options={"task": "shell/make-dir"})
    elsewhere = None
    if change == "step":
        env.step("echo changed > /tmp/who")
    elif change == "exec":  # the workspace used directly, not through a step
        base.workspace.exec("echo changed > /tmp/who", check=True)
    else:
        env.step("echo changed > /tmp/who")
        elsewhere = base.snapshot()
        env.reset(options={"task": "shell/make-dir"})
        base.rollback(elsewhere)
    (clone,) = base.clone(1, lazy=True)
    try:
        assert clone._pending.workspace.id != base._reset_snap.workspace.id
        assert clone.step("cat /tmp/who")[0]["output"].strip() == "changed"  # the source's state
    finally:
        clone.close()
