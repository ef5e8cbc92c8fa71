"""The prefix cache's spares (rollout/spare_supply.py) on real workspaces: a snapshot restored
once gets a clone restored ahead and frozen; its next restore thaws that clone (timed as a
spare restore) and gives the state a restore gives; spares stay within the memory budget and
are reclaimed with the cache."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache
from bunshin_gym.workspace import records, spares

APPEND = "echo x >> /home/user/calls.txt; wc -l < /home/user/calls.txt"


def _wait_spare(snap_id: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not spares.count(snap_id):
        assert time.monotonic() < deadline, "no spare was made"
        time.sleep(0.1)


def _my_records() -> set[str]:
    return {r.id for r in records.all_records() if r.owner == os.getpid()}


@pytest.fixture
def one_call(tmp_path):
    """A cache (room for everything) and an env wrapped in it, one call made and snapshotted:
    (cache, env, the call's node, its snapshot). Closed and cleared after."""
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, memory_budget=1 << 30)
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        env.step(APPEND)
        env.sync()
        yield cache, env, env.node, env._env_snapshot(env.node)
    finally:
        env.close()
        cache.clear()
    assert spares.count() == 0


def test_a_snapshot_restored_once_gets_a_spare_and_its_next_restore_thaws_it(one_call):
    before = _my_records()
    cache, env, node, snap = one_call
    assert spares.count(node.snapshot) == 0  # a new snapshot gets none: most are never restored
    env._restore(snap, node)
    assert (cache.stats.restores_hot, cache.stats.restores_spare) == (1, 0)
    _wait_spare(node.snapshot)
    env.unwrapped.workspace.exec("echo y >> /home/user/calls.txt")
    ready = spares.pids(node.snapshot)
    env._restore(snap, node)
    assert env.unwrapped.workspace.pid in ready
    s = cache.stats
    assert (s.restores_hot, s.restores_spare, s.spares_made) == (1, 1, 1) and s.restore_spare_s > 0
    assert s.spare_cost() == s.restore_spare_s
    assert env.step("cat /home/user/calls.txt")[0]["output"] == "x\n"  # the snapshot's state
    _wait_spare(node.snapshot)  # made again for the next restore
    env.close()
    cache.clear()
    assert spares.count() == 0
    deadline = time.monotonic() + 20
    while _my_records() - before:  # rollbacks' replaced workspaces are reclaimed off their path
        assert time.monotonic() < deadline, _my_records() - before
        time.sleep(0.1)


def test_no_spare_is_made_beyond_the_memory_budget_and_an_evicted_snapshot_loses_its_spare(one_call):
    cache, env, node, snap = one_call
    size = cache.residency.sizes[node]
    cache.residency.fixed = size + size // 2  # the snapshot fits, a spare of its size does not
    env._restore(snap, node)
    time.sleep(2)
    assert spares.count(node.snapshot) == 0 and cache.stats.spares_made == 0

    cache.residency.fixed = 1 << 30
    env._restore(snap, node)
    _wait_spare(node.snapshot)
    cache.residency.drop([node])  # evicted: a restore made ahead of a cold snapshot is not kept
    assert spares.count(node.snapshot) == 0
