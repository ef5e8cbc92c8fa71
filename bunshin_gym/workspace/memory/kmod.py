"""The ``kmod`` memory mode: anonymous memory shared copy-on-write from a frozen holder copy of
the snapshot by the ``bunshin_share`` kernel module (the mechanism, the holders and the
pre-resume script are in :mod:`bunshin_gym.workspace.kmod`). Needs the module loaded
(``SetupError`` otherwise) or its test double (``BUNSHIN_KMOD_DOUBLE=copy``).

A holder is a workspace of this backend, not a user of its snapshot: restored in ``copy``
mode, recorded with ``holder_of``, restored and reclaimed through this backend.
"""

from __future__ import annotations

from pathlib import Path

from bunshin_gym.config import Paths
from bunshin_gym.workspace import kmod as sharing
from bunshin_gym.workspace import records
from bunshin_gym.workspace.errors import ForkError
from bunshin_gym.workspace.memory.base import MemoryBackend, Reclaim, RestorePlan, SnapshotRef
from bunshin_gym.workspace.records import Record


class KmodBackend(MemoryBackend):
    name = "kmod"
    one_by_one = True  # the holder is made once, for clones already recorded

    def check_available(self, p: Paths) -> None:
        sharing.check_available(p)

    def helper(self, snap: SnapshotRef, p: Paths) -> Record | None:
        sharing.check_available(p)  # again: a rollback comes here without a fork's check
        return sharing.holder_for(snap, p)

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        env, args = sharing.restore_setup(rec, helper, p)  # a clone served by the holder, or a holder
        return RestorePlan(images=snap.criu_dir, env=env, args=args)

    def restored(self, rec: Record, succeeded: bool, p: Paths, log: Path) -> None:
        report = sharing.report_path(rec, p)
        if not (succeeded or report.exists()):
            return
        served = sharing.read_report(report)
        if "error" in served:
            raise ForkError(f"kmod restore of {rec.id} from snapshot {rec.snapshot}: sharing anonymous memory from "
                            f"the holder failed (the clone was stopped before it ran and is removed): "
                            f"{served['error']}; log: {log}")
        rec.kmod = records.kmod_report(served)

    def on_reclaim(self, rec: Record, p: Paths, reclaim: Reclaim) -> None:
        if rec.snapshot and not rec.holder_of:  # a holder goes with the last kmod clone it serves
            sharing.close_holders(rec.snapshot, reclaim, p, unless_used=True)

    def on_snapshot_removed(self, snap_id: str, p: Paths, reclaim: Reclaim) -> None:
        sharing.close_holders(snap_id, reclaim, p)

    def collected_later(self, rec: Record) -> bool:
        return bool(rec.holder_of)  # after the clones: a holder goes with the last kmod clone it serves

    def collect(self, p: Paths, reclaim: Reclaim) -> list[str]:
        closed = []
        for rec in records.all_records(p):
            if not rec.holder_of:
                continue
            if not (p.snapshots / rec.holder_of).exists() or (rec.pid1 is not None and not rec.running()):
                reclaim(rec, p)
                closed.append(rec.id)
            else:
                closed += sharing.close_holders(rec.holder_of, reclaim, p, unless_used=True)
        return closed
