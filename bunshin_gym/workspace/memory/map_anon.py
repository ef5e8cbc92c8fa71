"""The ``map-anon`` memory mode: anonymous memory too is mapped from the page image. UNSAFE,
opt-in: after ``MADV_DONTNEED`` such memory reads back the image's page instead of zeros
(chromium's and jemalloc's allocators crash on that)."""

from __future__ import annotations

from bunshin_gym.config import Paths
from bunshin_gym.workspace.memory.base import MemoryBackend, RestorePlan, SnapshotRef
from bunshin_gym.workspace.memory.share import mapped_pages_env
from bunshin_gym.workspace.records import Record


class MapAnonBackend(MemoryBackend):
    name = "map-anon"
    maps_images = True

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        return RestorePlan(images=snap.criu_dir, env={**mapped_pages_env(snap.id), "CRIU_MMAP_ANON": "1"})
