"""Speculative tool execution: run the predicted next calls in a fork while the policy thinks.

After each step, :class:`SpeculativeWrapper` asks the :class:`SpecToolSelector` for the
next ``depth`` calls. If the first of them is slow by the recorded timings (tail-aware:
fast calls are not worth a fork), it forks the env and runs the chain there in the
background. When the actual call is known it is compared with the chain:

- **match**: the speculated observation is returned and the fork's state adopted; only
  what remains of the call is waited for (a call not yet started is not waited for);
- **mismatch**: the chain is discarded and the actual call runs from the last valid state
  (the env's own, untouched workspace).

Speculative forks have no external network (workspaces only have ``lo``).

Example:
    >>> spec = Speculation(SpecToolSelector.load("selector.npz"), durations=TrajectoryLog.durations(log))
    >>> env = spec.wrap(gym.make("Bunshin-Shell-v0"))
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from bunshin_gym.core.env import EnvSnapshot
from bunshin_gym.core.wrappers import BunshinWrapper
from bunshin_gym.rollout.selector import SpecToolSelector
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.stats import Counted


@dataclass
class SpecStats:
    launched: int = 0  # chains started
    skipped_fast: int = 0  # predictions not worth a fork
    skipped_cached: int = 0  # predictions an outer prefix cache will serve anyway
    matched: int = 0  # actual calls served by speculation
    mismatched: int = 0
    unstarted: int = 0  # predicted right but the fork was not ready: ran normally
    fork_s: float = 0.0

    def as_dict(self) -> dict:
        done = self.matched + self.mismatched
        return {**vars(self), "accuracy": round(self.matched / done, 3) if done else 0.0}


class Speculation(Counted):
    """Shared configuration and statistics of speculative execution.

    Args:
        selector: the trained Spec Tool Selector.
        depth: calls speculated ahead (K); beyond the first, the fork is snapshotted after
            each call so a later match can adopt the state at that point.
        durations: recorded median duration of each signature (``TrajectoryLog.durations``).
        min_duration: speculate only when the predicted call took at least this long.
    """

    def __init__(self, selector: SpecToolSelector, *, depth: int = 1, durations: dict[str, float] | None = None,
                 min_duration: float = 0.3):
        self.selector = selector
        self.depth = max(1, depth)
        self.durations = durations or {}
        self.min_duration = min_duration
        self.stats = SpecStats()

    def wrap(self, env: gym.Env) -> SpeculativeWrapper:
        return SpeculativeWrapper(env, self)



@dataclass
class _Call:
    sig: str
    action: Any
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None
    state: EnvSnapshot | None = None  # the fork's state after this call (chains deeper than 1)


class _Chain:
    def __init__(self, calls: list[_Call]):
        self.calls = calls
        self.pos = 0  # next call to compare
        self.fork: Any = None  # the forked env
        self.cancelled = threading.Event()
        self.future: Future | None = None


class SpeculativeWrapper(BunshinWrapper):
    """Runs predicted calls in a fork (see the module docs)."""

    def __init__(self, env: gym.Env, spec: Speculation):
        super().__init__(env)
        self.speculation = spec
        self.history: list[str] = []
        self.cached: set[str] = set()  # calls an outer prefix cache serves from here
        self._chain: _Chain | None = None
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculation")
        self._discards: list[threading.Thread] = []

    def _rewrap(self, inner: gym.Env) -> SpeculativeWrapper:
        twin = SpeculativeWrapper(inner, self.speculation)
        twin.history = list(self.history)
        return twin

    def reset(self, **kwargs: Any):
        self.cancel_speculation()
        obs, info = self.env.reset(**kwargs)
        self.start_episode(obs, info)
        return obs, info

    def start_episode(self, obs: Any, info: dict) -> None:
        self.cancel_speculation()
        self.history = []
        self._launch(obs)

    def rollback(self, snapshot=None, **kwargs: Any):
        self.cancel_speculation()
        return super().rollback(snapshot, **kwargs)

    def step(self, action: Any):
        sig = signature(action, self.env)
        served = self._take(sig)
        if served is None:
            obs, reward, term, trunc, info = self.env.step(action)
        else:
            obs, reward, term, trunc, info = served
            info = dict(info, speculation="hit")
        self.history.append(sig)
        if not (term or trunc):
            self._launch(obs)
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

    def set_cached(self, sigs: set[str]) -> None:
        self.cached = set(sigs)

    def cancel_speculation(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.cancelled.set()
            self._discard(chain)

    def close(self) -> None:
        self.cancel_speculation()
        self._bg.shutdown(wait=True)
        for t in self._discards:
            t.join()
        super().close()

    # internals -------------------------------------------------------------------------
    def _take(self, sig: str) -> tuple | None:
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
        chain.pos += 1
        last = chain.pos == len(chain.calls)
        if last:  # the fork is idle at exactly this state: adopt its workspace
            chain.future.result()
            fork = chain.fork
            base.adopt(fork._ws, EnvSnapshot(None, fork.task, fork.steps, fork.done, fork.episode_state()))
            fork._ws = None
            self._chain = None
            self._discard(chain)
        else:  # the fork runs on: take the state recorded after this call
            base.rollback(call.state)
        self.speculation.count(matched=1)
        return call.result

    def _launch(self, obs: Any) -> None:
        base = self.env.unwrapped
        if base.task is None:
            return
        text = obs.get("output", "") if isinstance(obs, dict) else ""
        chain = self.speculation.selector.predict(base.task.id, self.history, text if isinstance(text, str) else "",
                                           k=self.speculation.depth)
        if not chain:
            return
        if chain[0][0] in self.cached:
            self.speculation.count(skipped_cached=1)
            return
        if self.speculation.durations.get(chain[0][0], 0.0) < self.speculation.min_duration:
            self.speculation.count(skipped_fast=1)
            return
        self._chain = _Chain([_Call(sig, action) for sig, action, _ in chain])
        self._chain.future = self._bg.submit(self._run, self._chain)
        self.speculation.count(launched=1)

    def _run(self, chain: _Chain) -> None:
        base = self.env.unwrapped
        t0 = time.perf_counter()
        # a lazy env (no workspace yet) is forked from its pending snapshot, not materialized
        (chain.fork,) = base.clone(1, lazy=not base.materialized)
        self.speculation.count(fork_s=time.perf_counter() - t0)
        for i, call in enumerate(chain.calls):
            if chain.cancelled.is_set():
                break
            call.started.set()
            try:
                call.result = chain.fork.step(call.action)
                if i < len(chain.calls) - 1 and not (call.result[2] or call.result[3]):
                    call.state = chain.fork.snapshot()
            except Exception:  # noqa: BLE001 - a failed speculation is just not served
                call.result = None
            finally:
                call.done.set()
            if call.result is None or call.result[2] or call.result[3]:
                break
        for call in chain.calls:  # never leave a waiter hanging
            call.started.set()
            call.done.set()

    def _discard(self, chain: _Chain) -> None:
        def close_fork() -> None:
            if chain.future is not None:
                chain.future.exception()  # wait for the background run to stop
            if chain.fork is not None:
                chain.fork.close()

        t = threading.Thread(target=close_fork, name="speculation-discard", daemon=True)
        t.start()
        self._discards = [d for d in self._discards if d.is_alive()] + [t]
