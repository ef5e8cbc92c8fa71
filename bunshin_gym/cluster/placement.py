"""Where a GRPO group runs: prefix-aware (cache-aware routing) or random.

Prefix-aware is the rule of cache-aware routers for LLM KV caches: the host with the longest
cached match of the group's prefix (:meth:`SnapshotIndex.match`) unless its load is at the
threshold, else the least-loaded host. When the best holder is too loaded and the host
chosen instead holds no snapshot of that match, the holder's deepest snapshot is migrated
there first (``migrate_from``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bunshin_gym.cluster.index import SnapshotIndex

POLICIES = ("prefix", "random")


@dataclass(frozen=True)
class Decision:
    host: str
    reason: str  # "prefix", "least-loaded", "random", "overloaded-holder"
    depth: int = 0  # cached calls matched on the chosen host (before any migration)
    migrate_from: str | None = None  # copy ``snapshot`` from this host to ``host`` first
    snapshot: str | None = None


class Placer:
    """Args:
        policy: ``prefix`` or ``random``.
        threshold: groups a host may run before the prefix match gives way to the load.
        capacity: groups a host may run at once (no placement past it).
        migrate: copy the holder's snapshot when it is over the threshold.
        seed: the random policy's (and ties') seed.
    """

    def __init__(self, policy: str = "prefix", *, threshold: int = 2, capacity: int = 2, migrate: bool = True,
                 seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"unknown placement policy {policy!r} (known: {', '.join(POLICIES)})")
        if capacity < 1 or threshold < 1:
            raise ValueError(f"capacity and threshold must be >= 1, got {capacity} and {threshold}")
        self.policy, self.threshold, self.capacity, self.migrate = policy, threshold, capacity, migrate
        self.rng = random.Random(seed)

    def choose(self, task: str, loads: Mapping[str, int], index: SnapshotIndex,
               prefix: Sequence[str] = ()) -> Decision | None:
        """The host for a group of ``task``; None when every host is at capacity."""
        free = sorted(h for h, n in loads.items() if n < self.capacity)
        if not free:
            return None
        if self.policy == "random":
            return Decision(self.rng.choice(free), "random")
        least = min(free, key=lambda h: (loads[h], self.rng.random()))
        matches = [m for m in index.match(task, prefix) if m.host in loads]
        if not matches:
            return Decision(least, "least-loaded")
        best = min((m for m in matches if m.score == matches[0].score), key=lambda m: (loads[m.host], m.host))
        if loads[best.host] < min(self.threshold, self.capacity) or least == best.host:
            return Decision(best.host, "prefix", best.depth)  # (or it is the only host with room anyway)
        # the holder is too loaded: the least-loaded host, with the holder's snapshot if it lacks one
        mine = next((m for m in matches if m.host == least), None)
        if self.migrate and best.snapshot and (mine is None or mine.snapshot_depth < best.snapshot_depth):
            return Decision(least, "overloaded-holder", mine.depth if mine else 0, best.host, best.snapshot)
        return Decision(least, "overloaded-holder", mine.depth if mine else 0)
