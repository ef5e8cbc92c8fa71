"""The ancestor-aware LRU that keeps hot cached snapshots in memory, under a budget sized from
the run: units, then the prefix cache and snapshot copies on real workspaces."""

from __future__ import annotations

import subprocess

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache
from bunshin_gym.rollout.prefix_cache import Node
from bunshin_gym.rollout.residency import AUTO_FRACTION, Residency, drop_snapshot
from bunshin_gym.rollout.runmemory import run_bytes
from bunshin_gym.workspace import Workspace, uffd


def chain(*names: str) -> list[Node]:
    nodes, parent = [], None
    for i, name in enumerate(names):
        n = Node(sig=name, action=name, depth=i, parent=parent)
        nodes.append(n)
        parent = n
    return nodes


def test_least_recently_used_leaf_is_evicted_first():
    r = Residency(budget=250)
    a, b, c = Node("a", "a", 1), Node("b", "b", 1), Node("c", "c", 1)
    for n in (a, b, c):
        r.add(n, 100)
    assert list(r.resident) == [b, c] and r.evictions == 1
    r.touch(b)
    r.add(a, 100)
    assert list(r.resident) == [b, a]


def test_an_ancestor_stays_while_a_resident_descendant_needs_it():
    r = Residency(budget=300)
    root, mid, leaf = chain("root", "mid", "leaf")
    other = Node("other", "other", 1)
    for n in (root, mid, leaf):
        r.add(n, 100)
    r.add(other, 100)  # over budget: root is the oldest, but a resident descendant needs it
    assert list(r.resident) == [root, mid, other]  # the oldest node no one needs goes: leaf
    r.add(Node("y", "y", 1), 100)  # now mid is a leaf of the resident set and goes before root
    assert root in r.resident and mid not in r.resident


def test_touching_a_node_refreshes_its_ancestors():
    r = Residency(budget=1000)
    root, mid, leaf = chain("root", "mid", "leaf")
    x = Node("x", "x", 1)
    for n in (root, mid, leaf, x):
        r.add(n, 10)
    r.touch(leaf)
    assert list(r.resident)[-3:] == [root, mid, leaf]


class RunMemory:
    """The run's memory as the budget reads it, set by the test (the real reader is
    :func:`bunshin_gym.rollout.runmemory.run_bytes`, used by the tests below)."""

    def __init__(self, used: int):
        self.used = used

    def __call__(self) -> int:
        return self.used


def test_the_default_budget_is_a_share_of_the_runs_peak_memory(monkeypatch):
    monkeypatch.setattr("bunshin_gym.rollout.residency.AUTO_REFRESH_S", 0.0)
    run = RunMemory(10_000)
    r = Residency(fraction=0.02, run_memory=run)
    a, b, c = Node("a", "a", 1), Node("b", "b", 1), Node("c", "c", 1)
    r.add(a, 150)
    assert r.budget == 200 and list(r.resident) == [a]
    r.add(b, 150)  # 300 bytes over a 200-byte budget: the older goes to disk
    assert list(r.resident) == [b] and r.evictions == 1
    run.used = 20_000  # more rollouts run: the budget grows with the run
    r.add(c, 150)
    assert r.budget == 400 and list(r.resident) == [b, c]
    run.used = 1_000  # the groups closed: the budget keeps the run's peak, nothing spills
    r.touch(b)
    assert r.budget == 400 and list(r.resident) == [c, b]


def test_a_fixed_budget_ignores_the_run_and_bad_budgets_are_refused():
    r = Residency(300, run_memory=RunMemory(10**12))
    r.add(Node("a", "a", 1), 200)
    assert r.budget == 300
    with pytest.raises(ValueError, match="budget"):
        Residency(-1)
    with pytest.raises(ValueError, match="fraction"):
        Residency(fraction=2.0)


def _resident_bytes(snap_id: str) -> int:
    """Page-cache bytes of a snapshot's CRIU images, as util-linux's fincore reads them (mincore)."""
    from bunshin_gym.workspace.snapshot import SnapshotStore

    files = [str(f) for f in SnapshotStore().get(snap_id).criu_dir.iterdir() if f.is_file() and not f.is_symlink()]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def test_the_prefix_cache_keeps_its_share_of_the_runs_memory_and_spills_the_rest(tmp_path):
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1, overlap=False)  # the default budget
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        for i in range(3):
            env.step(f"sleep 1; echo {i} >> /home/user/calls.txt")  # replaying a call costs 1 s
        mine = run_bytes()
        r = cache.residency
        assert 0 < r.run_peak and r.budget == int(AUTO_FRACTION * r.run_peak)
        assert mine > 0 and r.run_peak <= 2 * mine  # the run is this process's workspaces, not the host
        assert cache.stats.snapshots == 3 and r.resident_bytes <= r.budget and r.evictions >= 1
        spilled = [n for n in r.sizes if not r.is_resident(n)]
        assert spilled
        for node in spilled:  # on disk only: dropped from the page cache
            assert _resident_bytes(node.snapshot) < 0.1 * r.sizes[node], node.snapshot
        # a spilled snapshot still serves: the live workspace follows the hits by cold restores,
        # or by replays where restoring one would copy more page images than the budget
        from bunshin_gym.rollout.residency import copy_bytes

        too_big = all(copy_bytes(n.snapshot) > r.budget for n in spilled)
        env.reset(options={"task": "shell/make-dir"})
        for i in range(3):
            assert env.step(f"sleep 1; echo {i} >> /home/user/calls.txt")[4]["cache"] == "hit"
        assert env.step("cat /home/user/calls.txt")[0]["output"] == "0\n1\n2\n"
        if too_big:
            assert cache.stats.restores_cold == 0 and cache.stats.restores_declined >= 1
        else:
            assert cache.stats.restores_cold >= 1
    finally:
        env.close()
        cache.clear()


def test_a_spilled_snapshots_tmpfs_copy_goes_unless_a_clone_maps_it():
    ws = Workspace.create("base")
    try:
        snap = ws.snapshot()
        try:
            uffd.prepare_images(snap.id, snap.criu_dir)  # as a share restore leaves it
            assert uffd.has_image_copy(snap.id)
            drop_snapshot(snap.id)
            assert not uffd.has_image_copy(snap.id)
            clone = snap.fork(1, mode="share")[0]
            try:
                assert uffd.has_image_copy(snap.id)
                drop_snapshot(snap.id)
                assert uffd.has_image_copy(snap.id)  # mapped by the clone: kept
                assert clone.exec("echo alive").text == "alive\n"
            finally:
                clone.close()
            assert not uffd.has_image_copy(snap.id)
        finally:
            snap.delete()
    finally:
        ws.close()


def test_a_hot_snapshots_tmpfs_copy_outlives_its_clones_and_goes_when_evicted():
    from bunshin_gym.rollout.residency import copy_bytes, keep_copy
    from bunshin_gym.rollout.runmemory import workspace_memory

    ws = Workspace.create("base")
    try:
        snap = ws.snapshot()
        try:
            assert copy_bytes(snap.id) >= snap.size() > 0  # cold: a restore would copy it all
            assert keep_copy(snap.id, make=True) and uffd.has_image_copy(snap.id)
            assert copy_bytes(snap.id) == 0
            clone = snap.fork(1, mode="share")[0]
            clone.close()  # the clone's reclaim releases the copies no clone maps: not a kept one
            assert uffd.has_image_copy(snap.id)
            assert uffd.release_images() == [] or snap.id not in uffd.release_images()  # nor `bunshin gc`
            assert uffd.has_image_copy(snap.id)
            # the run's memory counts it (kept by this process, mapped by no workspace of it)
            assert workspace_memory()["page_images"] >= snap.size() // 2
            drop_snapshot(snap.id)  # evicted: no longer kept, and no clone maps it
            assert not uffd.has_image_copy(snap.id)
            assert workspace_memory()["page_images"] == 0
        finally:
            snap.delete()
    finally:
        ws.close()


def test_a_copy_kept_by_a_process_that_is_gone_is_released():
    ws = Workspace.create("base")
    try:
        snap = ws.snapshot()
        try:
            uffd.prepare_images(snap.id, snap.criu_dir)
            # a keeper that exited (a crashed run): its mark no longer keeps the copy
            dead = subprocess.Popen(["true"])
            dead.wait()
            (uffd.images_root() / snap.id / uffd.KEEP_MARK).write_text(f"{dead.pid} 1")
            assert uffd.keeper(uffd.images_root() / snap.id) is None
            uffd.release_images(snap_id=snap.id)
            assert not uffd.has_image_copy(snap.id)
        finally:
            snap.delete()
    finally:
        ws.close()
