"""``BunshinCluster``: host actors on Ray, a snapshot index, placement, migration, faults.

Example (one machine, three simulated hosts)::

    >>> from bunshin_gym.cluster import BunshinCluster, GroupSpec, start_local_ray
    >>> start_local_ray()
    >>> with BunshinCluster(3) as cluster:
    ...     results = cluster.run_batch([GroupSpec("shell/count-files", policy, group=2)])

On a Ray cluster (``ray start`` on every node, ``ray.init(address="auto")`` in the driver),
``BunshinCluster()`` starts one host per alive node, pinned there, with the node's own paths.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bunshin_gym.cluster import nodes
from bunshin_gym.cluster.host import HostActor, reclaim
from bunshin_gym.cluster.index import SnapshotIndex
from bunshin_gym.cluster.placement import Decision, Placer

log = logging.getLogger(__name__)


def start_local_ray(num_cpus: int = 1, object_store_mb: int = 100, tries: int = 3) -> None:
    """A small Ray instance on this machine for simulated hosts: no dashboard, a small object
    store; always a new one (``address="local"``: never a stale cluster's address).

    On a loaded machine Ray's node start can time out (its raylet waits a fixed 30 s for its
    agents, Python processes that take that long to import under load): it is tried again,
    ``tries`` times in all, with the agents' registration timeout raised."""
    import os

    import ray

    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")  # read by the raylet Ray starts
    for attempt in range(1, tries + 1):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     object_store_memory=object_store_mb << 20, log_to_driver=False, configure_logging=False)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node times out
            ray.shutdown()
            if attempt == tries:
                raise
            log.warning("starting Ray failed (try %d of %d): %s", attempt, tries, _first_line(e))


@dataclass
class GroupSpec:
    """One GRPO group of a batch: ``group`` members of ``task``, stepped by ``policy(member,
    observation, history)`` (it runs on the host: it must pickle). ``prefix``: signatures of
    calls the group is known to start with (a replayed or forced prefix), for placement."""

    task: str
    policy: Callable[[int, Any, list], Any]
    group: int = 2
    prefix: tuple[str, ...] = ()
    max_steps: int | None = None
    id: str = ""


@dataclass
class GroupResult:
    spec: GroupSpec
    host: str | None
    decision: Decision | None
    rewards: list[float] = field(default_factory=list)
    kinds: list[list[str]] = field(default_factory=list)  # per member: how each call was served
    errors: list[str | None] = field(default_factory=list)  # per member
    wall_s: float = 0.0
    error: str | None = None  # the whole group failed (its host died)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class Migration:
    snapshot: str
    source: str
    target: str
    seconds: float
    parts: int = 0
    bytes: int = 0
    error: str | None = None


class BunshinCluster:
    """Host actors and the batch scheduler over them.

    Args:
        hosts: simulated hosts: a count or their names (all on the driver's Ray node), or a
            mapping of names to the Ray node ids each is pinned to (one machine, several Ray
            nodes: ``ray.cluster_utils.Cluster``); None: one host per alive Ray node, with that
            node's own configuration.
        placement: ``prefix`` (cache-aware) or ``random``.
        threshold: groups a host runs before a prefix match gives way to load.
        capacity: groups a host runs at once.
        migrate: copy a snapshot to the chosen host when its holder is over the threshold.
        speculation: hosts run speculative tool execution too.
        snapshot_every: the hosts' prefix-cache snapshot interval.
        env_id: the env the groups run.
        seed: random placement's seed.
        fresh: hosts start empty (see :class:`HostActor`).
    """

    def __init__(self, hosts: int | Sequence[str] | Mapping[str, str] | None = None, *, placement: str = "prefix",
                 threshold: int = 2, capacity: int = 2, migrate: bool = True, speculation: bool = False,
                 snapshot_every: int = 2, env_id: str = "Bunshin-Shell-v0", seed: int = 0, fresh: bool = False):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: ray.init(...) first (one machine: start_local_ray())")
        self.placer = Placer(placement, threshold=threshold, capacity=capacity, migrate=migrate, seed=seed)
        self.index = SnapshotIndex()
        self.env_id = env_id
        self.migrations: list[Migration] = []
        self.dead: dict[str, str] = {}  # host -> why
        self._reclaimed: dict[str, Any] = {}
        if fresh and hosts is None:
            raise ValueError("fresh=True reclaims every workspace under a host's run directory: on a node's own "
                             "paths that is every workspace of the node, so it is for simulated hosts only")
        self.owned = hosts is not None  # simulated hosts: their paths are the cluster's alone
        if isinstance(hosts, int):
            if hosts < 1:
                raise ValueError(f"a cluster needs at least one host, got {hosts}")
            hosts = [f"n{i}" for i in range(hosts)]
        here = ray.get_runtime_context().get_node_id()
        if hosts is None:  # one host per Ray node, each with its node's defaults
            placed = {n["NodeID"][:8]: (n["NodeID"], {}) for n in ray.nodes() if n["Alive"]}
        elif isinstance(hosts, Mapping):  # simulated hosts, each pinned to the Ray node given
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            unknown = sorted(f"{h}: {n}" for h, n in hosts.items() if n not in alive)
            if unknown:
                raise ValueError(f"hosts pinned to no alive Ray node: {', '.join(unknown)}")
            placed = {name: (node_id, nodes.prepare(name).env()) for name, node_id in hosts.items()}
        else:
            placed = {name: (here, nodes.prepare(name).env()) for name in hosts}
        remote = ray.remote(HostActor)
        self.hosts: dict[str, Any] = {}
        self._placement: dict[str, tuple[str, dict]] = placed
        for name, (node_id, env) in placed.items():
            self.hosts[name] = remote.options(
                num_cpus=0, max_concurrency=capacity + 8, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                runtime_env={"env_vars": env} if env else None,
            ).remote(name, snapshot_every=snapshot_every, speculation=speculation, owned=self.owned, fresh=fresh)
        self.info = dict(zip(self.hosts, ray.get([h.info.remote() for h in self.hosts.values()]), strict=True))
        for name, info in self.info.items():
            log.info("host %s on node %s: pool %s", name, info["node_id"][:8], info["pool"])

    def __enter__(self) -> BunshinCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def alive(self) -> list[str]:
        return [h for h in self.hosts if h not in self.dead]

    # the batch -------------------------------------------------------------------------
    def run_batch(self, specs: Sequence[GroupSpec], *,
                  on_dispatch: Callable[[GroupSpec, Decision], None] | None = None) -> list[GroupResult]:
        """Run every group, each on one host (placement), as many at once as the hosts take.
        A host that dies loses only its own groups (their results carry ``error``); the
        other groups run on. Results are in the order of ``specs``."""
        import ray
        from ray.exceptions import RayActorError

        results: dict[int, GroupResult] = {}
        pending = deque(enumerate(specs))
        inflight: dict[Any, tuple[int, str, Decision]] = {}
        loads = {h: 0 for h in self.alive}
        while pending or inflight:
            while pending and loads:
                i, spec = pending[0]
                decision = self.placer.choose(spec.task, loads, self.index, spec.prefix)
                if decision is None:
                    break
                pending.popleft()
                if decision.migrate_from:
                    self._migrate(decision)
                ref = self.hosts[decision.host].run_group.remote(
                    spec.task, spec.policy, spec.group, env_id=self.env_id, max_steps=spec.max_steps)
                inflight[ref] = (i, decision.host, decision)
                loads[decision.host] += 1
                if on_dispatch:
                    on_dispatch(spec, decision)
            if not inflight:
                for i, spec in pending:  # no host left
                    results[i] = GroupResult(spec, None, None, error="no host alive")
                pending.clear()
                break
            done, _ = ray.wait(list(inflight), num_returns=1)
            for ref in done:
                i, host, decision = inflight.pop(ref)
                if host in loads:
                    loads[host] -= 1
                try:
                    out = ray.get(ref)
                except RayActorError as e:
                    self._host_died(host, e)
                    loads.pop(host, None)
                    results[i] = GroupResult(specs[i], host, decision, error=f"host {host} died: {_first_line(e)}")
                    continue
                except Exception as e:  # noqa: BLE001 - the group failed as a whole; the batch goes on
                    results[i] = GroupResult(specs[i], host, decision, error=f"group failed: {_first_line(e)}")
                    continue
                self.index.apply(host, out["events"])
                results[i] = GroupResult(specs[i], host, decision, out["rewards"], out["kinds"], out["errors"],
                                         out["wall_s"])
        return [results[i] for i in range(len(specs))]

    def _migrate(self, decision: Decision) -> None:
        """Copy ``decision.snapshot`` (and its chain) from its holder to the chosen host. A
        failed migration is recorded; the group runs anyway (it replays what it misses)."""
        import ray

        src, dst, snap = decision.migrate_from, decision.host, decision.snapshot
        t0 = time.perf_counter()
        mig = Migration(snap, src, dst, 0.0)
        try:
            have = ray.get(self.hosts[dst].info.remote())["snapshots"]  # chain parents are no index entries
            bundle = ray.get(self.hosts[src].export_snapshot.remote(snap, have))
            mig.parts = len(bundle["parts"])
            mig.bytes = sum(len(p["fs"]) + len(p["criu"]) for p in bundle["parts"])
            ray.get(self.hosts[dst].import_snapshot.remote(bundle))
            self.index.apply(dst, ray.get(self.hosts[dst].events.remote()))
        except Exception as e:  # noqa: BLE001 - placement goes on without the copy
            mig.error = _first_line(e)
            log.warning("migration of %s from %s to %s failed: %s", snap, src, dst, mig.error)
        mig.seconds = round(time.perf_counter() - t0, 3)
        self.migrations.append(mig)

    def migrate(self, snapshot: str, source: str, target: str) -> Migration:
        """Copy a snapshot (and the chain it needs) from ``source`` to ``target`` now."""
        self._migrate(Decision(target, "explicit", migrate_from=source, snapshot=snapshot))
        return self.migrations[-1]

    # one group at a time (gym.make_vec(..., cluster=...)) -------------------------------
    def loads(self) -> dict[str, int]:
        """Each live host's load (groups running or open there); a host found dead is
        dropped (:meth:`_host_died`)."""
        import ray
        from ray.exceptions import RayActorError

        refs = {h: self.hosts[h].load.remote() for h in self.alive}
        out = {}
        for host, ref in refs.items():
            try:
                out[host] = ray.get(ref)
            except RayActorError as e:
                self._host_died(host, e)
        return out

    def place(self, task: str, prefix: Sequence[str] = (), *, loads: Mapping[str, int] | None = None) -> Decision:
        """Where one group of ``task`` goes now (the batch's rule, :class:`Placer`), its
        snapshot migrated first when the decision says so. Past every host's capacity it
        goes to the least-loaded host anyway: a vector env is placed once, not queued."""
        loads = dict(self.loads() if loads is None else loads)
        if not loads:
            raise RuntimeError(f"no host alive (dead: {', '.join(f'{h}: {w}' for h, w in self.dead.items())})")
        decision = self.placer.choose(task, loads, self.index, prefix)
        if decision is None:
            decision = Decision(min(sorted(loads), key=lambda h: loads[h]), "least-loaded")
        if decision.migrate_from:
            self._migrate(decision)
        return decision

    def apply_events(self, host: str) -> None:
        """Bring the index up to date with what ``host`` cached since it last reported."""
        import ray

        self.index.apply(host, ray.get(self.hosts[host].events.remote()))

    # faults ----------------------------------------------------------------------------
    def kill_host(self, name: str, timeout: float = 60.0) -> None:
        """Kill a host's actor (fault injection): its groups fail, its snapshots leave the index.
        Returns once the actor is dead: ``ray.kill`` only asks, and a call made right after it
        could still be served (CI saw a group's step answered by a host killed just before)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        actor = self.hosts[name]
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get(actor.load.remote(), timeout=10)
            except RayActorError:
                return
            except GetTimeoutError:
                continue
            time.sleep(0.05)
        raise RuntimeError(f"host {name} still answers {timeout} s after ray.kill")

    def _host_died(self, host: str, error: BaseException) -> None:
        if host in self.dead:
            return
        self.dead[host] = _first_line(error)
        dropped = self.index.drop_host(host)
        log.warning("host %s died (%s): %d index entries dropped; reclaiming its workspaces", host,
                    self.dead[host], dropped)
        self._reclaimed[host] = self._reclaim_task(host)

    def _reclaim_task(self, host: str) -> Any:
        """Reclaim a dead host's workspaces and snapshots on its node, under its paths."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id, env = self._placement[host]
        return ray.remote(reclaim).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": env} if env else None).remote(owned=self.owned)

    # state and end -----------------------------------------------------------------------
    def stats(self) -> dict[str, dict]:
        """Each live host's :meth:`HostActor.info`."""
        import ray

        alive = self.alive
        return dict(zip(alive, ray.get([self.hosts[h].info.remote() for h in alive]), strict=True))

    def shutdown(self) -> dict[str, Any]:
        """Shut every host down (workspaces closed, cache snapshots deleted, run directory
        reclaimed) and kill the actors; dead hosts are reclaimed by a task on their node."""
        import ray

        out: dict[str, Any] = {}
        for name in self.alive:
            try:
                out[name] = ray.get(self.hosts[name].shutdown.remote(), timeout=300)
            except Exception as e:  # noqa: BLE001 - died meanwhile: reclaimed below
                self._host_died(name, e)
        for name in self.hosts:
            ray.kill(self.hosts[name], no_restart=True)
        for name, ref in self._reclaimed.items():
            try:
                out[name] = ray.get(ref, timeout=300)
            except Exception as e:  # noqa: BLE001
                log.error("reclaiming dead host %s failed: %s", name, e)
                out[name] = {"error": str(e)}
        self.hosts = {}
        return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]
