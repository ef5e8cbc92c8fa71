"""The cluster on a real multi-node Ray cluster on this one machine: ``ray.cluster_utils.Cluster``
(Ray's own test tool: a head and two more nodes, each its own raylet and object store), each
host actor pinned to its own Ray node with its own pool, run directory and cgroup root.
Groups go to the node holding their prefix, a snapshot chain migrates between nodes (through
Ray's object stores), and a node removed mid-batch loses only its own groups.

Slow: three raylets start in ~25 s on an idle 2-core machine, the batches take minutes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from bunshin_gym.cluster import BunshinCluster, GroupSpec, ReplayPolicy, nodes
from bunshin_gym.envs.shell.env import load_shell_task

from .conftest import leftovers

pytestmark = pytest.mark.slow

TASK_A, TASK_B, TASK_C = "shell/count-files", "shell/grep-errors", "shell/sum-numbers"
HOSTS = ["mn0", "mn1", "mn2"]
CLEAN = {"records": [], "workspaces": [], "snapshots": [], "cgroups": []}


def replay(task: str, *probes: str, members: int = 2, think: float = 0.0) -> ReplayPolicy:
    acts = (*probes, *load_shell_task(task).oracle())
    return ReplayPolicy((acts,) * members, ((think,) * len(acts),) * members if think else ())


@pytest.fixture(scope="module")
def ray_nodes():
    """Three Ray nodes on this machine; the driver connected to them. Yields the Cluster and
    its nodes, head first."""
    from ray.cluster_utils import Cluster

    # the raylets read it: their agents (Python processes) may take long to start under load
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    args = {"num_cpus": 1, "object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    try:
        more = [cluster.add_node(**args) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster, [cluster.head_node, *more]
    finally:
        ray.shutdown()
        cluster.shutdown()
        for name in HOSTS:
            nodes.remove(name)


def test_placement_by_prefix_and_a_migration_between_ray_nodes(ray_nodes):
    _, ray_node_list = ray_nodes
    pinned = {h: n.node_id for h, n in zip(HOSTS, ray_node_list, strict=True)}
    probes = ("sleep 0.3; ls /data", "sleep 0.3; pwd")
    with BunshinCluster(pinned, threshold=1, capacity=2, fresh=True) as c:
        # each host on its own Ray node (its own raylet), with its own pool
        assert {h: i["node_id"] for h, i in c.info.items()} == pinned and len(set(pinned.values())) == 3
        assert {i["pool"] for i in c.info.values()} == {str(nodes.layout(h).pool) for h in HOSTS}
        [first] = c.run_batch([GroupSpec(TASK_A, replay(TASK_A, *probes), 2)])
        assert first.error is None and first.rewards == [1.0, 1.0], first
        holder = first.host
        assert {e.host for e in c.index.entries()} == {holder}
        a, b = c.run_batch([GroupSpec(TASK_A, replay(TASK_A, *probes), 2),
                            GroupSpec(TASK_B, replay(TASK_B, *probes), 2)])
        assert (a.host, a.decision.reason) == (holder, "prefix")
        assert all(k == "cache" for member in a.kinds for k in member), a.kinds
        assert b.host != holder and b.decision.reason == "least-loaded" and b.rewards == [1.0, 1.0]
        # the holder at its threshold: the second group goes to another node, the snapshot chain with it
        diverging = replay(TASK_A, *probes, "echo diverged > /tmp/d")
        x, y = c.run_batch([GroupSpec(TASK_A, diverging, 2), GroupSpec(TASK_A, diverging, 2)])
        assert (x.host, x.decision.reason) == (holder, "prefix")
        assert y.host != holder and (y.decision.reason, y.decision.migrate_from) == ("overloaded-holder", holder)
        assert x.rewards == y.rewards == [1.0, 1.0]
        [mig] = c.migrations
        assert mig.error is None and (mig.source, mig.target) == (holder, y.host) and mig.parts >= 2
        assert pinned[mig.source] != pinned[mig.target]  # between two raylets
        stats = c.stats()
        assert mig.snapshot in stats[y.host]["snapshots"] and stats[y.host]["cache"]["restores"] >= 1
        assert all(m[:2] == ["cache", "cache"] for m in y.kinds)  # served from the migrated prefix
        assert sorted(c.index.holders(mig.snapshot)) == sorted([holder, y.host])
    for name in HOSTS:
        assert leftovers(name) == CLEAN, name


def test_a_ray_node_removed_mid_batch_loses_only_its_groups(ray_nodes):
    """Last in the module: it removes a node."""
    ray_cluster, ray_node_list = ray_nodes
    by_host = dict(zip(HOSTS, ray_node_list, strict=True))
    probes = ("ls /data", "pwd", "df -h /")
    specs = [GroupSpec(TASK_A, replay(TASK_A, *probes, think=1.0), 2, id="g0"),
             GroupSpec(TASK_B, replay(TASK_B, *probes, think=1.0), 2, id="g1"),
             GroupSpec(TASK_C, replay(TASK_C, *probes, think=1.0), 2, id="g2"),
             GroupSpec(TASK_A, replay(TASK_A, *probes), 2, id="g3")]
    with BunshinCluster({h: n.node_id for h, n in by_host.items()}, threshold=1, capacity=1, fresh=True) as c:
        victim: dict[str, object] = {}
        threads = []

        def remove_when_under_way(host: str) -> None:
            """Remove the host's Ray node while its group runs: once the host holds a workspace
            of it (its root or a member). Not "once both members are forked": a member whose
            calls the cache serves (the other member ran them first) stays lazy, so the group
            may never hold two workspaces at once."""
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                victim["workspaces"] = ray.get(c.hosts[host].info.remote())["workspaces"]
                if victim["workspaces"]:
                    ray_cluster.remove_node(by_host[host])
                    victim["removed"] = True
                    return
                time.sleep(0.1)

        def on_dispatch(spec, decision):
            # the first group on a node other than the head's (the driver's) is the one to lose
            if "host" not in victim and by_host[decision.host] is not ray_cluster.head_node:
                victim["host"], victim["group"] = decision.host, spec.id
                threads.append(threading.Thread(target=remove_when_under_way, args=(decision.host,)))
                threads[-1].start()

        results = {r.spec.id: r for r in c.run_batch(specs, on_dispatch=on_dispatch)}
        for t in threads:
            t.join()
        dead, lost = victim["host"], victim["group"]
        assert victim.get("removed"), f"host {dead} never held a workspace of group {lost}: {results[lost]}"
        assert results[lost].error and results[lost].error.startswith(f"host {dead} died"), results[lost]
        for gid in {"g0", "g1", "g2", "g3"} - {lost}:
            r = results[gid]
            assert r.error is None and r.host != dead and r.rewards == [1.0, 1.0], r
        assert list(c.dead) == [dead] and c.index.entries(dead) == []
        assert by_host[dead].node_id not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        later = c.run_batch([GroupSpec(TASK_B, replay(TASK_B, *probes), 2)])  # the batch goes on
        assert later[0].error is None and later[0].host != dead
        report = c.shutdown()
        # a task pinned to the removed node cannot run: its reclaim is reported, not hidden
        assert "error" in report[dead], report[dead]
    # on a real cluster the node's machine takes its workspaces along; here they outlive its
    # raylet, and are reclaimed under the host's paths (as its next fresh host would)
    got = nodes.reclaim_host(dead)
    assert set(victim["workspaces"]) <= set(got["workspaces"]), (victim, got)
    for name in HOSTS:
        assert leftovers(name) == CLEAN, name
