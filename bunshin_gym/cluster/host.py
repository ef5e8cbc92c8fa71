"""``HostActor``: the one Ray actor of a host, owning its pool, CRIU and workspaces.

A host runs GRPO groups whole (:meth:`HostActor.run_group`: the group's root workspace and its
G forks live on this host, with the host's own prefix cache and speculation, unchanged from one
machine), reports what it caches to the cluster's snapshot index (:meth:`HostActor.events`:
``create`` and ``evict`` of snapshots and prefix-cache nodes), and moves snapshots to and from
other hosts (:meth:`export_snapshot`, :meth:`import_snapshot`: ``btrfs send`` of the file-system
delta plus a tar of the CRIU images, the snapshot's whole parent chain that the receiver lacks).

Workspaces are not actors: a workspace is a handle ``(host, id)`` (:class:`WorkspaceHandle`)
whose calls go through its host's actor (:meth:`create_workspace`, :meth:`exec`,
:meth:`close_workspace`).

The class is plain Python; :mod:`bunshin_gym.cluster.cluster` makes it a Ray actor pinned to
its node (``NodeAffinitySchedulingStrategy``) with the host's paths in its ``runtime_env``.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunshin_gym import config

log = logging.getLogger(__name__)

#: a delta snapshot's link to its parent's images (workspace/snapshots/delta.py's --prev-images-dir)
_PARENT_LINK = re.compile(r"\.\./\.\./snap-[0-9a-f]+/criu")


def extract_images(tar: tarfile.TarFile, dest: Path) -> None:
    """Unpack a bundle's ``criu/`` images under ``dest``. CRIU's image directory is flat: the
    directory, its files and, in a delta, the ``parent`` link to a sibling snapshot's images;
    any other member (a deeper path, an absolute or ``..`` name, another link, a device) is
    refused before anything is written. Python's own extraction filter (3.11.4 and later) is
    used as well where there is one; Debian 12's Python, 3.11.2, has none (passing one raised
    TypeError there and every migration failed)."""
    members = tar.getmembers()
    for m in members:
        parts = m.name.split("/")
        flat = parts[0] == "criu" and len(parts) <= 2 and all(p not in ("", ".", "..") for p in parts)
        ok = flat and (m.isdir() if len(parts) == 1 else
                       m.isfile() or (m.issym() and parts[1] == "parent" and _PARENT_LINK.fullmatch(m.linkname)))
        if not ok:
            raise ValueError(f"snapshot bundle: member {m.name!r} ({m.type!r}) is not a CRIU image; nothing unpacked")
    if hasattr(tarfile, "tar_filter"):
        tar.extractall(dest, members=members, filter="tar")
    else:
        tar.extractall(dest, members=members)


@dataclass(frozen=True)
class WorkspaceHandle:
    """A workspace on a host of the cluster: its calls go through that host's actor."""

    host: str
    id: str


@dataclass(frozen=True)
class IndexEntry:
    """One thing a host caches: a prefix-cache node (``snapshot`` None: its recorded result
    only) or a snapshot of one, for the task ``key`` (the prefix cache's key) after the calls
    ``prefix`` (their signatures)."""

    host: str
    key: str
    prefix: tuple[str, ...]
    snapshot: str | None

    @property
    def id(self) -> str:
        return self.snapshot or f"node:{self.key}:{'/'.join(self.prefix)}"

    @property
    def task(self) -> str:
        return self.key.split("|", 1)[0]

    @property
    def depth(self) -> int:
        return len(self.prefix)


class HostActor:
    """One host of the cluster (made a Ray actor by :class:`~bunshin_gym.cluster.cluster.BunshinCluster`).

    Args:
        name: the host's name (simulated hosts: their layout, :mod:`bunshin_gym.cluster.nodes`).
        cache_dir: where the host's prefix cache persists (default: ``$BUNSHIN_HOME/cluster/<name>/prefix-cache``).
        snapshot_every: the prefix cache's snapshot interval.
        speculation: run speculative tool execution, with a selector trained on the host's
            trajectory log before each group (as ``bunshin bench rollout``'s Full mode).
        sample_s: interval of the memory sampler (the host's workspaces' cgroups).
        owned: the host's paths are the cluster's alone (a simulated host): its end, and a
            dead actor's reclaim, remove every workspace and snapshot there. Otherwise (a node's
            own paths, shared with other users of the node) only this host's workspaces and cache
            snapshots go, and a dead actor's workspaces are those with no live owner.
        fresh: start empty: reclaim what an earlier actor of this host left (workspaces,
            snapshots) and forget its prefix cache and trajectory log. Every workspace under the
            host's run directory goes: on a real node, only for a host the cluster owns alone.
    """

    def __init__(self, name: str, *, cache_dir: str | None = None, snapshot_every: int = 2,
                 speculation: bool = False, sample_s: float = 0.2, owned: bool = False, fresh: bool = False):
        from bunshin_gym.rollout import PrefixCache, TrajectoryLog
        from bunshin_gym.workspace import pool

        self.name = name
        self.p = pool.require_pool()  # this host's pool (a simulated host's own, from runtime_env)
        cache = Path(cache_dir) if cache_dir else self.p.home / "cluster" / name / "prefix-cache"
        cache.mkdir(parents=True, exist_ok=True)
        if fresh and not owned:
            raise ValueError(f"host {name}: fresh=True needs a host whose paths it owns (a simulated host)")
        self.owned = owned
        if fresh:
            reclaim(self.p, owned=True)
            for name_ in ("tree.pkl", "log.jsonl"):
                (cache / name_).unlink(missing_ok=True)
        self.trajlog = TrajectoryLog(cache / "log.jsonl")
        # restores by time alone: a migrated snapshot was sent here so that this host restores from it
        self.cache = PrefixCache(cache, snapshot_every=snapshot_every, log=self.trajlog, bound_restores=False)
        self.speculation = speculation
        self._lock = threading.Lock()
        self._load = 0  # groups running here
        self._reported: dict[str, IndexEntry] = {}  # what the index was told
        self._workspaces: dict[str, Any] = {}
        self._groups: dict[str, Any] = {}  # open vector groups (gym.make_vec(..., cluster=...)), by id
        self._work = {"groups": 0, "calls": 0, "executed": 0, "cache": 0, "speculation": 0,
                      "imported": 0, "exported": 0}
        self._peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, args=(sample_s,), daemon=True,
                                         name=f"bunshin-host-{name}-memory")
        self._sampler.start()
        log.info("host %s: pool %s, run %s, pid %d", name, self.p.pool, self.p.run, os.getpid())

    # state -----------------------------------------------------------------------------
    def info(self) -> dict:
        """Who and where this host is, and what it holds and did."""
        import ray

        from bunshin_gym.workspace import records
        from bunshin_gym.workspace.snapshot import SnapshotStore

        with self._lock:
            load, work = self._load, dict(self._work)
        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "pool": str(self.p.pool), "run": str(self.p.run), "load": load, "work": work,
                "workspaces": sorted(records.all_ids(self.p)),
                "snapshots": sorted(s.id for s in SnapshotStore(self.p).list()),
                "memory_bytes": self._memory(), "peak_memory_bytes": self._peak,
                "cache": self.cache.stats.as_dict()}

    def load(self) -> int:
        """Groups running (:meth:`run_group`) or open (:meth:`open_group`) here."""
        with self._lock:
            return self._load + len(self._groups)

    def reset_peak(self) -> int:
        """Start a new peak-memory window; returns the last one's peak (bytes)."""
        peak, self._peak = self._peak, self._memory()
        return peak

    def events(self) -> list[tuple[str, Any]]:
        """What changed in this host's cache since the last call: ``("create", IndexEntry)``
        and ``("evict", entry id)`` (the snapshot index applies them)."""
        now = {e.id: e for e in self._entries()}
        with self._lock:
            out: list[tuple[str, Any]] = [("evict", k) for k in self._reported if k not in now]
            out += [("create", e) for k, e in now.items() if k not in self._reported]
            self._reported = now
        return out

    def _entries(self) -> list[IndexEntry]:
        from bunshin_gym.workspace.snapshot import SnapshotStore

        have = {s.id for s in SnapshotStore(self.p).list()}
        out = []
        with self.cache.tree.lock:
            for key, root in self.cache.tree.roots.items():
                stack = [(root, ())]
                while stack:
                    node, prefix = stack.pop()
                    if node.depth and node.result and not node.nondeterministic:
                        snap = node.snapshot if node.snapshot in have else None
                        out.append(IndexEntry(self.name, key, prefix, snap))
                    stack.extend((c, (*prefix, c.sig)) for c in node.children.values() if not c.nondeterministic)
        return out

    # groups ----------------------------------------------------------------------------
    def run_group(self, task: str, policy: Callable[[int, Any, list], Any], group: int, *,
                  env_id: str = "Bunshin-Shell-v0", cache: bool = True, max_steps: int | None = None,
                  after: Any = None, env_kwargs: dict | None = None) -> dict:
        """Run one GRPO group here: ``group`` forks of the task's workspace, each stepped by
        ``policy(member, observation, history)`` (:meth:`GroupVectorEnv.run_group`).

        ``after`` is ignored: pass the result of another call (an import) to run after it.
        Returns the members' rewards, how each call was served, wall time, member errors and
        the host's index events."""
        import gymnasium as gym

        import bunshin_gym  # noqa: F401 - registers the envs
        del after
        with self._lock:
            self._load += 1
        t0 = time.perf_counter()
        kinds: list[list[str]] = [[] for _ in range(group)]
        try:
            spec = self._speculation() if self.speculation else None

            def on_step(i: int, step: Any) -> None:
                info = step.info
                kinds[i].append("cache" if info.get("cache") == "hit" else
                                "speculation" if info.get("speculation") == "hit" else "executed")

            envs = gym.make_vec(env_id, num_envs=group, vectorization_mode="vector_entry_point",
                                cache=self.cache if cache else None, speculation=spec, **(env_kwargs or {}))
            try:
                trajs = envs.run_group(policy, options={"task": task}, max_steps=max_steps, on_step=on_step)
            finally:
                envs.close()
            if cache:
                self.cache.save()
        finally:
            with self._lock:
                self._load -= 1
        with self._lock:
            self._work["groups"] += 1
            for k in kinds:
                self._work["calls"] += len(k)
                for kind in k:
                    self._work[kind] += 1
        return {"host": self.name, "task": task, "rewards": [t.reward for t in trajs], "kinds": kinds,
                "errors": [t.error for t in trajs], "wall_s": round(time.perf_counter() - t0, 3),
                "events": self.events()}

    # one group driven call by call (gym.make_vec(..., cluster=...)) --------------------------
    def _speculation(self) -> Any:
        """Speculation with a selector trained on this host's trajectory log so far (None while
        the log is empty: there is nothing to predict from)."""
        from bunshin_gym.rollout import SpecToolSelector, Speculation, TrajectoryLog

        entries = TrajectoryLog.load(self.trajlog.path)
        if not entries:
            return None
        return Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                           min_duration=0.5)

    def open_group(self, env_id: str, num_envs: int, *, prefix_cache: bool = False, speculation: bool = False,
                   env_kwargs: dict | None = None) -> dict:
        """Open a :class:`~bunshin_gym.rollout.group.GroupVectorEnv` here (its workspaces are
        made at its first reset); ``prefix_cache``: its members are served by this host's
        prefix cache; ``speculation``: speculative tool execution with a selector trained on
        this host's trajectory log. Returns its id and the single env's spaces."""
        import uuid

        import gymnasium as gym

        import bunshin_gym  # noqa: F401 - registers the envs

        envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point",
                            cache=self.cache if prefix_cache else None,
                            speculation=self._speculation() if speculation else None, **(env_kwargs or {}))
        gid = f"{self.name}-grp-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._groups[gid] = envs
        return {"id": gid, "observation_space": envs.single_observation_space,
                "action_space": envs.single_action_space}

    def group_reset(self, gid: str, seed: int | list[int] | None = None, options: dict | None = None) -> tuple:
        return self._group(gid).reset(seed=seed, options=options)

    def group_step(self, gid: str, actions: list) -> tuple:
        envs = self._group(gid)
        out = envs.step(actions)
        return (*out, envs.active.copy())

    def group_run(self, gid: str, policy: Callable[[int, Any, list], Any], options: dict | None = None,
                  max_steps: int | None = None) -> dict:
        """:meth:`GroupVectorEnv.run_group` here; the trajectories come back with each
        member's exception only when it pickles (its text is in ``error`` anyway)."""
        import pickle

        envs = self._group(gid)
        trajs = envs.run_group(policy, options=options, max_steps=max_steps)
        for t in trajs:
            if t.exception is not None:
                try:
                    pickle.dumps(t.exception)
                except Exception:  # noqa: BLE001 - any exception may hold what does not pickle
                    t.exception = None
        with self._lock:
            self._work["groups"] += 1
        return {"trajectories": trajs, "active": envs.active.copy(), "task_id": envs.task_id}

    def close_group(self, gid: str) -> None:
        with self._lock:
            envs = self._groups.pop(gid, None)
        if envs is not None:
            envs.close()
            if envs.cache is not None:
                self.cache.save()

    def _group(self, gid: str) -> Any:
        with self._lock:
            envs = self._groups.get(gid)
        if envs is None:
            raise KeyError(f"no group {gid} on host {self.name} (closed, or never opened here)")
        return envs

    # workspaces as handles -------------------------------------------------------------
    def create_workspace(self, image: str = "base", **kwargs: Any) -> WorkspaceHandle:
        """A workspace on this host; its handle names the host and the workspace."""
        from bunshin_gym.workspace.workspace import Workspace

        ws = Workspace.create(image, **kwargs)  # under this host's paths (its runtime_env)
        with self._lock:
            self._workspaces[ws.id] = ws
        return WorkspaceHandle(self.name, ws.id)

    def exec(self, handle: WorkspaceHandle, command: str, **kwargs: Any) -> Any:
        return self._ws(handle).exec(command, **kwargs)

    def snapshot_workspace(self, handle: WorkspaceHandle) -> str:
        """Snapshot a workspace here (kept until :meth:`evict`); returns the snapshot id."""
        return self._ws(handle).snapshot().id

    def fork(self, snapshot: str, n: int = 1) -> list[WorkspaceHandle]:
        """``n`` workspaces here forked from a snapshot this host holds."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        clones = SnapshotStore(self.p).get(snapshot).fork(n)
        with self._lock:
            self._workspaces.update({ws.id: ws for ws in clones})
        return [WorkspaceHandle(self.name, ws.id) for ws in clones]

    def close_workspace(self, handle: WorkspaceHandle) -> None:
        with self._lock:
            ws = self._workspaces.pop(self._check(handle).id, None)
        if ws is not None:
            ws.close()

    def _check(self, handle: WorkspaceHandle) -> WorkspaceHandle:
        if handle.host != self.name:
            raise ValueError(f"workspace {handle.id} is on host {handle.host}, not on {self.name}")
        return handle

    def _ws(self, handle: WorkspaceHandle) -> Any:
        with self._lock:
            ws = self._workspaces.get(self._check(handle).id)
        if ws is None:
            raise KeyError(f"no workspace {handle.id} on host {self.name} (closed, or never made here)")
        return ws

    # snapshots moving between hosts ----------------------------------------------------
    def holds(self, snapshot: str) -> bool:
        return (self.p.snapshots / snapshot / "meta.json").exists()

    def chain(self, snapshot: str) -> list[str]:
        """The snapshot and its ancestors, root first."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        store, out, sid = SnapshotStore(self.p), [], snapshot
        while sid:
            out.append(sid)
            sid = store.get(sid).parent
        return out[::-1]

    def export_snapshot(self, snapshot: str, have: list[str] | tuple[str, ...] = ()) -> dict:
        """A bundle that :meth:`import_snapshot` on another host registers there: every
        snapshot of the chain the receiver lacks (``have``: what it holds), root first, each as
        a ``btrfs send`` stream of its files (incremental on its parent's when the receiver
        has or gets that parent) and a tar of its CRIU images and meta; and the prefix-cache
        subtree of the snapshot's task, so the receiver serves it."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        store = SnapshotStore(self.p)
        chain = self.chain(snapshot)
        sending = [s for s in chain if s not in set(have)]
        parts = []
        for sid in sending:
            snap = store.get(sid)
            parent_fs = store.get(snap.parent).fs if snap.parent else None
            argv = ["btrfs", "send", "-q", *(["-p", str(parent_fs)] if parent_fs else []), str(snap.fs)]
            proc = subprocess.run(argv, capture_output=True)
            if proc.returncode != 0:
                raise RuntimeError(f"host {self.name}: btrfs send of {sid} failed: {proc.stderr.decode().strip()}")
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(snap.criu_dir, arcname="criu")
            parts.append({"id": sid, "meta": snap.meta, "fs": proc.stdout, "criu": buf.getvalue(),
                          "incremental": parent_fs is not None})
        with self._lock:
            self._work["exported"] += len(parts)
        return {"from": self.name, "snapshot": snapshot, "parts": parts, "trees": self._trees_with(snapshot)}

    def _trees_with(self, snapshot: str) -> dict:
        """The prefix-cache subtrees (by key) that hold ``snapshot``."""
        with self.cache.tree.lock:
            return {key: copy.deepcopy(root) for key, root in self.cache.tree.roots.items()
                    if any(n.snapshot == snapshot for n in _walk(root))}

    def import_snapshot(self, bundle: dict) -> list[str]:
        """Register a bundle from :meth:`export_snapshot` here (the snapshots this host
        already holds are skipped); returns the ids now held. Merges the bundle's prefix-cache
        subtree into this host's cache, keeping only snapshots this host holds."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        t0 = time.perf_counter()
        got = []
        for part in bundle["parts"]:
            sid = part["id"]
            if self.holds(sid):
                continue
            dest = self.p.snapshots / sid
            dest.mkdir(parents=True)
            try:
                proc = subprocess.run(["btrfs", "receive", "-q", str(dest)], input=part["fs"], capture_output=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"host {self.name}: btrfs receive of {sid} failed: "
                                       f"{proc.stderr.decode().strip()}")
                with tarfile.open(fileobj=io.BytesIO(part["criu"])) as tar:
                    extract_images(tar, dest)
                meta = dict(part["meta"])
                # the image is the same on every host, under this host's pool
                meta["image_path"] = str(self.p.images / Path(meta["image_path"]).name)
                meta["migrated_from"] = bundle["from"]
                if meta.get("kept_by"):  # kept by the sender's prefix cache: here by this host's
                    meta["kept_by"] = str(self.cache.tree.dir.resolve())
                tmp = dest / "meta.json.tmp"
                tmp.write_text(json.dumps(meta, indent=1))
                os.replace(tmp, dest / "meta.json")  # last: a snapshot without it is incomplete
            except BaseException:
                from bunshin_gym.workspace.teardown import remove_snapshot_dir

                remove_snapshot_dir(dest)
                raise
            got.append(sid)
        held = {s.id for s in SnapshotStore(self.p).list()}
        for key, root in bundle.get("trees", {}).items():
            for node in _walk(root):
                if node.snapshot not in held:
                    node.snapshot, node.state = None, None
            with self.cache.tree.lock:
                mine = self.cache.tree.root(key)
                from bunshin_gym.rollout.prefix_cache import _merge

                _merge(mine, root)
            for node in _walk(self.cache.tree.roots[key]):
                if node.snapshot and node.snapshot in got:
                    self.cache.residency.add(node, SnapshotStore(self.p).get(node.snapshot).size())
        self.cache.save()
        with self._lock:
            self._work["imported"] += len(got)
        log.info("host %s: imported %s from %s in %.2f s", self.name, got, bundle["from"], time.perf_counter() - t0)
        return [s for s in (p["id"] for p in bundle["parts"]) if s in held]

    def evict(self, snapshot: str) -> bool:
        """Delete a cached snapshot here (its prefix-cache node keeps its result); False when
        it is in use."""
        from bunshin_gym.errors import SnapshotError
        from bunshin_gym.workspace.snapshot import SnapshotStore

        try:
            SnapshotStore(self.p).get(snapshot).delete()
        except SnapshotError:
            return False
        with self.cache.tree.lock:
            for node in self.cache.tree.nodes():
                if node.snapshot == snapshot:
                    node.snapshot, node.state = None, None
        self.cache.save()
        return True

    # end -------------------------------------------------------------------------------
    def shutdown(self) -> dict:
        """Close this host's workspaces, delete its cache's snapshots and reclaim the rest (of
        an owned host: everything under its paths; else what lost its owner)."""
        with self._lock:
            left, self._workspaces = list(self._workspaces.values()), {}
            groups = list(self._groups)
        for gid in groups:
            try:
                self.close_group(gid)
            except Exception:  # noqa: BLE001 - one failed close must not keep the others open
                log.exception("host %s: closing group %s failed", self.name, gid)
        for ws in left:
            try:
                ws.close()
            except Exception:  # noqa: BLE001 - one failed close must not keep the others open
                log.exception("host %s: closing workspace %s failed", self.name, ws.id)
        self.cache.clear()
        self._stop.set()
        return reclaim(self.p, owned=self.owned)

    # memory ----------------------------------------------------------------------------
    def _memory(self) -> int:
        """Bytes charged to this host's workspaces' memory cgroups."""
        from bunshin_gym.workspace import records
        from bunshin_gym.workspace.cgroups import Cgroup

        total = 0
        for rec in records.all_records(self.p):
            try:
                total += Cgroup(rec.cgroup).memory_usage()
            except (OSError, ValueError):
                continue  # closed meanwhile
        return total

    def _sample(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self._peak = max(self._peak, self._memory())
            except Exception:  # noqa: BLE001 - the sampler must outlive a bad read
                log.debug("host %s: memory sample failed", self.name, exc_info=True)


def _walk(root: Any) -> list:
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def reclaim(p: config.Paths | None = None, *, owned: bool = False) -> dict:
    """Reclaim a host whose actor is gone (or at its end). ``owned`` (a simulated host, whose
    paths nobody else uses): every workspace of its run directory and every snapshot of its
    pool (``bunshin gc --all`` there). Otherwise only what ``bunshin gc`` takes: workspaces
    whose owner (the dead actor) is gone; its cache's snapshots stay for the node's next host."""
    from bunshin_gym.workspace import gc
    from bunshin_gym.workspace.snapshot import SnapshotStore

    p = p or config.paths()
    rep = gc.collect(p, all_workspaces=owned)
    deleted = []
    for snap in sorted(SnapshotStore(p).list(), key=lambda s: -s.depth) if owned else []:  # children first
        try:
            snap.delete()
            deleted.append(snap.id)
        except Exception:  # noqa: BLE001 - one in use (a straggler) is left to the next gc
            log.warning("reclaim: snapshot %s not deleted", snap.id, exc_info=True)
    return {"workspaces": rep.workspaces, "snapshots": deleted}
