"""Thread-safe counters shared by all the envs a cache or a speculation object serves, and
the prefix cache's statistics (hits, replays, restores and what they cost)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

#: what a restore is assumed to cost (seconds) before any has been measured: hot (the
#: snapshot's images resident in memory) and cold (read back from disk)
PRIOR_RESTORE_S = {True: 0.3, False: 0.6}
#: what a restore that thaws a spare made ahead is assumed to cost before one is measured
PRIOR_SPARE_S = 0.05


class Counted:
    """Mixin: ``self.stats`` (a dataclass of numbers) updated under a lock by :meth:`count`."""

    stats: object

    def count(self, **deltas: float) -> None:
        lock = self.__dict__.setdefault("_count_lock", threading.Lock())
        with lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    replays: int = 0  # calls re-executed to bring a workspace to an episode's position
    replay_s: float = 0.0
    restores: int = 0
    snapshots: int = 0
    snapshot_s: float = 0.0
    snapshots_skipped: int = 0  # not taken: they would spare less replay than they cost
    # of those, the ones not taken because a restore of them would be declined (restores_declined)
    snapshots_too_large: int = 0
    # bytes a restore of each snapshot taken would have copied onto the tmpfs (share clones
    # served by uffd map such a copy; 0 elsewhere), measured when it was taken
    snapshot_copy_bytes: int = 0
    # restores of a resident (hot) snapshot and of one read back from disk (cold), and their time
    restores_hot: int = 0
    restore_hot_s: float = 0.0
    restores_cold: int = 0
    restore_cold_s: float = 0.0
    # restores that were the quickest start but would have made a tmpfs copy of page images
    # beyond the cache's memory budget: the calls were replayed from a start mapped anyway
    restores_declined: int = 0
    # restores that thawed a spare made ahead (rollout/spare_supply.py), and their time;
    # spares made, and those whose restore failed
    restores_spare: int = 0
    restore_spare_s: float = 0.0
    spares_made: int = 0
    spares_failed: int = 0
    # replayed calls whose observation differed from the recorded one: never served again
    nondeterministic: int = 0
    off_tree: int = 0  # episodes that went on without the cache after such a difference
    # group resets served from a task's kept start (PrefixCache.kept_start): no set-up run
    starts_served: int = 0

    @property
    def served(self) -> int:
        return self.hits

    def _measured(self, hot: bool) -> float | None:
        n, total = (self.restores_hot, self.restore_hot_s) if hot else (self.restores_cold, self.restore_cold_s)
        return total / n if n else None

    def restore_cost(self, hot: bool) -> float:
        """Mean measured seconds of a hot or cold restore. Until one of a kind is measured, it
        is the other kind's mean scaled by the priors' ratio (a cold restore reads what a hot
        one has in memory: never assumed cheaper than a measured hot one), or the prior."""
        mine = self._measured(hot)
        if mine is not None:
            return mine
        other = self._measured(not hot)
        if other is not None:
            return other * PRIOR_RESTORE_S[hot] / PRIOR_RESTORE_S[not hot]
        return PRIOR_RESTORE_S[hot]

    def spare_cost(self) -> float:
        """Mean measured seconds of a restore that took a spare (before any: the prior)."""
        return self.restore_spare_s / self.restores_spare if self.restores_spare else PRIOR_SPARE_S

    def as_dict(self) -> dict:
        total = self.hits + self.misses
        return {**vars(self), "hit_rate": round(self.hits / total, 3) if total else 0.0,
                "restore_hot_mean_s": round(self.restore_cost(True), 4),
                "restore_cold_mean_s": round(self.restore_cost(False), 4),
                "restore_spare_mean_s": round(self.spare_cost(), 4)}
