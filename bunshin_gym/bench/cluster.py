"""``bunshin bench cluster``: the rollout benchmark's epochs on 1, 2, 3 simulated hosts.

The recorded trajectories of ``bunshin bench rollout`` (groups of G members per task and epoch,
sharing prefixes within and across epochs) are replayed on a :class:`BunshinCluster` of
simulated hosts on this machine (a local Ray; each host its own pool subvolume, run directory,
cgroup root and prefix cache), with prefix-aware placement against random placement. Reported
per host count, placement and epoch: wall time, the share of tool calls served (prefix cache
and speculation) instead of executed, migrations, and per host the groups and calls it ran and
the peak memory of its workspaces' cgroups.

On one machine the hosts share the CPUs, so the wall time of more hosts is not a speed-up; the
work done per host and the routing figures (hit rate, executed calls, migrations) are the result.
"""

from __future__ import annotations

import logging
import time

from bunshin_gym.bench.report import table, write
from bunshin_gym.bench.rollout import TASKS, make_trajectories
from bunshin_gym.cluster import BunshinCluster, GroupSpec, ReplayPolicy, nodes, start_local_ray

log = logging.getLogger(__name__)


def run_config(hosts: int, placement: str, trajectories: list[dict], epochs: int, group: int, *, capacity: int,
               threshold: int, think_scale: float, seed: int) -> dict:
    import ray

    names = [f"b{i}" for i in range(hosts)]
    out: dict = {"hosts": hosts, "placement": placement, "epochs": []}
    with BunshinCluster(names, placement=placement, capacity=capacity, threshold=threshold, fresh=True,
                        seed=seed) as cluster:
        for epoch in range(epochs):
            recs = [r for r in trajectories if r["epoch"] == epoch]
            specs = [GroupSpec(r["task"], ReplayPolicy.from_members(r["members"], think_scale), group,
                               id=f"{epoch}-{r['task']}") for r in recs]
            ray.get([cluster.hosts[h].reset_peak.remote() for h in cluster.alive])
            migrations_before = len(cluster.migrations)
            t0 = time.perf_counter()
            results = cluster.run_batch(specs)
            wall = time.perf_counter() - t0
            peaks = dict(zip(cluster.alive, ray.get([cluster.hosts[h].reset_peak.remote() for h in cluster.alive]),
                             strict=True))
            per_host = {h: {"groups": 0, "calls": 0, "executed": 0, "peak_memory_mb": round(peaks.get(h, 0) / 2**20, 1)}
                        for h in names}
            served = {"cache": 0, "speculation": 0, "executed": 0}
            reasons: dict[str, int] = {}
            for r in results:
                if r.decision is not None:
                    reasons[r.decision.reason] = reasons.get(r.decision.reason, 0) + 1
                if r.host is None:
                    continue
                per_host[r.host]["groups"] += 1
                for member in r.kinds:
                    for kind in member:
                        served[kind] += 1
                        per_host[r.host]["calls"] += 1
                        per_host[r.host]["executed"] += kind == "executed"
            total = sum(served.values())
            migs = cluster.migrations[migrations_before:]
            out["epochs"].append({
                "epoch": epoch + 1, "wall_s": round(wall, 2), "served": served,
                "hit_rate": round((served["cache"] + served["speculation"]) / total, 3) if total else 0.0,
                "migrations": len(migs), "migration_s": round(sum(m.seconds for m in migs), 2),
                "migration_bytes": sum(m.bytes for m in migs),
                "migration_errors": [m.error for m in migs if m.error], "placements": reasons,
                "errors": [r.error for r in results if r.error] + [e for r in results for e in r.errors if e],
                "rewards": [x for r in results for x in r.rewards], "per_host": per_host,
            })
            e = out["epochs"][-1]
            log.info("%d hosts, %s placement, epoch %d: %.1f s, hit rate %.1f%%, %d executed, %d migrations",
                     hosts, placement, epoch + 1, wall, e["hit_rate"] * 100, served["executed"], len(migs))
    for name in names:  # shut down and reclaimed: the simulated hosts' mounts and cgroup roots go too
        nodes.remove(name)
    return out


def run(json_path: str | None = None, *, nodes: tuple[int, ...] = (1, 2, 3), placements: tuple[str, ...] = (
        "prefix", "random"), epochs: int = 2, group: int = 2, tasks: list[str] | None = None, seed: int = 7,
        think_scale: float = 0.3, capacity: int = 2, threshold: int = 1) -> dict:
    """Run every (host count, placement) on one local Ray; with one host both placements are
    the same, so only prefix runs there."""
    import ray

    tasks = tasks or TASKS
    trajectories = make_trajectories(seed, epochs, group, tasks)
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=1, object_store_mb=100)
    configs = []
    try:
        for n in nodes:
            for placement in placements if n > 1 else placements[:1]:
                configs.append(run_config(n, placement, trajectories, epochs, group, capacity=capacity,
                                          threshold=threshold, think_scale=think_scale, seed=seed))
    finally:
        if started:
            ray.shutdown()
    results = {"tasks": tasks, "group": group, "epochs": epochs, "seed": seed, "think_scale": think_scale,
               "capacity": capacity, "threshold": threshold, "configs": configs, "trajectories": trajectories}
    print(summary_table(results))
    return write("cluster", results, json_path)


def summary_table(results: dict) -> str:
    rows = []
    for cfg in results["configs"]:
        for e in cfg["epochs"]:
            hosts = sorted(e["per_host"])
            rows.append([cfg["hosts"], cfg["placement"], e["epoch"], e["wall_s"], f"{e['hit_rate'] * 100:.0f}%",
                         e["served"]["executed"], e["migrations"],
                         "/".join(str(e["per_host"][h]["groups"]) for h in hosts),
                         "/".join(str(e["per_host"][h]["executed"]) for h in hosts),
                         "/".join(str(e["per_host"][h]["peak_memory_mb"]) for h in hosts), len(e["errors"])])
    return table(rows, ["hosts", "placement", "epoch", "wall s", "served", "executed", "migrations",
                        "groups/host", "executed/host", "peak MB/host", "errors"])
