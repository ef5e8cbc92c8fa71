"""PrefixCache on real workspaces: hits serve recorded results without executing, misses
restore the deepest snapshot and replay, and the tree persists across processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache, TrajectoryLog

APPEND = "echo x >> /home/user/calls.txt; wc -l < /home/user/calls.txt"


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(tmp_path / "cache", snapshot_every=1)
    yield c
    c.clear()


def test_a_hit_returns_the_recorded_result_without_executing(cache):
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        obs1, _, _, _, info1 = env.step(APPEND)
        assert info1["cache"] == "miss" and obs1["output"] == "1\n"
        env.reset(options={"task": "shell/make-dir"})
        obs2, _, _, _, info2 = env.step("echo x  >>  /home/user/calls.txt;   wc -l < /home/user/calls.txt")
        assert info2["cache"] == "hit" and obs2 == obs1  # same signature: whitespace-normalised
        # the live workspace, brought to the episode's position, ran the call exactly once
        assert env.workspace.exec("cat /home/user/calls.txt").text == "x\n"
        assert cache.stats.hits == 1 and cache.stats.misses == 1
    finally:
        env.close()


def test_members_served_only_from_the_cache_never_fork(cache):
    actions = ["ls /data", "ls /data | wc -l > answer.txt", "DONE"]
    policy = lambda i, obs, hist: actions[len(hist)]  # noqa: E731
    for _epoch in range(2):
        envs = gym.make_vec("Bunshin-Shell-v0", num_envs=3, vectorization_mode="vector_entry_point", cache=cache)
        try:
            trajs = envs.run_group(policy, options={"task": "shell/count-files"})
            assert [t.reward for t in trajs] == [1.0, 1.0, 1.0]
            materialized = [m.unwrapped.materialized for m in envs.members]
        finally:
            envs.close()
    assert materialized == [False, False, False]  # epoch 2: all hits, no writable fork created
    # members issuing the same call at once wait for one run of it: 3 executions in all
    assert cache.stats.misses == 3 and cache.stats.hits == 18 - 3


def test_a_miss_after_hits_restores_the_deepest_snapshot_and_replays(cache):
    plain = gym.make("Bunshin-Shell-v0")
    cached = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        common = [APPEND, APPEND, APPEND]
        for env in (plain, cached):
            env.reset(options={"task": "shell/make-dir"})
            for a in common:
                env.step(a)
        cached.reset(options={"task": "shell/make-dir"})
        plain.reset(options={"task": "shell/make-dir"})
        outs = []
        for env in (plain, cached):
            for a in common:
                env.step(a)
            outs.append(env.step("cat /home/user/calls.txt; echo end")[0])
        assert outs[0] == outs[1] and outs[1]["output"] == "x\nx\nx\nend\n"
        assert cache.stats.restores + cache.stats.replays >= 1
    finally:
        plain.close()
        cached.close()


def test_hits_are_valid_only_for_the_same_task_definition(cache):
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        task = {"id": "shell/custom", "instruction": "x", "setup": ["echo one > /home/user/f"],
                "check": "true", "max_steps": 3}
        env.reset(options={"task": task})
        assert env.step("cat /home/user/f")[0]["output"] == "one\n"
        env.reset(options={"task": dict(task, setup=["echo two > /home/user/f"])})
        obs, _, _, _, info = env.step("cat /home/user/f")
        assert info["cache"] == "miss" and obs["output"] == "two\n"
        env.reset(options={"task": "shell/make-dir"})
        assert env.step("cat /home/user/f")[4]["cache"] == "miss"
    finally:
        env.close()


def test_the_tree_persists_across_processes(cache, tmp_path):
    script = textwrap.dedent(f"""
        import gymnasium as gym, bunshin_gym
        from bunshin_gym.rollout import PrefixCache
        cache = PrefixCache({str(cache.tree.dir)!r}, snapshot_every=1)
        env = cache.wrap(gym.make("Bunshin-Shell-v0"))
        env.reset(options={{"task": "shell/make-dir"}})
        env.step("echo from-another-process")
        env.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    again = PrefixCache(cache.tree.dir, snapshot_every=1)
    env = again.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        obs, _, _, _, info = env.step("echo from-another-process")
        assert info["cache"] == "hit" and obs["output"] == "from-another-process\n"
    finally:
        env.close()
        again.clear()


SLOW_APPEND = "sleep 0.5; " + APPEND


@pytest.mark.parametrize("restore_s, replays, restores", [(0.001, 0, 2), (30.0, 2, 0)])
def test_replay_or_restore_follows_the_recorded_costs(tmp_path, restore_s, replays, restores):
    # room for the snapshots in the budget: time alone decides (a restore that would copy
    # more page images than the budget is declined: test_a_cold_snapshot_is_not_restored...)
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, overlap=False, memory_budget=1 << 30)
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        env.step(SLOW_APPEND)
        env.step(SLOW_APPEND)
        assert cache.stats.snapshots == 2  # both positions could be restored
        # the recorded cost of a restore, hot or cold, against 0.5 s per replayed call (as the
        # mean of many, so that the restores this test makes, slow on a loaded host, move it little)
        cache.stats.restores_hot = cache.stats.restores_cold = 1000
        cache.stats.restore_hot_s = cache.stats.restore_cold_s = 1000 * restore_s
        before = cache.stats.replays, cache.stats.restores
        env.reset(options={"task": "shell/make-dir"})
        for _ in range(2):  # hits: the live workspace follows each by the cheaper way
            assert env.step(SLOW_APPEND)[4]["cache"] == "hit"
        obs, _, _, _, info = env.step("cat /home/user/calls.txt")
        assert info["cache"] == "miss" and obs["output"] == "x\nx\n"  # either way, the same state
        assert (cache.stats.replays - before[0], cache.stats.restores - before[1]) == (replays, restores)
    finally:
        env.close()
        cache.clear()


def test_hot_and_cold_restores_are_timed_apart(tmp_path):
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, memory_budget=1 << 30)  # room for it: hot
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        env.step(APPEND)
        env.sync()  # the snapshot after the call is taken
        node = env.node
        snap = env._env_snapshot(node)
        assert cache.residency.is_resident(node)
        env._restore(snap, node)
        cache.residency.drop([node])  # its images written back and dropped from the page cache
        assert not cache.residency.is_resident(node)
        env._restore(snap, node)
        s = cache.stats
        assert (s.restores_hot, s.restores_cold) == (1, 1)
        assert s.restore_cost(True) == s.restore_hot_s > 0 and s.restore_cost(False) == s.restore_cold_s > 0
        assert env.step("cat /home/user/calls.txt")[0]["output"] == "x\n"
    finally:
        env.close()
        cache.clear()


def test_the_log_keeps_the_observation_each_call_was_made_from(tmp_path):
    log = TrajectoryLog(tmp_path / "log.jsonl")
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, log=log)
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        for _ in range(2):  # executed, then served: both logged alike
            env.reset(options={"task": "shell/make-dir"})
            env.step("echo first-output")
            env.step("ls /nonexistent-dir")
    finally:
        env.close()
        cache.clear()
    entries = TrajectoryLog.load(log.path)
    assert [e["served"] for e in entries] == ["executed", "executed", "cache", "cache"]
    assert [e["depth"] for e in entries] == [0, 1, 0, 1]
    assert entries[0]["observation"] == "" and entries[1]["observation"] == "first-output\n"
    assert entries[3]["observation"] == "first-output\n"


def test_the_cheapest_start_counts_restores_replays_and_a_lazy_fork(tmp_path):
    from bunshin_gym.rollout.prefix_cache import Node

    cache = PrefixCache(tmp_path / "cache", memory_budget=1 << 30)
    root = Node("", None, 0)
    a = Node("a", "a", 1, parent=root, duration=0.5, snapshot="snap-a")
    b = Node("b", "b", 2, parent=a, duration=0.5)
    path = [root, a, b]
    hot, cold = cache.stats.restore_cost(True), cache.stats.restore_cost(False)
    assert cache.start_cost(path, live=0) == (pytest.approx(1.0), 0)  # replay both calls
    # a lazy env forks before it can replay: restoring the snapshot and replaying one call wins
    assert cache.start_cost(path, live=0, materialized=False) == (pytest.approx(cold + 0.5), 1)
    cache.residency.add(a, 1 << 20)  # the snapshot is resident now: a hot restore
    assert cache.start_cost(path, live=0) == (pytest.approx(hot + 0.5), 1)
    assert cache.start_cost(path, live=1) == (pytest.approx(0.5), 1)  # the live workspace is there


def test_a_restore_that_would_copy_more_page_images_than_the_budget_is_replayed_instead(tmp_path):
    from bunshin_gym.rollout.prefix_cache import Node

    cache = PrefixCache(tmp_path / "cache", memory_budget=10 << 20)
    root = Node("", None, 0)
    a = Node("a", "a", 1, parent=root, duration=2.0, snapshot="snap-a")
    b = Node("b", "b", 2, parent=a, duration=2.0)
    path = [root, a, b]
    cold = cache.stats.restore_cost(False)
    copies = {"snap-a": 30 << 20}  # what restoring snap-a would copy onto the tmpfs
    # the quickest start is the restore, but its copy exceeds the budget: the calls are
    # replayed from the live workspace (its page images are mapped already)
    assert cache.start_cost(path, live=0) == (pytest.approx(cold + 2.0), 1)
    assert cache.start_cost(path, live=0, restore_bytes=lambda n: copies[n.snapshot]) == (pytest.approx(4.0), 0)
    assert cache.stats.restores_declined == 1
    copies["snap-a"] = 8 << 20  # fits: the restore competes again
    assert cache.start_cost(path, live=0, restore_bytes=lambda n: copies[n.snapshot]) == (pytest.approx(cold + 2.0), 1)
    copies["snap-a"] = 0  # its copy is there (a hot snapshot keeps it): nothing to add
    cache.residency.fixed = 0
    assert cache.start_cost(path, live=0, restore_bytes=lambda n: copies[n.snapshot])[1] == 1
    assert cache.stats.restores_declined == 1


def test_a_cold_snapshot_is_not_restored_beyond_the_budget_and_a_hot_one_restores_from_its_kept_copy(tmp_path):
    from bunshin_gym.rollout.residency import copy_bytes
    from bunshin_gym.workspace import uffd

    # replaying a call costs more than a restore is assumed to, and than one measured on a busy
    # host (a restore took over 1 s at load 8-50 on 2 cores: with "sleep 1" the test chose replays)
    slow = "sleep 2.5; " + APPEND
    # (budget, bounded, replays, restores): after each hit the live workspace catches up (overlap
    # off: at once); unbounded, time alone decides (a cluster host sent a snapshot to restore)
    for budget, bounded, replays, restores in ((0, True, 2, 0), (0, False, 0, 2), (1 << 30, True, 0, 2)):
        cache = PrefixCache(tmp_path / f"cache-{budget}-{bounded}", snapshot_every=1, overlap=False,
                            memory_budget=budget, bound_restores=bounded)
        env = cache.wrap(gym.make("Bunshin-Shell-v0", memory_mode="share"))
        try:
            env.reset(options={"task": "shell/make-dir"})
            env.step(slow)
            env.step(slow)
            nodes = env.node.path()[1:]
            # resident (room for them): their copies were made and are kept; spilled: none is there
            assert [uffd.has_image_copy(n.snapshot) for n in nodes] == [bool(budget)] * 2
            assert [copy_bytes(n.snapshot) == 0 for n in nodes] == [bool(budget)] * 2
            before = cache.stats.replays, cache.stats.restores
            env.reset(options={"task": "shell/make-dir"})
            for _ in range(2):
                assert env.step(slow)[4]["cache"] == "hit"
            obs, _, _, _, info = env.step("cat /home/user/calls.txt")
            assert info["cache"] == "miss" and obs["output"] == "x\nx\n"
            assert (cache.stats.replays - before[0], cache.stats.restores - before[1]) == (replays, restores)
            # spilled: each restore was the quickest start, but would have copied its images
            assert cache.stats.restores_declined == (0 if budget or not bounded else 2)
            assert cache.stats.restores_hot == (restores if budget else 0)
        finally:
            env.close()
            cache.clear()
        assert not any(uffd.has_image_copy(n.snapshot) for n in nodes)  # deleted with the cache, copies too


def test_an_unmeasured_cold_restore_is_never_assumed_cheaper_than_a_measured_hot_one(tmp_path):
    from bunshin_gym.rollout.stats import PRIOR_RESTORE_S, CacheStats

    s = CacheStats()
    assert (s.restore_cost(True), s.restore_cost(False)) == (PRIOR_RESTORE_S[True], PRIOR_RESTORE_S[False])
    s.restores_hot, s.restore_hot_s = 2, 10.0  # hot restores took 5 s on a loaded host
    ratio = PRIOR_RESTORE_S[False] / PRIOR_RESTORE_S[True]
    assert s.restore_cost(True) == 5.0 and s.restore_cost(False) == pytest.approx(5.0 * ratio)
    s.restores_cold, s.restore_cold_s = 1, 7.0  # measured: the measure wins
    assert s.restore_cost(False) == 7.0
    only_cold = CacheStats(restores_cold=1, restore_cold_s=3.0)
    assert only_cold.restore_cost(True) == pytest.approx(3.0 / ratio)
    # so a cold snapshot is not chosen over the live workspace's replays on the prior alone
    from bunshin_gym.rollout.prefix_cache import Node

    cache = PrefixCache(tmp_path / "cache", memory_budget=0)
    cache.stats.restores_hot, cache.stats.restore_hot_s = 1, 5.0
    root = Node("", None, 0)
    a = Node("a", "a", 1, parent=root, duration=1.0, snapshot="snap-a")
    b = Node("b", "b", 2, parent=a, duration=1.0)
    assert cache.start_cost([root, a, b], live=0) == (pytest.approx(2.0), 0)  # replaying beats ~10 s


def test_every_group_of_a_task_forks_its_members_from_the_start_snapshot_the_cache_keeps(tmp_path):
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.rollout.prefix_cache import cache_key
    from bunshin_gym.workspace.snapshot import SnapshotStore

    cache = PrefixCache(tmp_path / "cache", snapshot_every=1)
    starts, forked_from = [], []
    try:
        for epoch in range(2):
            envs = gym.make_vec("Bunshin-Shell-v0", num_envs=2, vectorization_mode="vector_entry_point", cache=cache)
            try:
                envs.reset(options={"task": "shell/count-files"})
                start = cache.tree.root(cache_key(envs.members[0])).start
                starts.append(start)
                assert [m.unwrapped._pending.workspace.id for m in envs.members] == [start, start]
                # a miss: the member forks now, from the kept start (its episode state is its own group's)
                obs, _, _, _, info = envs.members[0].step(f"echo {epoch} > /home/user/e; ls /data | wc -l")
                assert info["cache"] == "miss" and obs["output"].strip().isdigit()
                forked_from.append(envs.members[0].unwrapped.workspace._rec.snapshot)
                assert envs.members[0].unwrapped.steps == 1
            finally:
                envs.close()
            SnapshotStore().get(start)  # the group closed: the cache keeps the task's start
        assert starts[0] == starts[1] == forked_from[0] == forked_from[1]
    finally:
        cache.clear()
    with pytest.raises(SnapshotError):
        SnapshotStore().get(starts[0])  # the cache's clear deletes it


def test_a_deleted_caches_snapshots_are_left_to_gc(tmp_path):
    """A cache's snapshots are recorded only in its tree: deleted with its directory (a
    server's state directory, a test's temporary one), they stayed in the store for good (7-9
    per run of the test suite). Each is kept by the cache's directory, and `bunshin gc`
    deletes them once that is gone; while it is there, gc leaves them."""
    import os
    import shutil
    import time

    from bunshin_gym.config import paths
    from bunshin_gym.workspace import gc
    from bunshin_gym.workspace.snapshot import SnapshotStore

    cache_dir = tmp_path / "cache"
    cache = PrefixCache(cache_dir, snapshot_every=1)
    actions = ["ls /data", "ls /data | wc -l > answer.txt", "DONE"]
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=2, vectorization_mode="vector_entry_point", cache=cache)
    try:
        envs.run_group(lambda i, obs, hist: actions[len(hist)], options={"task": "shell/count-files"})
    finally:
        envs.close()
    ids = {n.snapshot for n in cache.tree.nodes() if n.snapshot}
    ids |= {r.start for r in cache.tree.roots.values() if getattr(r, "start", None)}
    assert len(ids) >= 2, "the group left the cache no task start and no call's snapshot"
    store, p = SnapshotStore(), paths()
    try:
        for snap_id in ids:
            meta = store.get(snap_id).metadata
            assert meta.kept_by == str(cache_dir.resolve()) and meta.holder is None, (snap_id, meta)
        listing = subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "snap", "ls"], capture_output=True,
                                 text=True, timeout=60).stdout
        rows = {line.split()[0]: line for line in listing.splitlines()[1:] if line.strip()}
        assert all(str(cache_dir.resolve()) in rows[i] and "(gone)" not in rows[i] for i in ids), listing
        old = time.time() - 120  # past gc's grace for a fork that is registering its clones
        for snap_id in ids:
            os.utime(p.snapshots / snap_id, (old, old))
        report = gc.collect()
        assert not ids & set(report.snapshots) and all((p.snapshots / i).exists() for i in ids)
        shutil.rmtree(cache_dir)
        report = gc.collect()
        # each one gone; the report names those gc deleted itself (an ancestor deleted with its
        # last child's release is not named)
        assert not [i for i in ids if (p.snapshots / i).exists()], (ids, report.snapshots)
        assert set(report.snapshots) & ids
    finally:
        if cache_dir.exists():
            cache.clear()
