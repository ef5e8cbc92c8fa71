"""The ``copy`` memory mode: a stock CRIU restore, every page copied into the clone, with the
clone's writes tracked (:mod:`.tracking`) so that its snapshots can be deltas."""

from __future__ import annotations

from bunshin_gym.config import Paths
from bunshin_gym.workspace.memory import tracking
from bunshin_gym.workspace.memory.base import MemoryBackend, RestorePlan, SnapshotRef
from bunshin_gym.workspace.records import Record


class CopyBackend(MemoryBackend):
    """Nothing shared: the base class's defaults plus write tracking."""

    name = "copy"

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        return RestorePlan(images=snap.criu_dir, env=tracking.start(rec, p))

    def can_dump_delta(self, rec: Record, parent_id: str, p: Paths) -> bool:
        return tracking.can_dump_delta(rec, parent_id, p)

    def on_stop(self, rec: Record, p: Paths) -> None:
        tracking.stop(rec, p)
