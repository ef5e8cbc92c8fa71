"""Which cached snapshots stay in memory: an ancestor-aware LRU under a byte budget.

A snapshot's images are "resident" while they stay in the page cache, and go "to disk"
when evicted (written back and dropped with ``posix_fadvise(DONTNEED)``); restoring an
evicted snapshot reads it back. A child snapshot's restore also reads its ancestors'
images (their page files are mapped in the ``share`` modes), so an ancestor stays
resident while any resident descendant needs it: touching a node touches its ancestors,
and only nodes without resident descendants are evicted.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any


class Residency:
    def __init__(self, budget: int):
        self.budget = budget
        self.sizes: dict[Any, int] = {}
        self.resident: OrderedDict[Any, None] = OrderedDict()  # least recently used first
        self.evictions = 0
        self._lock = threading.Lock()

    @property
    def resident_bytes(self) -> int:
        return sum(self.sizes[n] for n in self.resident)

    def add(self, node: Any, size: int) -> None:
        with self._lock:
            self.sizes[node] = size
        self.touch(node)

    def is_resident(self, node: Any) -> bool:
        with self._lock:
            return node in self.resident

    def drop(self, nodes: list) -> None:
        """Stop keeping these snapshots in memory (a subtree the cache no longer serves)."""
        with self._lock:
            gone = [n for n in nodes if n in self.resident]
            for n in gone:
                del self.resident[n]
        for n in gone:
            _drop_from_memory(n)

    def touch(self, node: Any) -> None:
        """Mark a snapshot (and its snapshotted ancestors) used now; evict over budget."""
        with self._lock:
            chain = []
            n = node
            while n is not None:
                if n in self.sizes:
                    chain.append(n)
                n = getattr(n, "parent", None)
            for n in reversed(chain):  # ancestors first: the node itself ends most recent
                self.resident[n] = None
                self.resident.move_to_end(n)
            victims = self._over_budget()
        for v in victims:
            _drop_from_memory(v)

    def _over_budget(self) -> list:
        victims = []
        total = sum(self.sizes[n] for n in self.resident)
        while total > self.budget:
            needed = set()
            for n in self.resident:
                p = getattr(n, "parent", None)
                while p is not None:
                    needed.add(p)
                    p = getattr(p, "parent", None)
            victim = next((n for n in self.resident if n not in needed), None)
            if victim is None:
                break
            del self.resident[victim]
            total -= self.sizes[victim]
            victims.append(victim)
            self.evictions += 1
        return victims


def _drop_from_memory(node: Any) -> None:
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.workspace.snapshot import SnapshotStore

    if not getattr(node, "snapshot", None):
        return
    try:
        criu = SnapshotStore().get(node.snapshot).criu_dir
    except SnapshotError:
        return
    for f in criu.iterdir():
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
