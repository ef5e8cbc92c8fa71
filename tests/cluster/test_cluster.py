"""The cluster on Ray with simulated hosts on this machine (each its own pool subvolume, run
directory and cgroup root): groups placed where their prefix is cached, a snapshot chain
migrated to a host that then restores from it, a host killed mid-batch."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import ray

from bunshin_gym.cluster import BunshinCluster, GroupSpec, ReplayPolicy, nodes
from bunshin_gym.envs.shell.env import load_shell_task

from .conftest import leftovers

TASK_A, TASK_B, TASK_C = "shell/count-files", "shell/grep-errors", "shell/sum-numbers"
HOSTS = ["ct0", "ct1", "ct2"]


def solve(task: str, *probes: str) -> tuple[str, ...]:
    """Probing calls (slow enough that replaying them costs more than a restore), then the
    task's oracle."""
    return (*probes, *load_shell_task(task).oracle())


def replay(task: str, *probes: str, members: int = 2, think: float = 0.0) -> ReplayPolicy:
    acts = solve(task, *probes)
    return ReplayPolicy((acts,) * members, ((think,) * len(acts),) * members if think else ())


@pytest.fixture(scope="module", autouse=True)
def _hosts_removed():
    """The simulated hosts' mounts, directories and cgroup roots go after the module."""
    yield
    for name in HOSTS:
        nodes.remove(name)


def assert_clean(names):
    for name in names:
        assert leftovers(name) == {"records": [], "workspaces": [], "snapshots": [], "cgroups": []}, name


def test_a_group_goes_to_the_host_holding_its_prefix(ray_local):
    probes = ("sleep 0.3; ls /data", "sleep 0.3; pwd")
    pol_a, pol_b = replay(TASK_A, *probes), replay(TASK_B, *probes)
    with BunshinCluster(HOSTS, threshold=2, capacity=2, fresh=True) as c:
        assert {i["node_id"] for i in c.info.values()} == {ray_local}  # pinned to this machine's node
        assert {i["pool"] for i in c.info.values()} == {str(nodes.layout(h).pool) for h in HOSTS}
        [first] = c.run_batch([GroupSpec(TASK_A, pol_a, 2)])
        assert first.error is None and first.rewards == [1.0, 1.0], first
        holder = first.host
        held = c.index.entries()
        assert held and {e.host for e in held} == {holder} and any(e.snapshot for e in held)
        a, b = c.run_batch([GroupSpec(TASK_A, pol_a, 2), GroupSpec(TASK_B, pol_b, 2)])
        assert (a.host, a.decision.reason) == (holder, "prefix")
        assert all(k == "cache" for member in a.kinds for k in member), a.kinds  # nothing executed again
        assert b.host != holder and b.decision.reason == "least-loaded"
        assert b.rewards == [1.0, 1.0] and "executed" in b.kinds[0]
        work = {h: s["work"] for h, s in c.stats().items()}
        assert work[holder]["groups"] == 2 and work[b.host]["groups"] == 1
        assert c.migrations == []
    assert_clean(HOSTS)


def test_a_full_holder_migrates_its_snapshot_chain_and_the_target_restores_from_it(ray_local):
    probes = ("sleep 0.3; ls /data", "sleep 0.3; pwd")
    hosts = HOSTS[:2]
    with BunshinCluster(hosts, threshold=1, capacity=2, fresh=True) as c:
        [first] = c.run_batch([GroupSpec(TASK_A, replay(TASK_A, *probes), 2)])
        holder = first.host
        other = next(h for h in hosts if h != holder)
        # the same prefix, then a call never made: served up to the snapshot, restored from it
        diverging = replay(TASK_A, *probes, "echo diverged > /tmp/d")
        a, b = c.run_batch([GroupSpec(TASK_A, diverging, 2), GroupSpec(TASK_A, diverging, 2)])
        assert (a.host, a.decision.reason) == (holder, "prefix")
        assert (b.host, b.decision.reason, b.decision.migrate_from) == (other, "overloaded-holder", holder)
        assert a.rewards == b.rewards == [1.0, 1.0] and b.errors == [None, None]
        [mig] = c.migrations
        assert mig.error is None and (mig.source, mig.target) == (holder, other)
        assert mig.parts >= 2  # the snapshot and the parent it was forked from (the delta chain)
        assert c.index.holders(mig.snapshot) == sorted(hosts)
        stats = c.stats()
        assert stats[other]["work"]["imported"] == mig.parts and stats[holder]["work"]["exported"] == mig.parts
        assert mig.snapshot in stats[other]["snapshots"]
        # the target ran the diverging call from the migrated snapshot: restored, not replayed from the start
        assert stats[other]["cache"]["restores"] >= 1
        assert all(m[:2] == ["cache", "cache"] for m in b.kinds)
        assert "executed" in {m[2] for m in b.kinds}  # one member runs the new call, the other waits for it
        snap_dir = nodes.layout(other).pool / "snapshots" / mig.snapshot
        shown = subprocess.run(["btrfs", "subvolume", "show", str(snap_dir / "fs")], capture_output=True,
                               text=True, check=True).stdout
        received = next(line.split(":", 1)[1].strip() for line in shown.splitlines() if "Received UUID" in line)
        assert received != "-"  # a btrfs receive made it, not a copy of the holder's path
        meta = json.loads((snap_dir / "meta.json").read_text())
        assert meta["migrated_from"] == holder and meta["image_path"].startswith(str(nodes.layout(other).pool))
        # kept by the target's prefix cache, which names it now (the holder's directory is not
        # the target's: there `bunshin gc` would take it for a deleted cache's)
        assert meta["kept_by"].endswith(f"/cluster/{other}/prefix-cache") and Path(meta["kept_by"]).is_dir()
        # a delta: its CRIU images take the pages it did not write from its parent's, which came along
        parent_criu = snap_dir.parent / meta["parent"] / "criu"
        assert (snap_dir / "criu" / "parent").resolve() == parent_criu.resolve() and parent_criu.is_dir()
    assert_clean(hosts)


def test_a_host_killed_mid_batch_loses_only_its_own_groups(ray_local):
    probes = ("ls /data", "pwd", "df -h /")
    specs = [GroupSpec(TASK_A, replay(TASK_A, *probes, think=1.0), 2, id="g0"),
             GroupSpec(TASK_B, replay(TASK_B, *probes, think=1.0), 2, id="g1"),
             GroupSpec(TASK_C, replay(TASK_C, *probes, think=1.0), 2, id="g2"),
             GroupSpec(TASK_A, replay(TASK_A, *probes), 2, id="g3")]
    with BunshinCluster(HOSTS, threshold=1, capacity=1, fresh=True) as c:
        victim: dict[str, object] = {}

        def kill_when_forked(host: str) -> None:
            """Kill the host once its group's members run, one forked (so mid-rollout: they think
            1 s a step): a call made since the group was dispatched, and a workspace there (the
            root's is closed once the members are forked; a lazy member forks at its first miss)."""
            deadline, calls = time.monotonic() + 180, None
            while time.monotonic() < deadline:
                info = ray.get(c.hosts[host].info.remote())
                made = info["cache"]["hits"] + info["cache"]["misses"]
                calls = made if calls is None else calls
                victim["workspaces"] = info["workspaces"]
                if made > calls and victim["workspaces"]:
                    c.kill_host(host)
                    return
                time.sleep(0.3)

        threads = []

        def on_dispatch(spec, decision):
            if spec.id == "g1":
                victim["host"] = decision.host
                threads.append(threading.Thread(target=kill_when_forked, args=(decision.host,)))
                threads[-1].start()

        results = {r.spec.id: r for r in c.run_batch(specs, on_dispatch=on_dispatch)}
        for t in threads:
            t.join()
        dead = victim["host"]
        assert results["g1"].error and results["g1"].error.startswith(f"host {dead} died"), results["g1"]
        for gid in ("g0", "g2", "g3"):
            r = results[gid]
            assert r.error is None and r.host != dead and r.rewards == [1.0, 1.0], r
        assert list(c.dead) == [dead] and c.index.entries(dead) == []
        assert sorted(c.alive) == sorted(h for h in HOSTS if h != dead)
        # the batch goes on: the next one runs on the hosts left
        later = c.run_batch([GroupSpec(TASK_B, replay(TASK_B, *probes), 2)])
        assert later[0].error is None and later[0].host != dead
        report = c.shutdown()
        # the dead host's workspaces (alive when it was killed), reclaimed by a task on its node
        assert set(victim["workspaces"]) <= set(report[dead]["workspaces"]), (victim, report[dead])
    assert_clean(HOSTS)


