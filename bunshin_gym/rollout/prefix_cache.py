"""Tool-prefix caching: serve tool-call prefixes seen before from a tree of snapshots.

A :class:`PrefixTree` is keyed by (task, workspace image) and, below that, by the
sequence of normalised tool-call signatures. Each node holds the step result recorded
when that call was first executed and, every ``snapshot_every`` calls, a snapshot of the
workspace right after it.

:class:`PrefixCacheWrapper` (made by :meth:`PrefixCache.wrap`) walks the tree:

- **hit**: the call is a child of the current node: its recorded result is returned, nothing
  executes, and no writable fork is created (a lazy member stays without a workspace);
- **miss**: the workspace is brought to the current node (the deepest snapshot on the path
  is restored, or the live workspace is reused if it is on the path, then the calls in
  between are replayed), the call executes, and a node is recorded.

A hit is valid only for the same task (id and definition), the same image and the same
full prefix. Snapshots stay on disk in the snapshot store; hot ones are kept in memory
under a byte budget by an ancestor-aware LRU (:class:`Residency`). The tree persists in
``cache_dir`` across epochs and processes.

Example:
    >>> cache = PrefixCache("/var/lib/bunshin/prefix-cache/demo", snapshot_every=2)
    >>> env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    >>> env.reset(options={"task": "shell/count-files"})
    >>> env.step("ls /data")        # miss: executed and recorded
    >>> env.reset(options={"task": "shell/count-files"})
    >>> env.step("ls  /data")       # hit: same signature, served from the tree
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import pickle
import threading
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

from bunshin_gym.core.env import EnvSnapshot
from bunshin_gym.core.wrappers import BunshinWrapper
from bunshin_gym.rollout.residency import Residency
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.stats import Counted
from bunshin_gym.rollout.trajlog import TrajectoryLog
from bunshin_gym.workspace.errors import SnapshotError, WorkspaceError


@dataclass(eq=False)
class Node:
    sig: str
    action: Any
    depth: int
    result: bytes = b""  # zlib(pickle((obs, reward, terminated, truncated, info)))
    duration: float = 0.0  # seconds the tool took when executed
    snapshot: str | None = None  # snapshot id (store) of the workspace right after this call
    state: dict | None = None  # env episode state that goes with the snapshot
    children: dict[str, Node] = field(default_factory=dict)
    parent: Node | None = field(default=None, repr=False)
    hits: int = 0
    inflight: threading.Event | None = field(default=None, repr=False)  # set when the first run is done

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "inflight"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, inflight=None)

    def path(self) -> list[Node]:
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def load_result(self) -> tuple:
        return pickle.loads(zlib.decompress(self.result))


class PrefixTree:
    """Roots by cache key; persisted as one pickle file with a lock for concurrent processes."""

    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / "tree.pkl"
        self.roots: dict[str, Node] = {}
        self.lock = threading.RLock()
        self.load()

    def load(self) -> None:
        if self.file.exists():
            with open(self.file, "rb") as f:
                self.roots = pickle.load(f)

    def save(self) -> None:
        """Write the tree, merged with what other processes saved meanwhile."""
        with self.lock, open(self.dir / "tree.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.file.exists():
                with open(self.file, "rb") as f:
                    on_disk: dict[str, Node] = pickle.load(f)
                for key, root in on_disk.items():
                    if key in self.roots:
                        _merge(self.roots[key], root)
                    else:
                        self.roots[key] = root
            tmp = self.file.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                pickle.dump(self.roots, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.file)

    def root(self, key: str) -> Node:
        with self.lock:
            if key not in self.roots:
                self.roots[key] = Node(sig="", action=None, depth=0)
            return self.roots[key]

    def claim(self, parent: Node, sig: str, action: Any) -> tuple[Node, bool]:
        """The child for ``sig``, and whether the caller must execute it: the first caller of a
        new call claims it; concurrent callers (members of a group issuing the same call at the
        same time) wait for its result instead of running it again."""
        with self.lock:
            child = parent.children.get(sig)
            if child is not None and (child.result or child.inflight is not None):
                return child, False
            if child is None:
                child = Node(sig, copy.deepcopy(action), parent.depth + 1, parent=parent)
                parent.children[sig] = child
            child.inflight = threading.Event()
            return child, True

    def release(self, node: Node) -> None:
        """End a claim (its result recorded, or the run failed and waiters execute themselves)."""
        with self.lock:
            event, node.inflight = node.inflight, None
        if event is not None:
            event.set()

    def add(self, parent: Node, sig: str, action: Any, result: tuple, duration: float) -> Node:
        with self.lock:
            child = parent.children.get(sig)
            if child is None:
                child = Node(sig, copy.deepcopy(action), parent.depth + 1, parent=parent)
                parent.children[sig] = child
            child.result = zlib.compress(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            child.duration = duration
            return child

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.roots.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


def _merge(mine: Node, theirs: Node) -> None:
    """Add ``theirs``' nodes into ``mine`` (mine wins where both recorded a call)."""
    if not mine.snapshot and theirs.snapshot:
        mine.snapshot, mine.state = theirs.snapshot, theirs.state
    if not mine.result and theirs.result:
        mine.result, mine.duration = theirs.result, theirs.duration
    for sig, child in theirs.children.items():
        if sig in mine.children:
            _merge(mine.children[sig], child)
        else:
            child.parent = mine
            mine.children[sig] = child


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    replays: int = 0
    restores: int = 0
    snapshots: int = 0
    snapshot_s: float = 0.0

    @property
    def served(self) -> int:
        return self.hits

    def as_dict(self) -> dict:
        total = self.hits + self.misses
        return {**vars(self), "hit_rate": round(self.hits / total, 3) if total else 0.0}


class PrefixCache(Counted):
    """A tool-prefix cache shared by many envs (all members of all groups of a run).

    Args:
        cache_dir: where the tree persists (snapshots live in the snapshot store).
        snapshot_every: snapshot the workspace after every k-th call depth (sparse snapshots;
            the calls in between are replayed on a miss).
        memory_budget: bytes of snapshot images kept resident in memory (ancestor-aware LRU).
        overlap: run replays and snapshots in the background, during the policy's think time.
        log: a trajectory log to record every call in.
    """

    def __init__(self, cache_dir: str | Path, *, snapshot_every: int = 2, memory_budget: int = 2 << 30,
                 overlap: bool = True, log: TrajectoryLog | None = None):
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        self.tree = PrefixTree(cache_dir)
        self.snapshot_every = snapshot_every
        self.overlap = overlap
        self.log = log
        self.residency = Residency(memory_budget)
        self.stats = CacheStats()
        for node in self.tree.nodes():
            if node.snapshot:
                self.residency.add(node, _snapshot_size(node.snapshot))

    def wrap(self, env: gym.Env) -> PrefixCacheWrapper:
        return PrefixCacheWrapper(env, self)


    def save(self) -> None:
        self.tree.save()

    def clear(self) -> None:
        """Forget the tree and delete its snapshots (leaves first)."""
        with self.tree.lock:
            for node in sorted(self.tree.nodes(), key=lambda n: -n.depth):
                if node.snapshot:
                    _delete_snapshot(node.snapshot)
            self.tree.roots.clear()
            self.tree.save()


def cache_key(env: gym.Env) -> str:
    """(task id, task definition, image): a hit is only valid for the same three."""
    base = env.unwrapped
    task = base.task
    definition = json.dumps(getattr(task, "config", {}), sort_keys=True, default=str)
    image = getattr(base, "image_key", lambda: base.image)()
    return f"{task.id}|{hashlib.sha256(definition.encode()).hexdigest()[:12]}|{image}"


class PrefixCacheWrapper(BunshinWrapper):
    """Serves steps from a :class:`PrefixCache` (see the module docs)."""

    def __init__(self, env: gym.Env, cache: PrefixCache):
        super().__init__(env)
        self.cache = cache
        self.node: Node | None = None  # where the episode is (virtually)
        self.real: Node | None = None  # where the live workspace is, if on the tree
        self.base: EnvSnapshot | None = None  # the episode's start state
        self.episode = ""
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-cache")
        self._pending: Future | None = None

    def _rewrap(self, inner: gym.Env) -> PrefixCacheWrapper:
        twin = PrefixCacheWrapper(inner, self.cache)
        twin.node = twin.real = self.node
        twin.base, twin.episode = self.base, uuid.uuid4().hex[:12]
        return twin

    # episode ---------------------------------------------------------------------------
    def reset(self, **kwargs: Any):
        self._join()
        # inner wrappers learn of the episode through start_episode, once the cache has told
        # them which calls it will serve (speculation must not fork for those)
        obs, info = self.env.unwrapped.reset(**kwargs)
        self.start_episode(obs, info)
        return obs, info

    def start_episode(self, obs: Any, info: dict) -> None:
        """Enter the tree at the root of this env's task (also for members forked after a
        group's reset)."""
        self._join()
        self.node = self.real = self.cache.tree.root(cache_key(self.env))
        base = self.env.unwrapped
        # the episode's start state: a lazy member's pending snapshot or the reset snapshot
        self.base = base._pending or base._reset_snap or base.snapshot()
        self.episode = uuid.uuid4().hex[:12]
        _inner_call(self.env, "set_cached", set(self.node.children))
        _inner_call(self.env, "start_episode", obs, info)

    def step(self, action: Any):
        self._join()
        if self.node is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        sig = signature(action, self.env)
        child, mine = self.cache.tree.claim(self.node, sig, action)
        if not mine and child.inflight is not None:
            child.inflight.wait()  # another member runs this very call now: wait for its result
        if not mine and child.result:
            return self._hit(child, sig)
        try:
            return self._execute(action, sig)
        finally:
            if mine:
                self.cache.tree.release(child)

    def _hit(self, child: Node, sig: str) -> tuple:
        child.hits += 1
        self.node = child
        self.cache.count(hits=1)
        self.cache.residency.touch(child)
        obs, reward, term, trunc, info = child.load_result()
        info = dict(info, cache="hit")
        _inner_call(self.env, "skip_call", sig)
        self._log(child, "cache")
        if self.env.unwrapped.materialized and not (term or trunc):
            self._background(self._materialize)  # replay during think time; keeps the fork warm
        return obs, reward, term, trunc, info

    def _execute(self, action: Any, sig: str) -> tuple:
        self._materialize()
        _inner_call(self.env, "set_cached", set())
        t0 = time.perf_counter()
        obs, reward, term, trunc, info = self.env.step(action)
        duration = time.perf_counter() - t0
        served = info.get("speculation") == "hit" and "speculated" or "executed"
        clean = {k: v for k, v in info.items() if k not in ("speculation", "cache")}
        child = self.cache.tree.add(self.node, sig, action, (obs, reward, term, trunc, clean), duration)
        self.node = self.real = child
        self.cache.count(misses=1)
        self._log(child, served)
        if not (term or trunc) and child.depth % self.cache.snapshot_every == 0 and not child.snapshot:
            self._background(self._snapshot, child)
        return obs, reward, term, trunc, dict(info, cache="miss")

    @property
    def workspace(self) -> Any:
        """The live workspace, brought to the episode's current position first."""
        self._join()
        self._materialize()
        return self.env.unwrapped.workspace

    def sync(self) -> None:
        """Bring the live workspace to the episode's position (replaying if needed)."""
        self._join()
        self._materialize()

    def close(self) -> None:
        self._join()
        self._bg.shutdown(wait=True)
        self.cache.save()
        super().close()

    # internals -------------------------------------------------------------------------
    def _background(self, fn, *args) -> None:
        if self.cache.overlap:
            self._pending = self._bg.submit(fn, *args)
        else:
            fn(*args)

    def _join(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def _materialize(self) -> None:
        """Bring the live workspace to ``self.node``: reuse it if it is on the path, else
        restore the deepest snapshot on the path; then replay the calls in between."""
        if self.real is self.node:
            return
        path = self.node.path()
        start = None
        if self.real is not None and self.real in path:
            start = path.index(self.real)
        snap_at = max((i for i, n in enumerate(path) if n.snapshot and (start is None or i > start)), default=None)
        base = self.env.unwrapped
        _inner_call(self.env, "cancel_speculation")
        if snap_at is not None:
            snap = self._env_snapshot(path[snap_at])
            if snap is not None:
                base.rollback(snap)
                self.cache.count(restores=1)
                self.cache.residency.touch(path[snap_at])
                start = snap_at
        if start is None:
            base.rollback(self.base)
            start = 0
        for node in path[start + 1:]:
            base.step(node.action)
            self.cache.count(replays=1)
        self.real = self.node

    def _env_snapshot(self, node: Node) -> EnvSnapshot | None:
        from bunshin_gym.workspace.snapshot import SnapshotStore

        try:
            ws_snap = SnapshotStore().get(node.snapshot)
        except SnapshotError:
            node.snapshot = None  # deleted or corrupt: fall back to an ancestor and replay
            return None
        st = node.state or {}
        return EnvSnapshot(ws_snap, self.env.unwrapped.task, st.get("steps", node.depth), False, st.get("episode", {}))

    def _snapshot(self, node: Node) -> None:
        t0 = time.perf_counter()
        base = self.env.unwrapped
        snap = base.snapshot(keep=True, prefix=node.sig)
        with self.cache.tree.lock:
            if node.snapshot:  # another member got there first
                _delete_snapshot(snap.id)
                return
            node.snapshot, node.state = snap.id, {"steps": snap.steps, "episode": snap.state}
        self.cache.residency.add(node, snap.workspace.size())
        self.cache.count(snapshots=1, snapshot_s=time.perf_counter() - t0)

    def _log(self, node: Node, served: str) -> None:
        if self.cache.log is not None:
            self.cache.log.record(task=self.env.unwrapped.task.id, episode=self.episode, depth=node.depth - 1,
                                  signature=node.sig, action=node.action, duration=node.duration, served=served)


def _inner_call(env: gym.Env, method: str, *args: Any) -> None:
    """Call ``method`` on every wrapper of the stack below that defines it."""
    e = env
    while isinstance(e, gym.Wrapper):
        fn = getattr(type(e), method, None)
        if fn is not None:
            fn(e, *args)
        e = e.env


def _snapshot_size(snap_id: str) -> int:
    from bunshin_gym.workspace.snapshot import SnapshotStore

    try:
        return SnapshotStore().get(snap_id).size()
    except SnapshotError:
        return 0


def _delete_snapshot(snap_id: str) -> None:
    from bunshin_gym.workspace.snapshot import SnapshotStore

    try:
        SnapshotStore().get(snap_id).delete()
    except (SnapshotError, WorkspaceError):
        pass
