"""Spares for the prefix cache's hot snapshots: a restore made ahead, while the policy thinks.

A member that leaves the cached tree is brought to its position by a restore of the nearest
cached snapshot (or by replays). A restore is CRIU's work (0.4-0.9 s of a desktop's here),
paid on the member's path. For a snapshot the cache keeps hot, :class:`SpareSupply` keeps one
clone of it restored ahead of time and frozen (:mod:`bunshin_gym.workspace.spares`); the
member's restore then thaws and swaps it in, and another spare is made in the background.

Spares are workspaces: their memory is the run's (measured with its workspaces), and they are
made only while the snapshots the cache keeps resident plus the spares fit the cache's memory
budget. A snapshot evicted from memory loses its spares (``residency``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bunshin_gym.errors import BunshinError
from bunshin_gym.workspace import spares
from bunshin_gym.workspace.snapshot import SnapshotStore

logger = logging.getLogger(__name__)


class SpareSupply:
    """Keeps one frozen spare per hot cached snapshot, within a memory budget.

    Args:
        residency: the cache's :class:`~bunshin_gym.rollout.residency.Residency` (what is hot,
            its bytes and the budget both share).
        count: the cache's counter (``spares_made``, ``spares_failed``).
    """

    def __init__(self, residency: Any, count: Any):
        self.residency = residency
        self.count = count
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bunshin-spares")
        self._lock = threading.Lock()
        self._wanted: set[str] = set()  # snapshot ids with a spare being made
        self._mine: set[str] = set()  # snapshot ids this supply made spares of
        self.spare_bytes = 0  # the last spare's measured memory: what the next one is expected to add
        self._closed = False

    def has(self, snap_id: str | None) -> bool:
        return bool(snap_id) and spares.count(snap_id) > 0

    def pids(self, snap_id: str) -> set[int]:
        """PID 1 of each spare of the snapshot (a restore that swapped one in runs on it)."""
        return spares.pids(snap_id)

    def want(self, node: Any, mode: str) -> None:
        """Make a spare of ``node``'s snapshot in the background, unless it has one (or one is
        being made), it is not hot, or a spare would not fit the memory budget."""
        snap_id = getattr(node, "snapshot", None)
        if not snap_id or self._closed or not self.residency.is_resident(node):
            return
        with self._lock:
            if snap_id in self._wanted or spares.count(snap_id):
                return
            expected = self.spare_bytes or self.residency.sizes.get(node, 0)
            if self.residency.resident_bytes + spares.memory_bytes() + expected > self.residency.budget:
                return
            self._wanted.add(snap_id)
            self._mine.add(snap_id)
        self._pool.submit(self._make, node, snap_id, mode)

    def _make(self, node: Any, snap_id: str, mode: str) -> None:
        try:
            SnapshotStore().get(snap_id).prepare_spares(1, mode=mode)
            self.spare_bytes = max(self.spare_bytes, spares.memory_bytes(snap_id))
            self.count(spares_made=1)
            if not self.residency.is_resident(node) or getattr(node, "snapshot", None) != snap_id:
                spares.discard(snap_id)  # evicted (or dropped) while it was made
        except (BunshinError, OSError) as e:
            self.count(spares_failed=1)
            logger.warning("prefix cache: a spare of snapshot %s failed (%s); restores of it go on without", snap_id, e)
        finally:
            with self._lock:
                self._wanted.discard(snap_id)

    def close(self) -> None:
        """Wait for the spare being made, then reclaim every spare this supply made."""
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            mine, self._mine = set(self._mine), set()
        for snap_id in mine:
            spares.discard(snap_id)
