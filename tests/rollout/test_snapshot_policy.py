"""The prefix cache's snapshot policy: "interval" snapshots every k-th depth; "cost" only
where the replay a snapshot's expected restores spare exceeds what a snapshot costs now, and
where a restore of it would not be declined by the memory budget."""

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
            # the slow call's snapshot is worth (2 prior restores / 3 snapshots) x (3 s - 0.3 s restore)
            cost = cache.stats.snapshot_s / cache.stats.snapshots
            assert cost < 1.5, f"a shell snapshot took {cost:.2f} s on average: this test needs it under 1.5 s"
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


def chain(*durations: float) -> SimpleNamespace:
    """The last node of a path of recorded calls that took ``durations`` (no snapshot on it)."""
    node = SimpleNamespace(depth=0, snapshot=None, parent=None, duration=0.0)  # the root
    for d in durations:
        node = SimpleNamespace(depth=node.depth + 1, snapshot=None, parent=node, duration=d)
    return node


def test_cost_prices_a_snapshot_at_the_recent_ones_not_the_run_mean(tmp_path):
    """Under a run's load a snapshot costs many times the first one (measured on the desktop:
    0.7 s first, 8 s each once 64 members ran); a policy pricing it at the mean of all taken
    lagged behind and kept taking them."""
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, snapshot_policy="cost", memory_budget=1 << 30)
    node = chain(2.0, 2.0)  # 4 s of replay spared by each restore
    cache.snapshot_taken(0.5, 0)
    assert cache.snapshot_cost() == 0.5 and cache.want_snapshot(node)
    for _ in range(3):
        cache.snapshot_taken(8.0, 0)
    assert cache.snapshot_cost() == pytest.approx((0.5 + 3 * 8.0) / 4)
    cache.snapshot_taken(8.0, 0)  # the first falls out of the recent ones
    assert cache.snapshot_cost() == 8.0 and not cache.want_snapshot(node)
    assert cache.stats.snapshots == 5 and cache.stats.snapshot_s == pytest.approx(32.5)


def test_cost_expects_the_restores_snapshots_got_so_far(tmp_path):
    """A snapshot saves time only when restored: its value is the replay a restore spares, less
    the restore, times the restores per snapshot measured so far (prior: one each)."""
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, snapshot_policy="cost", memory_budget=1 << 30)
    node = chain(1.0, 1.0, 1.3)  # 3.3 s spared; a hot restore is priced at its prior, 0.3 s
    assert cache.snapshot_value(node) == pytest.approx(3.0)  # no snapshot yet: the prior, 1 each
    for _ in range(10):
        cache.snapshot_taken(1.0, 0)
    assert cache.snapshot_value(node) == pytest.approx(3.0 * 2 / 12)  # 10 taken, none restored
    assert not cache.want_snapshot(node)
    cache.count(restores=10)  # each was restored once
    assert cache.snapshot_value(node) == pytest.approx(3.0) and cache.want_snapshot(node)
    # a restore that costs more than the replay it spares saves nothing
    cache.count(restores_hot=1, restore_hot_s=5.0)
    assert cache.snapshot_value(node) == 0.0


def test_an_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="snapshot_policy must be one of interval, cost"):
        PrefixCache(tmp_path / "cache", snapshot_policy="sometimes")
