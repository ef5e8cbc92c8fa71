"""``WorkspaceEnv``: a Gymnasium env whose state is a live, forkable workspace.

An env family (shell, desktop, web) subclasses it and fills in four hooks:
``load_task`` (a task id, dict or path -> :class:`Task`), ``boot`` (start the family's
services in a fresh workspace), ``execute`` (apply one action) and ``observe``.
Everything else (episode bookkeeping, rewards at episode end, clone/snapshot/rollback)
lives here.

Life of an env: the first ``reset`` creates a workspace, boots it and snapshots that
booted state; every later ``reset`` rolls back to it (a few hundred ms instead of a
boot), runs the task's set-up and, by default, snapshots the state right after reset
so ``rollback()`` can return there. Families that say what their boot depends on
(:meth:`WorkspaceEnv.boot_config`) share that boot snapshot among the envs of a process
(:mod:`bunshin_gym.core.boots`): each env starts from a fork of it.

Example:
    >>> import gymnasium as gym, bunshin_gym
    >>> env = gym.make("Bunshin-Shell-v0")
    >>> obs, info = env.reset(options={"task": "shell/count-files"})
    >>> a, b = env.clone(2)              # live forks of this episode
    >>> a.step("ls /data | wc -l > answer.txt")
    >>> env.rollback()                   # back to the state right after reset
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from bunshin_gym.config import Limits
from bunshin_gym.core import boots
from bunshin_gym.core.task import Task
from bunshin_gym.errors import ActionError, ResetNeeded  # defined there; this import path stays
from bunshin_gym.workspace import Workspace, WorkspaceError
from bunshin_gym.workspace.errors import AgentError, SnapshotError

log = logging.getLogger(__name__)


def check_text(text: Any, *, what: str, max_bytes: int) -> str:
    """``text`` if it can travel to the workspace as it is, else :class:`ActionError` saying why:
    not a string, a NUL byte (no argv, C string or terminal carries one), a lone surrogate
    (not Unicode: it has no UTF-8 encoding), or over ``max_bytes`` bytes of UTF-8."""
    if not isinstance(text, str):
        raise ActionError(f"{what} must be a string, not {type(text).__name__}")
    nul = text.find("\0")
    if nul >= 0:
        raise ActionError(f"{what} contains a NUL byte (at character {nul}); it cannot be passed on")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ActionError(f"{what} contains a lone surrogate U+{ord(text[e.start]):04X} (at character "
                          f"{e.start}): not valid Unicode, it has no UTF-8 encoding") from None
    if size > max_bytes:
        raise ActionError(f"{what} is {size} bytes of UTF-8, over the limit of {max_bytes}")
    return text


def printable(text: str, limit: int = 4096) -> str:
    """``text`` cut to ``limit`` characters, every character the envs' Text observation spaces
    do not hold (control characters, non-printables, anything from the surrogates up) as
    ``?``: error messages quote the bad action they are about."""
    return "".join(c if (c.isprintable() and c < "\ud800") or c in "\n\t" else "?" for c in text[:limit])


def blank_observation(space: spaces.Space) -> Any:
    """An observation of ``space`` that says nothing: empty texts, zero arrays, the lowest
    integers (what an env returns when its workspace cannot be observed)."""
    if isinstance(space, spaces.Dict):
        return {k: blank_observation(v) for k, v in space.spaces.items()}
    if isinstance(space, spaces.Text):
        return ""
    if isinstance(space, spaces.Discrete):
        return np.int64(space.start)
    if isinstance(space, spaces.Box):
        return np.clip(np.zeros(space.shape, space.dtype), space.low, space.high).astype(space.dtype)
    raise TypeError(f"no blank observation for a {type(space).__name__} space: override error_observation")


@dataclass
class EnvSnapshot:
    """A workspace snapshot plus the env's own episode state at that moment."""

    workspace: Any
    task: Task | None
    steps: int
    done: bool
    state: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.workspace.id


class _Owned:
    """Snapshots made by an env and its clones, deleted when the last of them closes (or, if
    still used then, by a prefix cache's child snapshots say, as soon as nothing uses them)."""

    def __init__(self) -> None:
        self.envs = 0
        self.snapshots: list[Any] = []
        #: the shared boot snapshot the lineage holds (:mod:`bunshin_gym.core.boots`), by kind
        self.boot_key: Any = None

    def release(self) -> None:
        self.envs -= 1
        if self.envs > 0:
            return
        for snap in sorted(self.snapshots, key=lambda s: -getattr(s, "depth", 0)):
            try:
                snap.release()
            except (SnapshotError, WorkspaceError):
                pass  # gone already, or unreadable: `bunshin gc` deals with it
        self.snapshots.clear()
        if self.boot_key is not None:  # after the lineage's own snapshots, which may be its deltas
            key, self.boot_key = self.boot_key, None
            boots.release(key)


WorkspaceFactory = Callable[[str, str], Any]


def _locked(method):
    """Serialise an env's workspace operations: rollout wrappers run replays, snapshots
    and speculative forks in background threads against the same env."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


def fork_pending(envs: Sequence[gym.Env]) -> int:
    """Fork now, together, the workspaces of lazy clones (``clone(n, lazy=True)``) that have
    none yet: one concurrent fork per snapshot and memory mode, where each clone on its own
    would fork when first used, one after the other. Returns how many were forked.

    Example:
        >>> group = env.unwrapped.clone(16, lazy=True)   # one snapshot, no workspace yet
        >>> fork_pending(group[:8])                       # 8 workspaces, restored side by side
    """
    clones = list({id(u): u for e in envs if isinstance(u := e.unwrapped, WorkspaceEnv)}.values())
    for u in clones:  # held throughout: a clone used meanwhile by another thread forks no second workspace
        u._lock.acquire()
    try:
        waiting: dict[tuple[int, str], list[WorkspaceEnv]] = {}
        for u in clones:
            if not u._closed and u._ws is None and u._pending is not None:
                waiting.setdefault((id(u._pending), u.memory_mode), []).append(u)
        for (_, mode), group in waiting.items():
            # a failed fork leaves these clones pending: each can still fork on first use
            workspaces = group[0]._pending.workspace.fork(len(group), mode=mode)
            for u, ws in zip(group, workspaces, strict=True):
                u._ws, u._pending = ws, None
        return sum(len(g) for g in waiting.values())
    finally:
        for u in clones:
            u._lock.release()


class WorkspaceEnv(gym.Env):
    """Base class of the bunshin envs.

    Args:
        task: default task for ``reset`` (an id, a dict in the family's format, or a path).
        image: workspace image (default: the family's).
        memory_mode: memory mode of clones ("share", "ksm", "copy", "map-anon").
        max_steps: episode cap; default the task's own.
        reset_snapshot: snapshot the state right after each reset (needed by ``rollback()``
            without an argument; costs one snapshot per reset).
        share_boot: start from the boot snapshot that the process's envs of the same kind
            share (:mod:`bunshin_gym.core.boots`), where the family says what its boot
            depends on (:meth:`boot_config`); False: boot a workspace of its own.
        workspace_factory: ``(image, memory_mode) -> workspace``; tests pass a fake here
            (an env with one boots on its own).
        limits: the workspace's memory, pids and disk limits (a ``Limits`` or a dict such as
            ``{"memory": "2G", "pids": 512, "disk": "1G"}``; default ``BUNSHIN_WS_*`` or 8G,
            4096, 8G); clones inherit them.
    """

    metadata = {"render_modes": []}
    default_image = "base"
    #: the host name of the env's workspaces: fixed, so runs of a task are alike (prompts, paths)
    hostname = "workspace"

    def __init__(self, task: Any = None, *, image: str | None = None, memory_mode: str = "share",
                 max_steps: int | None = None, reset_snapshot: bool = True, share_boot: bool = True,
                 workspace_factory: WorkspaceFactory | None = None, render_mode: str | None = None,
                 limits: Any = None):
        self.image = image or self.default_image
        self.memory_mode = memory_mode
        self.render_mode = render_mode
        self._default_task = task
        self._max_steps = max_steps
        self._reset_snapshot_enabled = reset_snapshot
        self._share_boot = share_boot and workspace_factory is None
        self._limits = limits
        self._factory = workspace_factory or (
            lambda image, mode: Workspace.create(image, memory_mode=mode, hostname=self.hostname, limits=limits))
        self._ws: Any = None
        self._pending: EnvSnapshot | None = None  # lazy: fork from this on first use of the workspace
        self._boot_snap: Any = None
        self._reset_snap: EnvSnapshot | None = None
        # the live workspace is still exactly the reset snapshot (nothing used it since): a
        # lazy clone then forks that snapshot instead of dumping the same state again
        self._reset_is_current = False
        self._owned = _Owned()
        self._owned.envs = 1
        self.task: Task | None = None
        self.steps = 0
        self.done = False
        self._closed = False
        #: its workspace is being killed on purpose (:meth:`abandon`)
        self._abandoned = False
        self._lock = threading.RLock()
        #: wall-clock seconds of the last step: ``step_s`` (all of it) and what the family
        #: records (``command_s``, ``action_s``, ``tree_s``). Kept out of the step's info, which must be
        #: the same for the same state and action (gymnasium's determinism contract).
        self.last_step_timing: dict[str, float] = {}
        self._timing: dict[str, float] = {}

    # hooks for env families ----------------------------------------------------------
    def load_task(self, spec: Any) -> Task:
        """Turn a task id, dict or path into a :class:`Task`."""
        raise NotImplementedError

    def boot(self, ws: Any) -> None:
        """Start the family's services in a fresh workspace (captured by the boot snapshot)."""

    def boot_config(self) -> dict | None:
        """Everything of this env that :meth:`boot` depends on (its constructor's arguments:
        a screen size, the sites to start), or None: its boot snapshot is not shared. Envs
        whose family, image, memory mode, limits and boot config are equal share one boot
        snapshot (:mod:`bunshin_gym.core.boots`). A family opts in by overriding this."""
        return None

    def execute(self, action: Any) -> dict:
        """Apply one action; return info entries. Raise :class:`ActionError` for a bad one.
        Set ``self.done = True`` for an action that ends the episode (DONE, stop, ...)."""
        raise NotImplementedError

    def observe(self) -> Any:
        """The observation of the current state."""
        raise NotImplementedError

    def release_connections(self) -> None:
        """Close every connection from this process into the workspace (X display, browser
        driver, sockets): CRIU cannot dump a connection that leaves the workspace. Called
        before each snapshot and clone; reconnect lazily on the next use."""

    def episode_state(self) -> dict:
        """Extra per-episode state to carry in snapshots and clones (override with copies)."""
        return {}

    def restore_episode_state(self, state: dict) -> None:
        """Inverse of :meth:`episode_state`."""

    def error_observation(self, message: str) -> Any:
        """The observation of a step whose workspace failed (it cannot be observed): a blank
        one by default; families put ``message`` where their observations carry errors."""
        return blank_observation(self.observation_space)

    def record_timing(self, **seconds: float) -> None:
        """Add entries to this step's :attr:`last_step_timing` (called from ``execute``)."""
        self._timing.update(seconds)

    # gymnasium API ---------------------------------------------------------------------
    @property
    def workspace(self) -> Any:
        """The live workspace (after the first reset). A lazy clone forks it here, on first use."""
        self._reset_is_current = False  # whoever takes the workspace may change it
        if self._ws is None and self._pending is not None:
            self._ws = self._pending.workspace.fork(1, mode=self.memory_mode)[0]
            self._pending = None
        if self._ws is None:
            raise ResetNeeded("the env has no workspace yet: call reset() first")
        return self._ws

    @property
    def materialized(self) -> bool:
        """Whether this env holds a live workspace (a lazy clone does not until it needs one)."""
        return self._ws is not None

    @_locked
    def adopt(self, workspace: Any, state: EnvSnapshot | None = None) -> None:
        """Make ``workspace`` (a fork of this env's lineage) the env's live workspace, closing
        the current one; ``state`` gives the episode state that goes with it."""
        old, self._ws, self._pending = self._ws, workspace, None
        self._reset_is_current = False
        if state is not None:
            self.task, self.steps, self.done = state.task, state.steps, state.done
            self.restore_episode_state(copy.deepcopy(state.state))
        if old is not None and old is not workspace:
            old.close()

    def image_key(self) -> str:
        """The image's name and recipe key: caches are valid only for the same image."""
        from bunshin_gym.workspace.images import ImageStore

        try:
            return f"{self.image}@{ImageStore().key(self.image)}"
        except WorkspaceError:
            return self.image

    @property
    def max_steps(self) -> int:
        return self._max_steps or (self.task.max_steps if self.task else 15)

    @_locked
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._check_open()
        spec = (options or {}).get("task", self._default_task)
        if spec is None:
            raise ValueError(f"{type(self).__name__}.reset needs a task: reset(options={{'task': ...}}) "
                             "or a default task given to the constructor")
        task = spec if isinstance(spec, Task) else self.load_task(spec)
        self._reset_is_current = False
        self._fresh_workspace()
        self.task, self.steps, self.done = task, 0, False
        task.setup(self)
        obs = self.observe()
        # taken after the observation, which may change the workspace (the web env's
        # accessibility snapshot numbers the page's elements, which its actions then name):
        # a rollback to the reset, and a fork of it, start where this observation left it
        self._reset_snap = self.snapshot() if self._reset_snapshot_enabled else None
        self._reset_is_current = self._reset_snap is not None
        return obs, {"task_id": task.id, "instruction": task.instruction}

    @_locked
    def reset_to(self, start: EnvSnapshot, *, seed: int | None = None) -> None:
        """Begin an episode at ``start``, a task's state right after its set-up kept from an
        earlier reset (a prefix cache's task start), without setting the task up again: the
        workspace is forked from it lazily, on first use, and ``start`` is this episode's
        reset snapshot. The caller holds the observation of that state (recorded with it):
        nothing is observed here. As :meth:`rollback`, the env's episode state is the
        snapshot's."""
        gym.Env.reset(self, seed=seed)
        self._check_open()
        if self._ws is not None:  # a later episode of this env: its old workspace is not needed
            self.release_connections()
            self._ws.close()
            self._ws = None
        self._pending = self._reset_snap = start
        self.task, self.steps, self.done = start.task, start.steps, start.done
        self.restore_episode_state(copy.deepcopy(start.state))
        self._reset_is_current = True  # lazy clones fork ``start`` itself, no new snapshot

    @_locked
    def step(self, action: Any):
        """One action. Never raises for a bad action or a failed workspace: a malformed,
        impossible or failing action puts its error in ``info["error"]`` and the episode
        goes on; a workspace that failed (died, unreachable) ends the episode, truncated with
        reward 0 and ``info["workspace_failed"]``, with :meth:`error_observation`."""
        self._check_open()
        if self.task is None:
            raise ResetNeeded("call reset() before step()")
        if self.done:
            raise ResetNeeded(f"the episode of task {self.task.id} has ended: call reset() or rollback()")
        self._reset_is_current = False
        t0 = time.perf_counter()
        self._timing = {}
        info: dict = {}
        try:
            self._check_workspace()
            info.update(self.execute(action) or {})
        except (ActionError, AgentError) as e:  # AgentError: it ran in the workspace and failed there
            info["error"] = printable(str(e))
        except WorkspaceError as e:
            return self._workspace_failed(e, info, t0)
        except Exception as e:  # noqa: BLE001 - a bug on an odd action must not end the run
            log.exception("%s: step of task %s raised on action %.200r", type(self).__name__, self.task.id, action)
            info["error"] = printable(f"the action could not be run: {type(e).__name__}: {e}")
        self.steps += 1
        terminated = self.done
        truncated = not terminated and self.steps >= self.max_steps
        reward = 0.0
        try:
            if terminated or truncated:
                self.done = True
                reward = float(self.task.validate(self))
                info["success"] = reward >= 1.0
            obs = self.observe()
        except WorkspaceError as e:
            return self._workspace_failed(e, info, t0)
        self.last_step_timing = {**self._timing, "step_s": time.perf_counter() - t0}
        return obs, reward, terminated, truncated, info

    def _check_workspace(self) -> None:
        """WorkspaceClosed if the live workspace died or lost its uffd monitor (it is then
        stopped: it must not read stale memory). Families that reach the workspace through
        their own channels (X, the browser driver) would not notice the latter."""
        check = getattr(self._ws, "check", None)  # test doubles may have none
        if check is not None:
            check()

    def abandon(self) -> None:
        """Its workspace is about to be killed on purpose (a cancelled speculation kills its
        fork's processes): a step that fails because of it ends as any failed step does, but is
        logged at debug level, not warned about as a failure. Not locked: it is called while a
        step runs."""
        self._abandoned = True

    def _workspace_failed(self, error: Exception, info: dict, t0: float):
        """The end of an episode whose workspace failed mid-step."""
        message = printable(f"the workspace failed: {error}")
        log.log(logging.DEBUG if self._abandoned else logging.WARNING, "%s: task %s: %s", type(self).__name__,
                self.task.id if self.task else None, message)
        self.steps += 1
        self.done = True
        info.update(error=message, workspace_failed=True, success=False)
        self.last_step_timing = {**self._timing, "step_s": time.perf_counter() - t0}
        return self.error_observation(message), 0.0, False, True, info

    @_locked
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ws is not None:
            self.release_connections()
            self._ws.close()
            self._ws = None
        self._pending = None
        self._owned.release()
        super().close()

    def _check_open(self) -> None:
        if self._closed:
            raise ResetNeeded(f"{type(self).__name__} is closed")

    def _fresh_workspace(self) -> None:
        if self._ws is None and self._boot_snap is not None:
            self._pending = None  # a lazy clone resets by forking the boot snapshot
            self._ws = self._boot_snap.fork(1, mode=self.memory_mode)[0]
            return
        if self._ws is not None and self._boot_snap is not None:
            self.release_connections()
            self._ws.rollback(self._boot_snap)
            return
        if self._ws is not None:
            self._ws.close()
            self._ws = None
        key = self._boot_key()
        if key is None:
            self._ws = self._factory(self.image, self.memory_mode)
            self._boot_snap = self._boot_here()
            self._owned.snapshots.append(self._boot_snap)
            return
        self._boot_snap = boots.acquire(key, self._boot_alone)
        self._owned.boot_key = key
        self._ws = self._boot_snap.fork(1, mode=self.memory_mode)[0]

    def _boot_here(self) -> Any:
        """Boot the live workspace and snapshot it; returns the snapshot."""
        self.boot(self._ws)
        self.release_connections()
        # held: released by the env (or the boots it is shared through) when done; by gc if we crash
        return self._ws.snapshot(tags={"env": type(self).__name__, "boot": True}, held=True)

    def _boot_alone(self) -> Any:
        """A boot snapshot made in a workspace of its own, closed after (what a shared boot
        snapshot is made by: every env of the kind then starts from a fork of it alike)."""
        self._ws = self._factory(self.image, self.memory_mode)
        try:
            return self._boot_here()
        finally:
            self.release_connections()
            ws, self._ws = self._ws, None
            ws.close()

    def _boot_key(self) -> tuple | None:
        """The kind of boot snapshot this env may share, or None (:meth:`boot_config`)."""
        if not self._share_boot:
            return None
        config = self.boot_config()
        if config is None:
            return None
        return (type(self).__module__, type(self).__qualname__, self.image_key(), self.memory_mode, self.hostname,
                repr(Limits.parse(self._limits)), repr(sorted(config.items())))

    @_locked
    def park(self, state: EnvSnapshot | None = None) -> None:
        """Close the live workspace, keeping its state: the env forks it back from a snapshot
        on first use, as a lazy clone does. An env that stays idle a while holds no memory
        meanwhile: a GRPO group's root, say, which nothing uses while its members run.

        Args:
            state: a snapshot of the live state already taken (the one lazy clones of this
                env fork); by default the reset snapshot if nothing was done since, else one
                is taken now.
        """
        self._check_open()
        if self._ws is None:
            return
        current = self._reset_is_current
        snap = state or self._dumped_state() or self.snapshot()
        self.release_connections()
        ws, self._ws, self._pending = self._ws, None, snap
        self._reset_is_current = current  # the pending state is still the reset's
        ws.close()

    def _dumped_state(self) -> EnvSnapshot | None:
        """The live state as already dumped, if it is: a parked or lazy env's pending
        snapshot, or the reset snapshot with nothing done since (it is taken after the
        reset's observation); None when the state exists only in the live workspace."""
        if self._ws is None:
            return self._pending
        return self._reset_snap if self._reset_is_current else None

    # fork API --------------------------------------------------------------------------
    @_locked
    def snapshot(self, *, keep: bool = False, **tags: Any) -> EnvSnapshot:
        """Snapshot the live episode (workspace + step count, task, env state).

        Args:
            keep: the caller owns the snapshot (``snap.workspace.delete()``); by default it is
                deleted when this env and all its clones are closed.
            **tags: metadata stored with the snapshot.
        """
        self._check_open()
        if self._ws is None and self._pending is not None:
            return self._pending  # a lazy clone's state is its pending snapshot
        self.release_connections()
        snap = self.workspace.snapshot(tags={"task": self.task.id if self.task else None, **tags}, held=not keep)
        if not keep:
            self._owned.snapshots.append(snap)
        return EnvSnapshot(snap, self.task, self.steps, self.done, copy.deepcopy(self.episode_state()))

    def disown(self, ws_snap: Any) -> None:
        """Hand a snapshot this env or a clone took (``snapshot()``, its ``workspace``) to
        another owner: none of them releases it on close any more. It stays held by this
        process (``bunshin gc`` releases it after a crash) until the new owner keeps it
        (``ws_snap.keep(by=...)``) or releases it."""
        if ws_snap in self._owned.snapshots:
            self._owned.snapshots.remove(ws_snap)

    @_locked
    def rollback(self, snapshot: EnvSnapshot | None = None) -> Any:
        """Return to a snapshot (default: the state right after the last reset); returns
        the observation there."""
        self._check_open()
        snap = snapshot or self._reset_snap
        if snap is None:
            raise ResetNeeded("nothing to roll back to: reset() first (with reset_snapshot=True) "
                              "or pass a snapshot")
        self._reset_is_current = False
        if self._ws is None:
            self._pending = snap  # lazy: fork it when the workspace is first needed
        else:
            self.release_connections()
            self._ws.rollback(snap.workspace)
        self.task, self.steps, self.done = snap.task, snap.steps, snap.done
        self.restore_episode_state(copy.deepcopy(snap.state))
        return self.observe()

    @_locked
    def clone(self, n: int = 1, *, mode: str | None = None, lazy: bool = False) -> list[WorkspaceEnv]:
        """``n`` envs forked from this env's live state: same episode, same step count;
        each evolves independently. Closing one never affects the others.

        Args:
            n: number of clones.
            mode: memory mode of the clones' workspaces (default: this env's).
            lazy: take one snapshot now and fork each clone's workspace only when it is
                first needed (a clone whose steps are all served from a cache never forks);
                right after a reset, with nothing done since, the reset snapshot is that state
                and no new one is taken.
        """
        self._check_open()
        state = self.episode_state()
        if lazy:
            if self._reset_is_current:
                self.release_connections()  # as before any clone: the twins copy this env's attributes
                snap = self._reset_snap
            else:
                snap = self.snapshot()
            workspaces = [None] * n
        else:
            self.release_connections()
            kept = self._dumped_state()  # forked as it is, not dumped again
            source = kept.workspace if kept is not None else self.workspace
            workspaces = source.fork(n, mode=mode or self.memory_mode)
        envs = []
        for ws in workspaces:
            twin = copy.copy(self)
            twin._ws, twin._pending = ws, (snap if lazy else None)
            twin.memory_mode = mode or self.memory_mode  # a lazy clone forks in it later
            twin._closed = False
            twin._reset_is_current = False  # its own workspace (or pending fork) from here on
            twin._lock = threading.RLock()
            twin._np_random = copy.deepcopy(self._np_random)
            twin.last_step_timing, twin._timing = {}, {}
            twin.restore_episode_state(copy.deepcopy(state))
            self._owned.envs += 1
            envs.append(twin)
        return envs
