"""Speculative tool execution: run the predicted next calls in a fork while the policy thinks.

After a step, :class:`SpeculativeWrapper` asks the :class:`SpecToolSelector` for the next
``depth`` (K) calls, from the episode's calls so far and its last observation. It forks the
env and runs the chain there in the background, snapshotting the fork after each call but
the last, when the first call is slow enough to be worth a fork. That is tail-aware, from
the trajectory log: a call qualifies when its recorded median duration reaches a
threshold, and the threshold is lower for the samples that make an epoch's tail: tasks
whose episodes historically take longer than the median task's, and an episode that has
already run longer than its task's median episode (a straggler now). Each actual call is compared with the
chain's next one (by :func:`signature` under the env's rules):

- **match**: the speculated observation is returned and the state after that call adopted
  (the snapshot recorded after it, or the fork's own workspace after the chain's last
  call); only what remains of the call is waited for (a call not yet started is not
  waited for). No new chain starts while one is still ahead of the actual calls.
- **mismatch**: the chain is dropped: every process of the fork is killed at once (the
  command running there does not run to its end) and the fork is closed in the
  background; the actual call runs from the last valid state, the env's own workspace,
  and nothing the chain ran after the last match is adopted.

Time: a fork is worth launching only if it is ready before the policy sends its next call.
The wrapper times the policy's turns (from an observation returned to the next call) and the
forks (until ready, cancelled ones too); once a few of each are measured, a prediction whose
fork is expected to come later than the call (median against median) is skipped
(``stats.skipped_slow_fork``), as on a loaded host where a desktop fork takes seconds and a
turn one: such a fork only costs (``unstarted``). One such prediction in
:data:`RETRY_EVERY` is launched all the same, so that forks are timed again as the load changes.

Speculative forks have no external network (workspaces only have ``lo``).

Memory: the live speculative forks of a run, with the snapshots they hold (the fork's own
page images, the states recorded after its calls), can be bounded by a budget sized from the
run (``memory_fraction=``, :data:`MEMORY_FRACTION` for a Full run within 5% of one without
speculation or cache, as ``bunshin bench epoch`` runs it: a share of the peak memory of the
process's workspaces), or fixed (``memory_budget=``); by default they are not bounded (a
run of a few workspaces could not speculate at all under a share of its memory). Bounded,
a chain is launched only when the bytes its fork is expected to cost (the mean that earlier
forks measured, at first an average workspace of the run) fit beside those held; else it
is skipped (``stats.skipped_memory``). A fork's bytes are held until it is closed, or until
a member adopts it (its workspace is then that member's). Either way, the snapshots recorded
after a chain's calls are released when the chain is dropped or done (a workspace rolled
back to one keeps it until it moves on), not kept to the episode's end.

Example:
    >>> spec = Speculation(SpecToolSelector.load("selector.npz"), durations=TrajectoryLog.durations(log))
    >>> env = spec.wrap(gym.make("Bunshin-Shell-v0"))
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from bunshin_gym.core.env import EnvSnapshot
from bunshin_gym.core.wrappers import BunshinWrapper
from bunshin_gym.errors import SnapshotError, WorkspaceError
from bunshin_gym.rollout.observation import observation_text
from bunshin_gym.rollout.runmemory import RunBudget, run_bytes, workspace_memory
from bunshin_gym.rollout.selector import SpecToolSelector
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.stats import Counted
from bunshin_gym.rollout.trajlog import TrajectoryLog

logger = logging.getLogger(__name__)

#: the speculative forks' share of the run's peak memory (with the prefix cache's 2%, a
#: Full run stays within 5% of one without either, the paper's +1 GiB over 69 GiB)
MEMORY_FRACTION = 0.03
#: forks and policy turns measured before a fork slower than the policy's turn is refused
TIMING_WARMUP = 5
#: of the predictions refused for a slow fork, one in this many is launched all the same, so
#: that fork times are measured again (the load, and with it the fork's time, changes)
RETRY_EVERY = 10


@dataclass
class SpecStats:
    launched: int = 0  # chains started
    skipped_fast: int = 0  # predictions not worth a fork
    skipped_cached: int = 0  # predictions an outer prefix cache will serve anyway
    matched: int = 0  # actual calls served by speculation
    mismatched: int = 0
    unstarted: int = 0  # predicted right but the fork was not ready: ran normally
    skipped_memory: int = 0  # predictions whose fork did not fit in the memory budget
    skipped_slow_fork: int = 0  # predictions whose fork would be ready only after the policy's call
    fork_s: float = 0.0

    def as_dict(self) -> dict:
        done = self.matched + self.mismatched
        return {**vars(self), "accuracy": round(self.matched / done, 3) if done else 0.0}


class ForkTiming:
    """How long speculative forks take to be ready and the policy takes to send a call: the
    latest of each, to tell whether a fork comes before the call it is made for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # members' threads note timings while one reads them
        self._forks: deque[float] = deque(maxlen=64)
        self._turns: deque[float] = deque(maxlen=256)
        self._refused = 0

    def note_fork(self, seconds: float) -> None:
        """A speculative fork took this long to be ready (cancelled ones count: they measure the load)."""
        with self._lock:
            self._forks.append(seconds)

    def note_turn(self, seconds: float) -> None:
        """The policy sent a call this long after the previous observation was returned."""
        with self._lock:
            self._turns.append(seconds)

    @property
    def turns(self) -> list[float]:
        with self._lock:
            return list(self._turns)

    def fork_beats_policy(self) -> bool:
        """Whether a fork is expected to be ready before the policy's next call: the median of
        the latest forks' times against the median of the policy's turns. A fork ready only
        after the call came is pure cost (``unstarted``: forked, then the call runs normally),
        as on a loaded host whose desktop forks take seconds while a turn takes one. True
        until both are measured (:data:`TIMING_WARMUP`), and for one refusal in
        :data:`RETRY_EVERY`, so that forks are timed again as the load changes."""
        with self._lock:
            forks, turns = list(self._forks), list(self._turns)
            if len(forks) < TIMING_WARMUP or len(turns) < TIMING_WARMUP:
                return True
            if statistics.median(forks) < statistics.median(turns):
                return True
            self._refused += 1
            return self._refused % RETRY_EVERY == 0


class Speculation(Counted):
    """Shared configuration and statistics of speculative execution.

    Args:
        selector: the trained Spec Tool Selector.
        depth: calls speculated ahead (K); beyond the first, the fork is snapshotted after
            each call so a later match can adopt the state at that point.
        durations: recorded median duration of each signature (``TrajectoryLog.durations``).
        min_duration: speculate only when the predicted call took at least this long (for a
            task of median slowness; see :meth:`threshold`).
        episode_times: recorded median tool time of an episode of each task
            (``TrajectoryLog.episode_times``): what makes a task or an episode slow.
        memory_budget: bytes the live speculative forks and their snapshots may hold.
        memory_fraction: instead, a budget sized from the run: this share of its peak memory
            (:data:`MEMORY_FRACTION` is what keeps a Full run within 5% of share-base).
            With neither, speculation's memory is not bounded.
        run_memory: bytes the run uses now (default: this process's workspaces).
        timing: the forks' and the policy's times measured so far (a new Speculation for a
            new epoch, with a retrained selector, keeps what the last one measured).
    """

    #: the most the threshold is lowered for a slow task, and the factor for a straggler episode
    MAX_TASK_BOOST = 4.0
    STRAGGLER_BOOST = 2.0

    def __init__(self, selector: SpecToolSelector, *, depth: int = 1, durations: dict[str, float] | None = None,
                 min_duration: float = 0.3, episode_times: dict[str, float] | None = None,
                 memory_budget: int | None = None, memory_fraction: float | None = None,
                 run_memory: Callable[[], int] = run_bytes, timing: ForkTiming | None = None):
        self.selector = selector
        self.depth = max(1, depth)
        self.durations = durations or {}
        self.min_duration = min_duration
        self.episode_times = episode_times or {}
        self._median_episode = statistics.median(self.episode_times.values()) if self.episode_times else 0.0
        self.stats = SpecStats()
        if memory_budget is not None and memory_fraction is not None:
            raise ValueError("Speculation: give memory_budget (bytes) or memory_fraction (of the run), not both")
        self.memory = None if memory_budget is None and memory_fraction is None else \
            RunBudget(memory_budget, fraction=memory_fraction or 0.0, run_memory=run_memory)
        self._held: dict[int, int] = {}  # bytes each live fork holds (or is expected to), by chain
        self._fork_costs: list[int] = []  # bytes measured of forks so far
        self._memory_lock = threading.Lock()
        self.timing = timing or ForkTiming()

    @classmethod
    def from_log(cls, entries: list[dict], selector: SpecToolSelector | None = None, **kwargs: Any) -> Speculation:
        """Speculation configured from a trajectory log: the selector trained on it (unless
        given), the calls' durations and the tasks' episode times."""
        return cls(selector or SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                   episode_times=TrajectoryLog.episode_times(entries), **kwargs)

    def threshold(self, task: str, elapsed: float = 0.0) -> float:
        """Seconds a predicted call must have taken to be speculated, for an episode of
        ``task`` that has spent ``elapsed`` seconds in tools so far."""
        t = self.min_duration
        mine = self.episode_times.get(task)
        if mine is None or self._median_episode <= 0:
            return t
        t /= min(self.MAX_TASK_BOOST, max(1.0, mine / self._median_episode))  # a historically slow task
        if elapsed > mine:  # this episode runs longer than the task's usual: a straggler
            t /= self.STRAGGLER_BOOST
        return t

    def wrap(self, env: gym.Env) -> SpeculativeWrapper:
        return SpeculativeWrapper(env, self)

    # memory of the live forks ------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes the live speculative forks hold (as measured, or expected until measured)."""
        with self._memory_lock:
            return sum(self._held.values())

    def fork_cost(self) -> int:
        """Bytes a speculative fork is expected to hold: the mean of those measured, or
        before any, an average workspace of the run."""
        with self._memory_lock:
            if self._fork_costs:
                return int(statistics.fmean(self._fork_costs))
        parts = workspace_memory()
        return (parts["cgroups"] + parts["page_images"] + parts["monitors"]) // max(1, parts["workspaces"])

    def reserve(self, key: int, size: int) -> bool:
        """Hold ``size`` bytes for a fork if they fit in the budget beside those held."""
        budget = self.memory.budget if self.memory is not None else None
        with self._memory_lock:
            if budget is not None and sum(self._held.values()) + size > budget:
                return False
            self._held[key] = size
            return True

    def measured(self, key: int, size: int, *, final: bool = False) -> None:
        """A fork's bytes, measured: they replace what was expected of it; a ``final`` one
        (its chain ran to its end) also sizes the forks to come."""
        with self._memory_lock:
            if key in self._held:
                self._held[key] = size
            if final:
                self._fork_costs.append(size)

    def release(self, key: int) -> None:
        """The fork is gone (or adopted): its bytes are no longer speculation's."""
        with self._memory_lock:
            self._held.pop(key, None)



@dataclass
class _Call:
    sig: str
    action: Any
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None
    seconds: float = 0.0  # what the call took in the fork
    state: EnvSnapshot | None = None  # the fork's state after this call, when more calls follow it


class _Chain:
    """The K predicted calls of one speculation and the fork that runs them, in order."""

    def __init__(self, calls: list[_Call]):
        self.calls = calls
        self.pos = 0  # next call to compare
        self.last_run = -1  # index of the last call the fork ran to its end (its workspace is there)
        self.fork: Any = None  # the forked env
        self.own_images = False  # the fork was dumped for this chain (not a lazy env's pending snapshot)
        self.cancelled = threading.Event()
        self.finished = threading.Event()  # the background run is over (ran, failed or was stopped)


class SpeculativeWrapper(BunshinWrapper):
    """Runs predicted calls in a fork (see the module docs)."""

    def __init__(self, env: gym.Env, spec: Speculation):
        super().__init__(env)
        self.speculation = spec
        self.history: list[str] = []
        self.elapsed = 0.0  # seconds this episode's calls took (served ones: as recorded)
        self.cached: set[str] = set()  # calls an outer prefix cache serves from here
        self._chain: _Chain | None = None
        self._served_s = 0.0  # fork seconds of the call _take served last
        self._threads: list[threading.Thread] = []  # chain runs and fork discards under way
        self._returned_at: float | None = None  # when the last observation went to the policy

    def _rewrap(self, inner: gym.Env) -> SpeculativeWrapper:
        twin = SpeculativeWrapper(inner, self.speculation)
        twin.history, twin.elapsed = list(self.history), self.elapsed
        return twin

    def reset(self, **kwargs: Any):
        self.cancel_speculation()
        obs, info = self.env.reset(**kwargs)
        self.start_episode(obs, info)
        return obs, info

    def start_episode(self, obs: Any, info: dict) -> None:
        self.cancel_speculation()
        self.history, self.elapsed = [], 0.0
        self._launch(obs)
        self._returned_at = time.perf_counter()

    def rollback(self, snapshot=None, **kwargs: Any):
        self.cancel_speculation()
        return super().rollback(snapshot, **kwargs)

    def step(self, action: Any):
        sig = signature(action, self.env)
        t0 = time.perf_counter()
        if self._returned_at is not None:  # the policy's turn: what a fork has to beat
            self.speculation.timing.note_turn(t0 - self._returned_at)
        served = self._take(sig)
        if served is None:
            obs, reward, term, trunc, info = self.env.step(action)
            self.elapsed += time.perf_counter() - t0
        else:
            self.elapsed += self._served_s
            obs, reward, term, trunc, info = served
            # speculation_s: what the call took in the fork (the time its log entry records)
            info = dict(info, speculation="hit", speculation_s=self._served_s)
        self.history.append(sig)
        if not (term or trunc) and self._chain is None:  # a chain under way keeps running ahead
            self._launch(obs)
        self._returned_at = None if term or trunc else time.perf_counter()
        return obs, reward, term, trunc, info

    def wait_speculation(self, timeout: float = 60.0) -> bool:
        """Block until the speculated next call has run (or no speculation is under way);
        returns whether one is ready. For tests and for policies that know they are slow."""
        chain = self._chain
        if chain is None or chain.pos >= len(chain.calls):
            return False
        return chain.calls[chain.pos].done.wait(timeout) and chain.calls[chain.pos].result is not None

    def skip_call(self, sig: str) -> None:
        """An outer wrapper served this call: no speculation now, but remember the call."""
        self.cancel_speculation()
        self.history.append(sig)
        self.elapsed += self.speculation.durations.get(sig, 0.0)
        self._returned_at = time.perf_counter()  # the outer wrapper returns its served call now

    def set_cached(self, sigs: set[str]) -> None:
        self.cached = set(sigs)

    def cancel_speculation(self) -> None:
        """Drop the chain under way: its fork's running command is killed now (not left to
        run to its end), and the fork is closed in the background."""
        chain, self._chain = self._chain, None
        if chain is not None:
            _stop(chain)
            self._discard(chain)

    def close(self) -> None:
        self.cancel_speculation()
        for t in self._threads:
            t.join()
        super().close()

    # internals -------------------------------------------------------------------------
    def _take(self, sig: str) -> tuple | None:
        """The speculated result of the actual call ``sig`` (its state adopted), or None."""
        chain = self._chain
        if chain is None:
            return None
        call = chain.calls[chain.pos] if chain.pos < len(chain.calls) else None
        if call is None or call.sig != sig:
            self.speculation.count(mismatched=1)
            self.cancel_speculation()
            return None
        if not call.started.is_set():  # the fork is not even ready: running here is faster
            self.speculation.count(unstarted=1)
            self.cancel_speculation()
            return None
        call.done.wait()
        if call.result is None:  # the speculative run failed: run it for real
            self.cancel_speculation()
            return None
        base = self.env.unwrapped
        pos, chain.pos = chain.pos, chain.pos + 1
        if call.state is not None:  # the fork runs on: take the state recorded after this call
            base.rollback(call.state)
        else:  # no state was recorded after it: adopt the fork's workspace if it stopped here
            chain.finished.wait()
            fork = chain.fork
            if chain.last_run != pos or fork is None or fork._ws is None:
                self.cancel_speculation()
                return None
            # the fork's connections into the workspace (a browser driver, X) go with it: the
            # env adopting it opens its own, and a leftover one blocks its driver and snapshots
            fork.release_connections()
            base.adopt(fork._ws, EnvSnapshot(None, fork.task, fork.steps, fork.done, fork.episode_state()))
            fork._ws = None
            self.cancel_speculation()
        self.speculation.count(matched=1)
        self._served_s = call.seconds
        return call.result

    def _launch(self, obs: Any) -> None:
        base = self.env.unwrapped
        if base.task is None:
            return
        chain = self.speculation.selector.predict(base.task.id, self.history, observation_text(obs),
                                                  k=self.speculation.depth)
        if not chain:
            return
        # the selector's signatures may come from a log written without the env: compare the
        # actual calls with the predicted actions' signatures under this env's rules
        calls = [_Call(signature(action, self.env), action) for _, action, _ in chain]
        if calls[0].sig in self.cached:
            self.speculation.count(skipped_cached=1)
            return
        if self.speculation.durations.get(chain[0][0], 0.0) < self.speculation.threshold(base.task.id, self.elapsed):
            self.speculation.count(skipped_fast=1)
            return
        if not self.speculation.timing.fork_beats_policy():
            self.speculation.count(skipped_slow_fork=1)
            return
        chain = _Chain(calls)
        cost = self.speculation.fork_cost() if self.speculation.memory is not None else 0
        if not self.speculation.reserve(id(chain), cost):
            self.speculation.count(skipped_memory=1)
            return
        self._chain = chain
        self._spawn(self._run, chain, name="speculation")
        self.speculation.count(launched=1)

    def _run(self, chain: _Chain) -> None:
        try:
            self._run_chain(chain)
            if not chain.cancelled.is_set() and chain.fork is not None:  # a full run: what a fork costs
                self._measure(chain, final=True)
        finally:
            for call in chain.calls:  # never leave a waiter hanging
                call.started.set()
                call.done.set()
            chain.finished.set()

    def _run_chain(self, chain: _Chain) -> None:
        base = self.env.unwrapped
        t0 = time.perf_counter()
        # a lazy env (no workspace yet) is forked from its pending snapshot, not materialized
        try:
            chain.own_images = base.materialized  # a live workspace is dumped for the fork
            (chain.fork,) = base.clone(1, lazy=not base.materialized)
            chain.fork.workspace  # noqa: B018 - fork it now, so that a cancel can kill what runs in it
        except Exception:  # noqa: BLE001 - no fork, no speculation (the actual call runs normally)
            logger.debug("speculative fork failed", exc_info=True)
            return
        fork_s = time.perf_counter() - t0
        self.speculation.count(fork_s=fork_s)
        self.speculation.timing.note_fork(fork_s)
        self._measure(chain)
        for i, call in enumerate(chain.calls):
            if chain.cancelled.is_set():  # checked after the fork exists: _stop kills it otherwise
                return
            call.started.set()
            try:
                t0 = time.perf_counter()
                call.result = chain.fork.step(call.action)
                call.seconds = time.perf_counter() - t0
                if chain.cancelled.is_set() or call.result[4].get("workspace_failed"):
                    call.result = None  # killed by a cancel, or the fork failed: nothing to serve
                    return
                chain.last_run = i
                end = call.result[2] or call.result[3]
                if i < len(chain.calls) - 1 and not end:
                    # kept by the chain, not by the fork env (whose close would delete it while
                    # a member may still adopt it), released with the chain; held by this
                    # process meanwhile, so a crash leaves it to `bunshin gc`
                    call.state = chain.fork.snapshot()
                    chain.fork.disown(call.state.workspace)
            except Exception:  # noqa: BLE001 - a failed (or killed) speculation is just not served
                if not chain.cancelled.is_set():
                    logger.debug("speculative call %s failed", call.sig, exc_info=True)
                call.result, call.state = None, None
                return
            finally:
                call.done.set()
            if end:
                return

    def _measure(self, chain: _Chain, *, final: bool = False) -> None:
        """Measure what the chain's fork holds now: its workspace's memory, the page images
        dumped for it, its uffd monitor, the states recorded after its calls. Only under a memory
        bound: nothing else reads it, and it reads the fork's cgroup, images and monitors."""
        if self.speculation.memory is None:
            return
        try:
            size = _fork_bytes(chain.fork._ws, chain.own_images)
            size += sum(c.state.workspace.size() for c in chain.calls if c.state is not None)
        except (OSError, WorkspaceError, SnapshotError, AttributeError) as e:  # closed meanwhile
            logger.debug("measuring a speculative fork: %s", e)
            return
        self.speculation.measured(id(chain), size, final=final)

    def _discard(self, chain: _Chain) -> None:
        def close_fork() -> None:
            chain.finished.wait()  # the run stops at once: its fork's processes are dead
            try:
                if chain.fork is not None:
                    chain.fork.close()
                for call in chain.calls:  # a workspace rolled back to one keeps it while it needs it
                    if call.state is not None:
                        _release_snapshot(call.state.workspace)
            finally:
                self.speculation.release(id(chain))

        self._spawn(close_fork, name="speculation-discard")

    def _spawn(self, fn, *args: Any, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads = [d for d in self._threads if d.is_alive()] + [t]


def _fork_bytes(ws: Any, own_images: bool) -> int:
    """Bytes a live fork holds: its cgroup's charge, its uffd monitor's resident memory and,
    when it was dumped for the fork, its snapshot's page images."""
    from bunshin_gym.workspace.memstat import rollup
    from bunshin_gym.workspace.snapshot import SnapshotStore

    if ws is None or ws.closed:
        return 0
    total = ws.cgroup.memory_usage()
    monitor = ws._rec.uffd
    pids = [pid for pid in ((monitor.guard, monitor.worker) if monitor else ()) if pid]
    if pids:
        total += rollup(pids)["Rss"]
    if own_images and ws.base_snapshot:
        total += SnapshotStore().get(ws.base_snapshot).size()
    return total


def _release_snapshot(snap: Any) -> None:
    try:
        snap.release()
    except (SnapshotError, WorkspaceError) as e:  # gone already: `bunshin gc` deals with leftovers
        logger.debug("releasing speculative snapshot %s: %s", getattr(snap, "id", snap), e)


def _stop(chain: _Chain) -> None:
    """Cancel a chain and kill every process of its fork's workspace: the call running there
    (and the agent answering it) dies, so the fork's step fails at once instead of running on."""
    chain.cancelled.set()
    fork = chain.fork
    ws = getattr(fork, "_ws", None)
    if ws is None or getattr(ws, "closed", True) or chain.finished.is_set():
        return
    fork.abandon()  # its step fails now on purpose: no failure to warn about
    try:
        ws.cgroup.kill_all()
    except (OSError, WorkspaceError) as e:  # already gone: nothing runs there any more
        logger.debug("killing speculative fork %s: %s", ws.id, e)
