"""Which cached snapshots stay in memory: an ancestor-aware LRU under a byte budget.

A snapshot's images are "resident" (hot) while they stay in memory: in the page cache and,
for share restores, as the tmpfs copy that share clones map, kept by this process
(:func:`keep_copy`) after the clones that mapped it are gone, so that a restore of a hot
snapshot skips making it. Evicted, they go "to disk" (cold): written back and dropped from
the page cache with ``posix_fadvise(DONTNEED)``, and their tmpfs copy no longer kept (dropped
unless a running clone maps it). Restoring an evicted snapshot reads it back from the pool
and copies it again. A child snapshot's restore also
reads its ancestors' images (their page files are mapped in the ``share`` modes), so an
ancestor stays resident while any resident descendant needs it: touching a node touches
its ancestors, and only nodes without resident descendants are evicted.

The budget is sized from the run by default: :data:`AUTO_FRACTION` of the peak memory of the
workspaces this process runs (:func:`~bunshin_gym.rollout.runmemory.run_bytes`), so that a
prefix cache adds about that much to a run's memory. The paper's cache kept 1 GiB resident
over the 69 GiB its rollouts used (1.4%); a fixed byte budget can be given instead.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from bunshin_gym.rollout.runmemory import run_bytes
from bunshin_gym.workspace import spares

__all__ = ["AUTO_FRACTION", "Residency", "copy_bytes", "drop_snapshot", "keep_copy", "warm_snapshot"]

logger = logging.getLogger(__name__)

#: the default budget's share of the run's peak workspace memory (the paper's 1.4%, rounded
#: up; what the cached snapshots cost besides, the tmpfs copies of those being restored, is
#: counted in the workspaces' own memory)
AUTO_FRACTION = 0.02
#: seconds between two reads of the run's memory (a read walks the records and cgroups)
AUTO_REFRESH_S = 2.0


class Residency:
    """Args:
        budget: bytes of snapshot images kept resident; None sizes it from the run
            (``fraction`` of the peak of ``run_memory()``, read at most every
            :data:`AUTO_REFRESH_S` seconds as snapshots are added and used).
        fraction: the automatic budget's share of the run's peak memory.
        run_memory: bytes the run uses now (default: this process's workspaces).
    """

    def __init__(self, budget: int | None = None, *, fraction: float = AUTO_FRACTION,
                 run_memory: Callable[[], int] = run_bytes):
        if budget is not None and budget < 0:
            raise ValueError(f"residency budget must be >= 0 bytes or None (sized from the run), not {budget}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"residency fraction must be between 0 and 1, not {fraction}")
        self.fixed = budget
        self.fraction = fraction
        self.run_memory = run_memory
        self.run_peak = 0  # the most the run's workspaces used when the budget was last sized
        self._read_at = -math.inf
        self.sizes: dict[Any, int] = {}
        self.resident: OrderedDict[Any, None] = OrderedDict()  # least recently used first
        self.evictions = 0
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return int(self.fraction * self.run_peak)

    def sized_budget(self) -> int:
        """The budget, the automatic one sized from the run's memory as it is now."""
        self._size_from_run()
        return self.budget

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(self.sizes[n] for n in self.resident)

    def _size_from_run(self) -> None:
        """Raise the automatic budget with the run's peak (never lowered: a group's
        workspaces closing does not make the cache spill what the next group reuses)."""
        if self.fixed is not None:
            return
        now = time.monotonic()
        if now - self._read_at < AUTO_REFRESH_S:
            return
        self._read_at = now
        try:
            used = self.run_memory()
        except OSError as e:  # a workspace closing under the read: size it next time
            logger.debug("residency: reading the run's memory failed: %s", e)
            return
        self.run_peak = max(self.run_peak, used)

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
        self._size_from_run()
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
            kept = [n for n in chain if n in self.resident]
        for v in victims:
            _drop_from_memory(v)
        for n in kept:  # a copy a restore of it made stays after its clones are gone
            if getattr(n, "snapshot", None):
                keep_copy(n.snapshot)

    def bytes_outside(self, copied: Callable[[str], bool]) -> int:
        """Bytes of resident snapshots whose images are not ``copied`` (held in the page cache
        only; a kept tmpfs copy is counted with the run's page images)."""
        with self._lock:
            return sum(self.sizes[n] for n in self.resident
                       if not (getattr(n, "snapshot", None) and copied(n.snapshot)))

    def _over_budget(self) -> list:
        victims = []
        total = sum(self.sizes[n] for n in self.resident)
        budget = self.budget
        while total > budget:
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
    if getattr(node, "snapshot", None):
        spares.discard(node.snapshot)  # a restore made ahead of a cold snapshot: not kept either
        drop_snapshot(node.snapshot)


def keep_copy(snap_id: str, *, make: bool = False) -> bool:
    """Keep the snapshot's tmpfs copy of page images (what a share restore maps) while this
    process lives, mapped or not, so that restores of it skip copying; ``make`` copies it
    first where it is not there. Returns whether a copy is kept."""
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.workspace import uffd
    from bunshin_gym.workspace.snapshot import SnapshotStore

    if make and not uffd.has_image_copy(snap_id):
        try:
            snap = SnapshotStore().get(snap_id)
        except SnapshotError:
            return False
        uffd.prepare_images(snap.id, snap.criu_dir)
    # a stat first: most touches find no copy (copy-mode runs) or one kept already
    return uffd.has_image_copy(snap_id) and uffd.keep_images(snap_id)


def copy_bytes(snap_id: str) -> int:
    """Bytes a share restore of the snapshot would copy onto the tmpfs of page images: its
    own images and those of the ancestors its images link to (deltas), less the copies that
    are there already."""
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.workspace import uffd
    from bunshin_gym.workspace.snapshot import SnapshotStore

    store, total, sid = SnapshotStore(), 0, snap_id
    while sid and not uffd.has_image_copy(sid):
        try:
            snap = store.get(sid)
        except SnapshotError:
            break
        total += snap.size()
        link = snap.criu_dir / "parent"  # a delta's pages in parent are mapped from the parent's copy
        sid = link.resolve().parent.name if link.is_symlink() else None
    return total


def drop_snapshot(snap_id: str) -> None:
    """Make a snapshot cold: its images written back and dropped from the page cache, and
    its tmpfs copy no longer kept (dropped unless a running clone maps it)."""
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.workspace import uffd
    from bunshin_gym.workspace.snapshot import SnapshotStore

    uffd.keep_images(snap_id, keep=False)
    try:
        criu = SnapshotStore().get(snap_id).criu_dir
    except SnapshotError:
        return
    for f in criu.iterdir():
        if f.is_symlink() or not f.is_file():
            continue  # the link to the parent's images: the parent is a node of its own
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    uffd.release_images(snap_id=snap_id)


def warm_snapshot(snap_id: str) -> int:
    """Make a snapshot's images resident in the page cache (read them); returns the bytes read."""
    from bunshin_gym.errors import SnapshotError
    from bunshin_gym.workspace.snapshot import SnapshotStore

    try:
        criu = SnapshotStore().get(snap_id).criu_dir
    except SnapshotError:
        return 0
    total = 0
    for f in criu.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                total += len(chunk)
    return total
