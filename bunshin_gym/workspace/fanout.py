"""How a fork restores its clones, and a record of where a fork's time went.

:class:`FanoutOptions` are the knobs of ``forking.restore_clones``: CRIU's log level for
restores, how many ``criu restore`` run at a time, and whether the work done once per fork
(the share mode's tmpfs copy of the images, the ``/.snap`` view) runs beside each clone's own
set-up (record, cgroup, file system, uffd monitor) instead of before it. :data:`BEFORE` is
the path as it was before these options (kept so that benchmarks compare the two in one run).

:class:`FanoutTrace` collects, for each fork made while :func:`tracing` is active, when each
phase of each clone started and ended; :meth:`FanoutTrace.phases` sums them up.

Example (what ``bunshin bench fork`` does):
    >>> with tracing() as trace, using(BEFORE):
    ...     clones = snap.fork(16)
    >>> trace.phases()["criu"]            # {"clones": 16, "sum_s": ..., "first_s": ..., "last_s": ...}
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FanoutOptions:
    """How a fork restores its clones."""

    #: CRIU's log level for restores. Debug (4) writes ~70,000 lines per desktop clone, and
    #: the writes and formatting were about a fifth of CRIU's CPU time in a 16-clone fan-out
    #: (perf); 2 keeps errors and warnings, all that a failed restore's message is made of
    restore_verbosity: int = 2
    #: at most this many ``criu restore`` run at a time (0: all of them). Measured on a
    #: 16-clone desktop fan-out on 2 CPUs shared with other work (load 27-39): all at once
    #: 10.6-11.2 s, 4 at a time 13.7-13.8 s, 2 at a time 19.5-21.4 s; each restore also
    #: waits (on the tools CRIU runs, the disk, the uffd monitor), and a CPU another restore
    #: can use meanwhile is not idle
    restores_at_once: int = 0
    #: the work done once per fork runs beside the clones' own set-up, not before it
    overlap_prepare: bool = True
    #: clones' set-ups (record, cgroup, file system, monitor) that run at a time
    setups_at_once: int = 8

    def restore_limit(self, n: int) -> int:
        """How many of ``n`` restores may run at once."""
        return n if self.restores_at_once <= 0 else min(n, self.restores_at_once)


#: today's fan-out
DEFAULT = FanoutOptions()
#: the fan-out before :class:`FanoutOptions` existed: debug logs, every restore at once, the
#: image copy and view made before any clone's set-up starts
BEFORE = FanoutOptions(restore_verbosity=4, restores_at_once=0, overlap_prepare=False)

_current = DEFAULT
_traces: list[FanoutTrace] = []
_lock = threading.Lock()


def current() -> FanoutOptions:
    """The options forks use now."""
    return _current


@contextlib.contextmanager
def using(options: FanoutOptions) -> Iterator[FanoutOptions]:
    """Forks made inside use ``options`` (in every thread of this process)."""
    global _current
    before, _current = _current, options
    try:
        yield options
    finally:
        _current = before


@dataclass
class FanoutTrace:
    """When each phase of each clone of the forks made while it was active began and ended
    (seconds since the trace began)."""

    t0: float = field(default_factory=time.perf_counter)
    events: list[tuple[str, str, float, float]] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str, clone: str = "") -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with _lock:
                self.events.append((name, clone, start - self.t0, time.perf_counter() - self.t0))

    def phases(self) -> dict[str, dict]:
        """Per phase, in the order phases first began: how many times it ran, the seconds
        summed over clones, and when its first run began and its last run ended."""
        out: dict[str, dict] = {}
        for name, _clone, a, b in sorted(self.events, key=lambda e: e[2]):
            row = out.setdefault(name, {"clones": 0, "sum_s": 0.0, "first_s": a, "last_s": b})
            row["clones"] += 1
            row["sum_s"] += b - a
            row["last_s"] = max(row["last_s"], b)
        return {k: {kk: round(v, 3) if isinstance(v, float) else v for kk, v in row.items()}
                for k, row in out.items()}


@contextlib.contextmanager
def tracing() -> Iterator[FanoutTrace]:
    """Record the phases of the forks made inside (by any thread of this process)."""
    trace = FanoutTrace()
    with _lock:
        _traces.append(trace)
    try:
        yield trace
    finally:
        with _lock:
            _traces.remove(trace)


@contextlib.contextmanager
def phase(name: str, clone: str = "") -> Iterator[None]:
    """Time one phase of a fork into every active trace (nothing when none is)."""
    with _lock:
        active = list(_traces)
    if not active:
        yield
        return
    with contextlib.ExitStack() as stack:
        for trace in active:
            stack.enter_context(trace.phase(name, clone))
        yield
