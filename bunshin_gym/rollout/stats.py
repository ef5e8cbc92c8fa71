"""Thread-safe counters shared by all the envs a cache or a speculation object serves."""

from __future__ import annotations

import threading


class Counted:
    """Mixin: ``self.stats`` (a dataclass of numbers) updated under a lock by :meth:`count`."""

    stats: object

    def count(self, **deltas: float) -> None:
        lock = self.__dict__.setdefault("_count_lock", threading.Lock())
        with lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)
