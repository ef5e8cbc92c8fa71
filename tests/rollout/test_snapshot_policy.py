"""The prefix cache's snapshot policy: "interval" snapshots every k-th depth; "cost" only
where the replay a snapshot spares took at least what a snapshot costs, and where a restore
of it would not be declined by the memory budget."""

from __future__ import annotations

from types import SimpleNamespace

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache

TASK = "shell/make-dir"
# quick calls, then a slow one, then a quick one
ACTIONS = ["echo a > /home/user/a", "echo b > /home/user/b", "echo c > /home/user/c",
           "sleep 3; echo d > /home/user/d", "echo e > /home/user/e"]


def run_actions(cache: PrefixCache) -> None:
    """One episode of the task through ``cache``: ACTIONS, then wait for its snapshots."""
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))  # share clones, served by userfaultfd
    try:
        env.reset(options={"task": TASK})
        for action in ACTIONS:
            env.step(action)
        env.sync()
    finally:
        env.close()


def snapshotted(cache: PrefixCache) -> list[tuple[int, bool]]:
    """(depth, whether it has a snapshot) of each recorded call, by depth."""
    return sorted((n.depth, bool(n.snapshot)) for n in cache.tree.nodes() if n.depth)


@pytest.mark.parametrize("policy", ["interval", "cost"])
def test_cost_snapshots_only_where_the_replay_it_spares_took_longer(tmp_path, policy):
    # a budget every snapshot fits (the next test is about the budget)
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, snapshot_policy=policy, memory_budget=1 << 30)
    # the first snapshot is taken to measure one; quick calls spare less than it costs, a slow
    # call (and what came before it since the last snapshot) spares more
    run_actions(cache)
    try:
        taken = snapshotted(cache)
        if policy == "interval":
            assert taken == [(d, True) for d in range(1, 6)] and cache.stats.snapshots_skipped == 0
        else:
            mean = cache.stats.snapshot_s / cache.stats.snapshots
            assert mean < 3, f"a shell snapshot took {mean:.2f} s on average: this test needs it under 3 s"
            assert taken == [(1, True), (2, False), (3, False), (4, True), (5, False)], taken
            assert cache.stats.snapshots_skipped == 3
        # either way a later episode that leaves the tree at the end gets the same state
        again = cache.wrap(gym.make("Bunshin-Shell-v0"))
        try:
            again.reset(options={"task": TASK})
            for action in ACTIONS:
                assert again.step(action)[4]["cache"] == "hit"
            obs, *_ = again.step("cat /home/user/a /home/user/b /home/user/c /home/user/d /home/user/e")
            assert obs["output"] == "a\nb\nc\nd\ne\n"
        finally:
            again.close()
    finally:
        cache.clear()


@pytest.mark.parametrize("bound", [True, False])
def test_cost_takes_no_snapshot_whose_restores_the_budget_would_decline(tmp_path, bound):
    """A share clone restored from a snapshot maps a tmpfs copy of its page images; with
    bounded restores, one whose copy exceeds the memory budget is never restored (replayed
    instead). After the first snapshot measured that size, none is taken where it would not
    fit; without the bound, the slow call is snapshotted as before."""
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, snapshot_policy="cost",
                        memory_budget=64 << 10, bound_restores=bound)  # 64 KiB: no shell image fits
    run_actions(cache)
    try:
        assert cache.stats.snapshot_copy_bytes > 64 << 10, cache.stats
        taken = snapshotted(cache)
        if bound:
            assert taken == [(1, True), (2, False), (3, False), (4, False), (5, False)], taken
            assert (cache.stats.snapshots_too_large, cache.stats.snapshots_skipped) == (4, 4)
        else:
            assert taken == [(1, True), (2, False), (3, False), (4, True), (5, False)], taken
            assert (cache.stats.snapshots_too_large, cache.stats.snapshots_skipped) == (0, 3)
    finally:
        cache.clear()


def test_cost_measures_its_first_snapshot_once_not_once_per_member(tmp_path):
    """Members snapshot in the background: until the first snapshot is measured, every member
    would take "the first" (8 at once on the web env, 17 s of member time each). One is
    taken; the others wait for its measure; one that failed lets the next try."""
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, snapshot_policy="cost")
    a, b, c = (SimpleNamespace(depth=1, snapshot=None, parent=None, duration=5.0) for _ in range(3))
    assert cache.want_snapshot(a)  # the first: taken to measure one
    assert not cache.want_snapshot(b)  # another member's, while the first is being taken
    cache.snapshot_ended()  # the first failed: nothing was measured
    assert cache.want_snapshot(c)
    assert cache.stats.snapshots_skipped == 1 and cache.stats.snapshots_too_large == 0


def test_an_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="snapshot_policy must be one of interval, cost"):
        PrefixCache(tmp_path / "cache", snapshot_policy="sometimes")
