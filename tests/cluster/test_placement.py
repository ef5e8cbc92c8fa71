"""The snapshot index and placement, without Ray: longest prefix match with a load threshold,
the least-loaded fallback, migration when the holder is full, dead hosts dropped."""

from __future__ import annotations

import pytest

from bunshin_gym.cluster import IndexEntry, Placer, SnapshotIndex

KEY_A = "shell/a|0123|base@1"
KEY_B = "shell/b|4567|base@1"


def entry(host, key, *prefix, snap=None):
    return IndexEntry(host, key, tuple(prefix), snap)


def test_index_applies_create_and_evict_events():
    idx = SnapshotIndex()
    e = entry("h0", KEY_A, "ls", "pwd", snap="snap-1")
    idx.apply("h0", [("create", entry("h0", KEY_A, "ls")), ("create", e)])
    assert idx.holders("snap-1") == ["h0"]
    idx.apply("h0", [("evict", "snap-1")])
    assert idx.holders("snap-1") == []
    assert [x.prefix for x in idx.entries("h0")] == [("ls",)]
    with pytest.raises(ValueError, match="reported by host"):
        idx.apply("h1", [("create", e)])
    with pytest.raises(ValueError, match="unknown index event"):
        idx.apply("h0", [("move", e)])


def test_longest_prefix_wins_and_other_tasks_do_not_match():
    idx = SnapshotIndex()
    idx.apply("h0", [("create", entry("h0", KEY_A, "ls", snap="s0"))])
    idx.apply("h1", [("create", entry("h1", KEY_A, "ls")), ("create", entry("h1", KEY_A, "ls", "pwd", snap="s1"))])
    idx.apply("h2", [("create", entry("h2", KEY_B, "ls", "pwd", "cat", snap="s2"))])
    matches = idx.match("shell/a", ("ls", "pwd", "df"))
    assert [(m.host, m.depth, m.snapshot) for m in matches] == [("h1", 2, "s1"), ("h0", 1, "s0")]
    # a prefix that leaves the cached path at its first call matches nothing there
    assert idx.match("shell/a", ("cat",)) == []
    d = Placer("prefix").choose("shell/a", {"h0": 0, "h1": 0, "h2": 0}, idx, ("ls", "pwd", "df"))
    assert (d.host, d.reason, d.depth) == ("h1", "prefix", 2)
    # task only (no prefix known): the host with the deepest snapshot of the task
    assert Placer("prefix").choose("shell/a", {"h0": 0, "h1": 0, "h2": 0}, idx).host == "h1"


def test_no_match_goes_to_the_least_loaded_host():
    idx = SnapshotIndex()
    idx.apply("h0", [("create", entry("h0", KEY_A, "ls", snap="s0"))])
    d = Placer("prefix", capacity=4).choose("shell/b", {"h0": 0, "h1": 2, "h2": 1}, idx)
    assert (d.host, d.reason) == ("h0", "least-loaded")
    d = Placer("prefix", capacity=4).choose("shell/b", {"h0": 3, "h1": 2, "h2": 1}, idx)
    assert (d.host, d.reason) == ("h2", "least-loaded")


def test_a_holder_past_the_threshold_gives_way_with_a_migration():
    idx = SnapshotIndex()
    idx.apply("h0", [("create", entry("h0", KEY_A, "ls", "pwd", snap="s0"))])
    placer = Placer("prefix", threshold=1, capacity=3)
    d = placer.choose("shell/a", {"h0": 1, "h1": 0, "h2": 2}, idx)
    assert (d.host, d.reason, d.migrate_from, d.snapshot) == ("h1", "overloaded-holder", "h0", "s0")
    # the least-loaded host already holds as deep a snapshot: no copy
    idx.apply("h1", [("create", entry("h1", KEY_A, "ls", "pwd", snap="s0"))])
    d = placer.choose("shell/a", {"h0": 2, "h1": 1, "h2": 2}, idx)
    assert (d.host, d.migrate_from) == ("h1", None)
    # equal matches: the less loaded holder
    d = placer.choose("shell/a", {"h0": 1, "h1": 0, "h2": 0}, idx)
    assert (d.host, d.reason) == ("h1", "prefix")
    # past the threshold but the only host with room: still the holder, no copy
    only = SnapshotIndex()
    only.apply("h0", [("create", entry("h0", KEY_A, "ls", "pwd", snap="s0"))])
    d = placer.choose("shell/a", {"h0": 1, "h1": 3, "h2": 3}, only)
    assert (d.host, d.reason, d.migrate_from) == ("h0", "prefix", None)
    assert Placer("prefix", threshold=1, capacity=3, migrate=False).choose(
        "shell/a", {"h0": 1, "h1": 2, "h2": 0}, idx).migrate_from is None


def test_full_hosts_take_nothing_and_dead_hosts_leave_the_index():
    idx = SnapshotIndex()
    idx.apply("h0", [("create", entry("h0", KEY_A, "ls", snap="s0"))])
    placer = Placer("prefix", threshold=2, capacity=2)
    assert placer.choose("shell/a", {"h0": 2, "h1": 2}, idx) is None
    assert idx.drop_host("h0") == 1
    assert idx.match("shell/a") == []
    assert placer.choose("shell/a", {"h1": 0}, idx).host == "h1"


def test_random_placement_spreads_and_bad_settings_are_refused():
    placer = Placer("random", capacity=8, seed=3)
    hosts = {placer.choose("shell/a", {"h0": 0, "h1": 0, "h2": 0}, SnapshotIndex()).host for _ in range(30)}
    assert hosts == {"h0", "h1", "h2"}
    with pytest.raises(ValueError, match="unknown placement policy"):
        Placer("nearest")
    with pytest.raises(ValueError, match=">= 1"):
        Placer("prefix", capacity=0)
