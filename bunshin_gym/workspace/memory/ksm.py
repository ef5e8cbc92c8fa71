"""The ``ksm`` memory mode: a copy restore whose tree is KSM-mergeable (``PR_SET_MEMORY_MERGE``,
inherited through exec), with ksmd tuned up while such clones run (:mod:`.ksmd`), and the
clone's writes tracked (:mod:`.tracking`) so that its snapshots can be deltas (a page ksmd
merges loses its write-protect bit: it is then dumped, never wrongly taken from the parent)."""

from __future__ import annotations

from bunshin_gym.config import Paths
from bunshin_gym.workspace import records
from bunshin_gym.workspace.memory import tracking
from bunshin_gym.workspace.memory.base import MemoryBackend, Reclaim, RestorePlan, SnapshotRef
from bunshin_gym.workspace.memory.ksmd import ksm_acquire, ksm_release
from bunshin_gym.workspace.records import Record


class KsmBackend(MemoryBackend):
    name = "ksm"

    def uses_ksm(self) -> bool:
        return True

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        ksm_acquire(rec.id)
        return RestorePlan(images=snap.criu_dir, env=tracking.start(rec, p), ksm=True)

    def can_dump_delta(self, rec: Record, parent_id: str, p: Paths) -> bool:
        return tracking.can_dump_delta(rec, parent_id, p)

    def on_stop(self, rec: Record, p: Paths) -> None:
        tracking.stop(rec, p)

    def adopted(self, rec: Record) -> None:
        ksm_acquire(rec.id)  # the restore registered the temporary id, released with the replaced record

    def on_reclaim(self, rec: Record, p: Paths, reclaim: Reclaim) -> None:
        if rec.snapshot:  # only a restored clone was ever a user
            ksm_release(rec.id)

    def sweep(self, p: Paths) -> list[str]:
        # every KSM user on the host (share clones that KSM serves too): one count for all modes
        ksm_release("", live={r.id for r in records.all_records(p)})
        return []
