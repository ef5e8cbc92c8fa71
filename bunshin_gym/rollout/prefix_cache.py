"""Tool-prefix caching: serve tool-call prefixes seen before from a tree of snapshots.

A :class:`PrefixTree` is keyed by (task, workspace image) and, below that, by the
sequence of normalised tool-call signatures. Each node holds the step result recorded
when that call was first executed and, every ``snapshot_every`` calls, a snapshot of the
workspace right after it.

:class:`PrefixCacheWrapper` (made by :meth:`PrefixCache.wrap`) walks the tree:

- **hit**: the call is a child of the current node: its recorded result is returned, nothing
  executes, and no writable fork is created (a lazy member stays without a workspace);
- **miss**: the workspace is brought to the current node, the call executes, and a node is
  recorded. To get there the cache starts from the cheapest of: the live workspace (if it
  is on the path), a snapshot on the path, or the episode's start; then it replays the
  calls in between. The cost of a start is its restore (the measured mean of hot restores,
  snapshot images resident in memory with their tmpfs copy kept, or of cold ones, read back
  from disk and copied again) plus the recorded durations of the calls it has to replay. A
  restore whose tmpfs copy would exceed the cache's memory budget does not compete: that
  copy, mapped by one clone, would be memory the run holds twice.

Replays are checked: a replayed call whose observation differs from the one recorded
(:func:`~bunshin_gym.rollout.observation.same_observation`) is not deterministic. The cache
marks it, never serves it again (for that prefix: the subtree below it is dropped from
service and from memory) and counts it in ``stats.nondeterministic``. The episode that
found it goes on without the cache ("off the tree": every call executes), since its live
workspace is no longer the state the recorded results describe.

The task's set-up is the tree's root: the first group's start is kept (its snapshot, which
every later group's members fork, and its reset's observation and info), and a later
group starts there without setting the task up (:meth:`PrefixCache.kept_start`).

A hit is valid only for the same task (id and definition), the same image and the same
full prefix. Snapshots stay on disk in the snapshot store; hot ones are kept in memory
under a byte budget by an ancestor-aware LRU (:class:`Residency`), by default a small share
of the run's own memory, so that the cache adds little to it. The tree persists in
``cache_dir`` across epochs and processes.

Example:
    >>> cache = PrefixCache("/var/lib/bunshin/prefix-cache/demo", snapshot_every=2)
    >>> env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    >>> env.reset(options={"task": "shell/count-files"})
    >>> env.step("ls /data")        # miss: executed and recorded
    >>> env.reset(options={"task": "shell/count-files"})
    >>> env.step("ls  /data")       # hit: same signature (blanks between words), served from the tree
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import json
import logging
import os
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

from bunshin_gym.core.env import EnvSnapshot
from bunshin_gym.core.task import Task
from bunshin_gym.core.wrappers import BunshinWrapper
from bunshin_gym.errors import SnapshotError, WorkspaceError
from bunshin_gym.rollout.observation import observation_text, same_observation
from bunshin_gym.rollout.packed import pack, unpack
from bunshin_gym.rollout.residency import Residency, copy_bytes, keep_copy
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.spare_supply import SpareSupply
from bunshin_gym.rollout.stats import CacheStats, Counted
from bunshin_gym.rollout.trajlog import TrajectoryLog

#: when the cache snapshots a recorded call's workspace (PrefixCache's ``snapshot_policy``)
SNAPSHOT_POLICIES = ("interval", "cost")
#: the cost policy prices a snapshot at the mean of the last few taken, so that its price
#: follows the run's load (a desktop snapshot: 0.7-1 s on a quiet host, ~8 s of its member's
#: time once the paper's 64 members run on 2 cores; a mean of all taken lags behind a change)
RECENT_SNAPSHOTS = 4
#: the cost policy's prior on restores per snapshot (one each), weighed as this many snapshots:
#: the measured ratio takes over as snapshots are taken (measured at the paper's desktop size:
#: 24 snapshots in epoch 1, 5 restores; 29 in 3 epochs, 10 restores)
PRIOR_SNAPSHOTS = 2

__all__ = ["CacheStats", "Node", "PrefixCache", "PrefixCacheWrapper", "PrefixTree", "cache_key"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Node:
    sig: str
    action: Any
    depth: int
    result: bytes = b""  # packed.pack((obs, reward, terminated, truncated, info))
    duration: float = 0.0  # seconds the tool took when executed
    snapshot: str | None = None  # snapshot id (store) of the workspace right after this call
    state: dict | None = None  # env episode state that goes with the snapshot
    children: dict[str, Node] = field(default_factory=dict)
    parent: Node | None = field(default=None, repr=False)
    hits: int = 0
    nondeterministic: bool = False  # a replay of it gave another observation: never served
    start: str | None = None  # (roots) the task's start snapshot, kept by the cache: lazy members fork it
    # (roots, with ``start``) packed.pack((obs, info)) of the reset that made it, and its env
    # state ({"steps", "done", "episode"}): a later group starts there without a set-up
    start_result: bytes = b""
    start_state: dict | None = None
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
        return unpack(self.result)


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
            if child is not None and child.nondeterministic:
                return child, False  # the caller executes it, off the tree
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
        packed = pack(result)  # outside the lock every member's call takes (a screenshot: ms)
        with self.lock:
            child = parent.children.get(sig)
            if child is None:
                child = Node(sig, copy.deepcopy(action), parent.depth + 1, parent=parent)
                parent.children[sig] = child
            child.result = packed
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
    if not getattr(mine, "start", None) and getattr(theirs, "start", None):
        mine.start = theirs.start
        mine.start_result, mine.start_state = theirs.start_result, theirs.start_state
    if not mine.result and theirs.result:
        mine.result, mine.duration = theirs.result, theirs.duration
    mine.nondeterministic = mine.nondeterministic or theirs.nondeterministic
    for sig, child in theirs.children.items():
        if sig in mine.children:
            _merge(mine.children[sig], child)
        else:
            child.parent = mine
            mine.children[sig] = child


class PrefixCache(Counted):
    """A tool-prefix cache shared by many envs (all members of all groups of a run).

    Args:
        cache_dir: where the tree persists (snapshots live in the snapshot store).
        snapshot_every: snapshot the workspace after every k-th call depth (sparse snapshots;
            the calls in between are replayed on a miss).
        memory_budget: bytes of snapshot images kept resident in memory (ancestor-aware LRU);
            None (the default) sizes it from the run: a small share of the peak memory of the
            workspaces this process runs (:class:`Residency`), so the cache adds about that much.
        overlap: run replays and snapshots in the background, during the policy's think time.
        log: a trajectory log to record every call in.
        bound_restores: a restore whose tmpfs copy of page images would exceed the memory
            budget is declined, its calls replayed (see :meth:`start_cost`); False lets time
            alone decide (a host that was sent a snapshot so that it restores from it).
        spares: keep one clone of each hot snapshot restored ahead and frozen, within the
            memory budget (:class:`~bunshin_gym.rollout.spare_supply.SpareSupply`), so that a
            restore of it is a thaw; needs ``overlap`` (they are made in the background).
        snapshot_policy: ``"interval"`` snapshots at every ``snapshot_every``-th depth;
            ``"cost"`` only at those where it pays (:meth:`want_snapshot`): where the replay its
            expected restores would spare exceeds what a snapshot costs now. A member waits for its
            own snapshot before its next call, so on a desktop (snapshots of seconds, calls of
            a fraction of one) the interval policy spends more than its restores save.
    """

    def __init__(self, cache_dir: str | Path, *, snapshot_every: int = 2, memory_budget: int | None = None,
                 overlap: bool = True, log: TrajectoryLog | None = None, bound_restores: bool = True,
                 spares: bool = True, snapshot_policy: str = "interval"):
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        if snapshot_policy not in SNAPSHOT_POLICIES:
            raise ValueError(f"snapshot_policy must be one of {', '.join(SNAPSHOT_POLICIES)}, got {snapshot_policy!r}")
        self.snapshot_policy = snapshot_policy
        self.tree = PrefixTree(cache_dir)
        self.snapshot_every = snapshot_every
        self.overlap = overlap
        self.bound_restores = bound_restores
        self.log = log
        self.residency = Residency(memory_budget)
        self.stats = CacheStats()
        self.use_spares = spares and overlap
        self.spares = SpareSupply(self.residency, self.count)
        # the cost policy's first snapshot, taken to measure one, is being taken (the members'
        # snapshots run in the background: they would all be "the first" until one is done)
        self._measuring = False
        self._measuring_lock = threading.Lock()
        self._recent_snapshot_s: deque[float] = deque(maxlen=RECENT_SNAPSHOTS)
        for node in self.tree.nodes():
            if node.snapshot:
                self.residency.add(node, _snapshot_size(node.snapshot))

    def wrap(self, env: gym.Env) -> PrefixCacheWrapper:
        return PrefixCacheWrapper(env, self)

    def want_snapshot(self, node: Node) -> bool:
        """Whether to snapshot the workspace right after ``node``'s call (just recorded): at
        every ``snapshot_every``-th depth, and with the ``"cost"`` policy only where it pays:

        - what a snapshot is expected to save is at least what it costs now (the mean of the
          last :data:`RECENT_SNAPSHOTS` taken). Each restore of it saves the replay of the calls
          it would not replay (those since the nearest snapshot on its path, or since the
          episode's start), less the restore itself; it is expected to be restored as often
          as the snapshots taken so far were (restores per snapshot, with a prior of one each
          weighed as :data:`PRIOR_SNAPSHOTS` snapshots). Measured on the desktop at the
          paper's size: a snapshot took 8 s of its member's time under the run's load and
          snapshots were restored 0.2-0.4 times each; pricing a snapshot at the mean of all
          taken, against one restore each, took 18-24 in epoch 1 (150-200 s of member time)
          for 1-5 restores;
        - with bounded restores, a restore of it would not be declined: the tmpfs copy a
          restore of one makes (the measured mean of those taken) fits the memory budget as
          the run has sized it. Measured on the web env (bench epoch, 2 tasks x G=4): 8
          snapshots of 54-89 MB images against a 30 MB budget took 134 s of the members' time
          in epoch 1 and none was ever restored (6 restores declined).

        The first snapshot is taken to measure one, and no other until it is measured
        (:meth:`snapshot_ended`)."""
        if node.depth % self.snapshot_every or node.snapshot:
            return False
        if self.snapshot_policy == "interval":
            return True
        if not self.stats.snapshots:
            with self._measuring_lock:
                measuring, self._measuring = self._measuring, True
            if not measuring:
                return True
            self.count(snapshots_skipped=1)
            return False
        mean_copy = self.stats.snapshot_copy_bytes / self.stats.snapshots
        if self.bound_restores and mean_copy > self.residency.sized_budget():
            self.count(snapshots_skipped=1, snapshots_too_large=1)
            return False
        if self.snapshot_value(node) >= self.snapshot_cost():
            return True
        self.count(snapshots_skipped=1)
        return False

    def snapshot_cost(self) -> float:
        """Seconds a snapshot costs its member now: the mean of the last few taken (0 before any)."""
        recent = list(self._recent_snapshot_s)
        return sum(recent) / len(recent) if recent else 0.0

    def snapshot_value(self, node: Node) -> float:
        """Seconds a snapshot of ``node``'s workspace is expected to save: restores expected
        of it (restores per snapshot so far, with a prior) times the replay each spares, less
        the restore (a hot one: a new snapshot is kept resident if it fits)."""
        spared, n = 0.0, node
        while n.parent is not None:  # the root: the episode's start, restored anyway
            spared += n.duration
            n = n.parent
            if n.snapshot:
                break
        restores_each = (self.stats.restores + PRIOR_SNAPSHOTS) / (self.stats.snapshots + PRIOR_SNAPSHOTS)
        return restores_each * max(0.0, spared - self.stats.restore_cost(True))

    def snapshot_taken(self, seconds: float, copy_bytes: int) -> None:
        """Count a snapshot the cache asked for: its member's seconds and its tmpfs copy's bytes."""
        self._recent_snapshot_s.append(seconds)
        self.count(snapshots=1, snapshot_s=seconds, snapshot_copy_bytes=copy_bytes)

    def snapshot_ended(self) -> None:
        """A snapshot :meth:`want_snapshot` asked for was taken, or failed: with the cost
        policy, the next one may be the first to measure if none was measured yet."""
        with self._measuring_lock:
            self._measuring = False

    def save(self) -> None:
        self.tree.save()

    def mark_nondeterministic(self, node: Node) -> bool:
        """Never serve ``node`` again: its subtree is dropped from service and from memory
        (its snapshots are deleted with the tree, by :meth:`clear`). Returns whether it was
        newly marked."""
        with self.tree.lock:
            if node.nondeterministic:
                return False
            node.nondeterministic = True
            below, stack = [], [node]
            while stack:
                n = stack.pop()
                below.append(n)
                stack.extend(n.children.values())
        self.residency.drop(below)
        self.count(nondeterministic=1)
        logger.warning("prefix cache: %s (depth %d) gave another observation when replayed; it is not "
                       "served again", node.sig[:200], node.depth)
        return True

    def start_cost(self, path: list[Node], live: int | None, *, materialized: bool = True,
                   restore_bytes: Callable[[Node], int] | None = None) -> tuple[float, int]:
        """The cheapest way to bring a workspace to ``path[-1]``: (estimated seconds, index
        of the start), where the start is ``live`` (the live workspace's index, no restore,
        unless the env is lazy and still has to fork it), a snapshotted node's index (a
        restore), or 0 (the episode's start state, restored). Each start costs its restore
        plus the recorded durations of the calls after it.

        ``restore_bytes(node)``: the memory a restore of the node's snapshot adds to the run
        (a share restore of a snapshot whose tmpfs copy is not there makes one, mapped by that
        clone alone: measured on the desktop, a restored member plus its copy held 13 MB more
        than a member that replayed the same calls from the group's start). A restore only
        competes when that fits the cache's memory budget (the snapshot then becomes resident,
        its copy kept, and less recently used ones are evicted to make room); the episode's
        start and the live workspace always do (their copy is the group's, mapped anyway)."""
        after = [0.0] * (len(path) + 1)  # after[i]: seconds to replay path[i:]
        for i in range(len(path) - 1, -1, -1):
            after[i] = after[i + 1] + path[i].duration
        options = [(self.stats.restore_cost(True) + after[1], 0)]  # the start state: kept hot
        options += [(self._restore_cost(n) + after[i + 1], i) for i, n in enumerate(path) if i > 0 and n.snapshot]
        if live is not None:
            options.append(((0.0 if materialized else self.stats.restore_cost(True)) + after[live + 1], live))
        # ties go to the deeper start (fewer replays, fewer chances of a non-deterministic call)
        best = min(options, key=lambda o: (o[0], -o[1]))
        if restore_bytes is None or best[1] in (0, live):
            return best
        budget = self.residency.budget
        fits = [o for o in options if o[1] in (0, live) or restore_bytes(path[o[1]]) <= budget]
        if best not in fits:
            self.count(restores_declined=1)
            best = min(fits, key=lambda o: (o[0], -o[1]))
        return best

    def _restore_cost(self, node: Node) -> float:
        """Expected seconds of a restore of ``node``'s snapshot: a thaw if a spare of it is
        ready, else a hot or cold restore."""
        if self.use_spares and self.spares.has(node.snapshot):
            return self.stats.spare_cost()
        return self.stats.restore_cost(self.residency.is_resident(node))

    def want_spare(self, node: Node, memory_mode: str) -> None:
        """A spare of ``node``'s snapshot, made in the background if the budget allows."""
        if self.use_spares:
            self.spares.want(node, memory_mode)

    def shared_start(self, root: Node, base: Any, obs: Any = None, info: dict | None = None) -> None:
        """Make a lazy member (``base``: its unwrapped env, not forked yet) start from the
        task's start snapshot the cache keeps (the first group's), or keep its own as that,
        with ``obs`` and ``info``, its reset's (what :meth:`kept_start` serves later groups).

        Every group then forks its members from one snapshot, so its forks and all the
        cached snapshots below it share one tmpfs copy of its page images. With each group
        forking its own, a member restoring a cached snapshot of an earlier group held a
        second copy of the same set-up memory beside its group's (measured: the largest
        part of the prefix cache's memory at the peak of a desktop run). The env's episode
        state stays the member's own: only the workspace it forks is shared."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        pending = base._pending
        if pending is None or base._ws is not None:
            return
        with self.tree.lock:
            if getattr(root, "start", None):
                try:
                    kept = SnapshotStore().get(root.start)
                except SnapshotError:
                    kept = None  # deleted meanwhile: this member's start becomes the task's
                if kept is not None and kept.meta.get("image_path") == pending.workspace.meta.get("image_path"):
                    if kept.id != pending.workspace.id:
                        base._pending = EnvSnapshot(kept, pending.task, pending.steps, pending.done, pending.state)
                    return
            # the cache owns it from now on (the group's env would delete it when it closes,
            # and `bunshin gc` after a crash of the process that took it: the tree outlives both)
            base.disown(pending.workspace)
            pending.workspace.keep(by=self.tree.dir)
            root.start, root.start_result = pending.workspace.id, b""
            root.start_state = {"steps": pending.steps, "done": pending.done,
                                "episode": copy.deepcopy(pending.state)}
        # compressed outside the lock (a screenshot: tens of ms) that every member's call takes;
        # until it is set, kept_start serves nothing and a group sets the task up
        result = pack((obs, info))
        with self.tree.lock:
            if root.start == pending.workspace.id:
                root.start_result = result

    def kept_start(self, env: gym.Env, options: dict | None) -> tuple[EnvSnapshot, Any, dict] | None:
        """The start of the task ``options`` names as this cache keeps it: the state right
        after an earlier group's set-up (the snapshot every later group's members fork
        anyway, :meth:`shared_start`), with that reset's observation and info. A group
        starts there instead of setting the task up again (booting the image, running the
        set-up, dumping it): the set-up is the root of the task's prefix tree. None when
        none is kept (or it is gone), or when ``options`` holds more than the task (a reset
        option the kept start may not reflect)."""
        from bunshin_gym.workspace.snapshot import SnapshotStore

        base = env.unwrapped
        options = options or {}
        spec = options.get("task", getattr(base, "_default_task", None))
        if set(options) - {"task"} or spec is None:
            return None
        try:
            task = spec if isinstance(spec, Task) else base.load_task(spec)
            key = _task_key(task, base)
        except Exception:  # noqa: BLE001 - a bad task is the reset's to report
            return None
        with self.tree.lock:
            root = self.tree.roots.get(key)
            if root is None or not root.start or not root.start_result:
                return None
            start_id, result, state = root.start, root.start_result, root.start_state
        try:
            kept = SnapshotStore().get(start_id)
        except SnapshotError:
            return None  # deleted meanwhile: the group sets the task up (and its start is kept)
        obs, info = unpack(result)
        self.count(starts_served=1)
        return EnvSnapshot(kept, task, state["steps"], state["done"], copy.deepcopy(state["episode"])), obs, info

    def clear(self) -> None:
        """Forget the tree and delete its snapshots (leaves first, the tasks' start snapshots last)."""
        self.spares.close()  # the spare being made is waited for; every spare is reclaimed
        self.spares = SpareSupply(self.residency, self.count)
        with self.tree.lock:
            for node in sorted(self.tree.nodes(), key=lambda n: -n.depth):
                if node.snapshot:
                    _delete_snapshot(node.snapshot)
                if getattr(node, "start", None):
                    _delete_snapshot(node.start)
            self.tree.roots.clear()
            self.tree.save()


def cache_key(env: gym.Env) -> str:
    """(task id, task definition, image): a hit is only valid for the same three."""
    base = env.unwrapped
    return _task_key(base.task, base)


def _task_key(task: Any, base: gym.Env) -> str:
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
        self.depth = 0  # calls made in this episode
        self.off_tree = False  # the episode left the tree (a replay differed): every call executes
        self.last_obs: Any = None  # the observation the next call is made from (for the log)
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-cache")
        self._pending: Future | None = None
        self._failed: tuple | None = None  # a replay's step result when the workspace died in it

    def _rewrap(self, inner: gym.Env) -> PrefixCacheWrapper:
        twin = PrefixCacheWrapper(inner, self.cache)
        twin.node = twin.real = self.node
        twin.base, twin.episode = self.base, uuid.uuid4().hex[:12]
        twin.depth, twin.off_tree, twin.last_obs = self.depth, self.off_tree, self.last_obs
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
        self.cache.shared_start(self.node, base, obs, info)
        # the episode's start state: a lazy member's pending snapshot or the reset snapshot
        self.base = base._pending or base._reset_snap or base.snapshot()
        self.episode = uuid.uuid4().hex[:12]
        self.depth, self.off_tree, self.last_obs, self._failed = 0, False, obs, None
        _inner_call(self.env, "set_cached", self._servable())
        _inner_call(self.env, "start_episode", obs, info)

    def step(self, action: Any):
        self._join()
        if self.node is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        sig = signature(action, self.env)
        if self._failed is not None:  # the workspace died while a replay caught up with the episode
            return self._take_failure()
        if self.off_tree:
            return self._execute_off_tree(action, sig)
        child, mine = self.cache.tree.claim(self.node, sig, action)
        if not mine and child.inflight is not None:
            child.inflight.wait()  # another member runs this very call now: wait for its result
        if child.nondeterministic:
            return self._execute_off_tree(action, sig)
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
        self._log(sig, child.action, child.duration, "cache", obs)
        if self.env.unwrapped.materialized and not (term or trunc):
            self._background(self._materialize)  # replay during think time; keeps the fork warm
        return obs, reward, term, trunc, info

    def _execute(self, action: Any, sig: str) -> tuple:
        self._materialize()
        if self._failed is not None:
            return self._take_failure()
        if self.off_tree:  # a replay on the way here differed from its record
            return self._execute_off_tree(action, sig)
        _inner_call(self.env, "set_cached", set())
        t0 = time.perf_counter()
        obs, reward, term, trunc, info = self.env.step(action)
        if info.get("workspace_failed"):  # not the call's result: the workspace died under it
            self.off_tree, self.real = True, None
            self.cache.count(misses=1, off_tree=1)
            return obs, reward, term, trunc, dict(info, cache="miss")
        # a call served by speculation took what the fork spent on it (a replay costs that much)
        duration = info.get("speculation_s", time.perf_counter() - t0)
        served = info.get("speculation") == "hit" and "speculated" or "executed"
        clean = {k: v for k, v in info.items() if k not in ("speculation", "speculation_s", "cache")}
        child = self.cache.tree.add(self.node, sig, action, (obs, reward, term, trunc, clean), duration)
        self.node = self.real = child
        self.cache.count(misses=1)
        self._log(sig, action, duration, served, obs)
        if not (term or trunc) and self.cache.want_snapshot(child):
            self._background(self._snapshot, child)
        return obs, reward, term, trunc, dict(info, cache="miss")

    def _execute_off_tree(self, action: Any, sig: str) -> tuple:
        """Execute a call the cache cannot serve or record (the episode is off the tree, or
        the call is not deterministic); the episode stays off the tree."""
        self._materialize()  # the calls so far, in the live workspace (checked on the way)
        if self._failed is not None:
            return self._take_failure()
        if not self.off_tree:
            self.off_tree = True
            self.cache.count(off_tree=1)
        self.real = None
        _inner_call(self.env, "set_cached", set())
        t0 = time.perf_counter()
        obs, reward, term, trunc, info = self.env.step(action)
        duration = info.get("speculation_s", time.perf_counter() - t0)
        self.cache.count(misses=1)
        served = info.get("speculation") == "hit" and "speculated" or "executed"
        self._log(sig, action, duration, served, obs)
        return obs, reward, term, trunc, dict(info, cache="miss")

    def _take_failure(self) -> tuple:
        out, self._failed = self._failed, None
        self.cache.count(misses=1)
        return out

    def _servable(self) -> set[str]:
        """Calls the cache serves from the current node (speculation need not run them)."""
        with self.cache.tree.lock:
            return {s for s, c in self.node.children.items() if c.result and not c.nondeterministic}

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
        """Bring the live workspace to ``self.node`` from the cheapest start (the live
        workspace if it is on the path, a snapshot on it, or the episode's start: see
        :meth:`PrefixCache.start_cost`), then replay the calls in between, checking each."""
        if self.off_tree or self.real is self.node:
            return
        path = self.node.path()
        live = path.index(self.real) if self.real is not None and self.real in path else None
        base = self.env.unwrapped
        _inner_call(self.env, "cancel_speculation")
        while True:
            _, start = self.cache.start_cost(path, live, materialized=base.materialized,
                                             restore_bytes=self._restore_bytes if self.cache.bound_restores else None)
            if start == live:
                break
            if start == 0:
                self._restore(self.base, None)
                break
            snap = self._env_snapshot(path[start])
            if snap is not None:
                self._restore(snap, path[start])
                break
            # the snapshot is gone (node.snapshot cleared): choose again without it
        diverged = False
        for node in path[start + 1:]:
            t0 = time.perf_counter()
            obs, reward, term, trunc, info = base.step(node.action)
            self.cache.count(replays=1, replay_s=time.perf_counter() - t0)
            if info.get("workspace_failed"):  # the live workspace died: the episode's next step reports it
                self._failed = (obs, reward, term, trunc, dict(info, cache="miss"))
                diverged = True
                break
            if diverged:
                continue  # the episode's later calls still run, to keep its step count and effects
            r_obs, r_reward, r_term, r_trunc, _ = node.load_result()
            if not same_observation(obs, r_obs) or (reward, term, trunc) != (r_reward, r_term, r_trunc):
                self.cache.mark_nondeterministic(node)
                diverged = True
        if diverged:
            self.off_tree, self.real = True, None
            self.cache.count(off_tree=1)
        else:
            self.real = self.node

    def _restore(self, snap: EnvSnapshot, node: Node | None) -> None:
        """Roll the env back to ``snap`` (a node's snapshot, or the episode's start) and
        record what it cost, as a hot or a cold restore."""
        base = self.env.unwrapped
        hot = node is None or self.cache.residency.is_resident(node)
        ready = self.cache.spares.pids(snap.workspace.id)
        t0 = time.perf_counter()
        base.rollback(snap)
        base.workspace  # noqa: B018 - a lazy env forks here: part of the restore's cost
        seconds = time.perf_counter() - t0
        if node is None:
            return  # the start state: not a cached snapshot
        self.cache.residency.touch(node)
        # for the next restore of it: a snapshot restored once is restored again (members of
        # later groups leaving the tree at the same call); most are never restored, so a
        # spare of each new snapshot would be restore work and memory spent for nothing
        self.cache.want_spare(node, base.memory_mode)
        if base.workspace.pid in ready:
            self.cache.count(restores=1, restores_spare=1, restore_spare_s=seconds)
        elif hot:
            self.cache.count(restores=1, restores_hot=1, restore_hot_s=seconds)
        else:
            self.cache.count(restores=1, restores_cold=1, restore_cold_s=seconds)

    def _restore_bytes(self, node: Node) -> int:
        """Bytes of page images a restore of ``node``'s snapshot would copy onto the tmpfs
        (none where the env's clones map no copy: only share clones served by uffd do)."""
        return copy_bytes(node.snapshot) if node.snapshot and _maps_copies(self.env.unwrapped.memory_mode) else 0

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
        try:
            self._take_snapshot(node)
        finally:
            self.cache.snapshot_ended()

    def _take_snapshot(self, node: Node) -> None:
        t0 = time.perf_counter()
        base = self.env.unwrapped
        # taken held by this process, then kept by the cache: no moment where a crash leaves
        # a snapshot that neither `bunshin gc` nor the tree would ever delete
        snap = base.snapshot(prefix=node.sig[:200])
        base.disown(snap.workspace)
        snap.workspace.keep(by=self.cache.tree.dir)
        with self.cache.tree.lock:
            if node.snapshot:  # another member got there first
                _delete_snapshot(snap.id)
                return
            node.snapshot, node.state = snap.id, {"steps": snap.steps, "episode": snap.state}
        maps_copies = _maps_copies(base.memory_mode)
        copies = copy_bytes(snap.id) if maps_copies else 0  # before one is kept
        self.cache.residency.add(node, snap.workspace.size())
        if self.cache.residency.is_resident(node) and maps_copies:
            keep_copy(snap.id, make=True)  # hot: its restores find their copy made (off the caller's path)
        self.cache.snapshot_taken(time.perf_counter() - t0, copies)

    def _log(self, sig: str, action: Any, duration: float, served: str, obs: Any) -> None:
        """One log line per call, with the text of the observation it was made from (what
        the selector learns from); ``obs`` is the call's own, the next call's context."""
        if self.cache.log is not None:
            self.cache.log.record(task=self.env.unwrapped.task.id, episode=self.episode, depth=self.depth,
                                  signature=sig, action=action, duration=duration, served=served,
                                  observation=observation_text(self.last_obs))
        self.depth += 1
        self.last_obs = obs


def _inner_call(env: gym.Env, method: str, *args: Any) -> None:
    """Call ``method`` on every wrapper of the stack below that defines it."""
    e = env
    while isinstance(e, gym.Wrapper):
        fn = getattr(type(e), method, None)
        if fn is not None:
            fn(e, *args)
        e = e.env


@functools.cache
def _maps_copies(memory_mode: str) -> bool:
    """Whether clones in this memory mode map a tmpfs copy of their snapshot's page images
    (share, where userfaultfd serves anonymous memory)."""
    if memory_mode != "share":
        return False
    from bunshin_gym.workspace.memory.share import share_anon_mechanism

    return share_anon_mechanism() == "uffd"


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
