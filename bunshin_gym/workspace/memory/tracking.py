"""Write tracking of clones restored by copy (the ``copy`` and ``ksm`` memory modes).

Each such clone gets a write tracker (:func:`bunshin_gym.workspace.uffd.start` with
``track_writes=True``) when the host can (:func:`bunshin_gym.workspace.uffd.write_tracking_unavailable_reason`):
CRIU hands every restored task's userfaultfd to it, and it write-protects the task's private
anonymous memory in asynchronous mode. A snapshot of the clone is then a delta of the snapshot
it was restored from: the pages it never wrote are recorded as in the parent
(:func:`bunshin_gym.workspace.snapshots.delta.dump_delta`, criu/patches/0018-*).

Without it (``BUNSHIN_WRITE_TRACKING=0``, an older kernel or CRIU) clones are restored as before
and every snapshot of them records all their pages.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

from bunshin_gym.config import Paths, max_snapshot_depth
from bunshin_gym.workspace import uffd
from bunshin_gym.workspace.records import Record

log = logging.getLogger(__name__)

#: set to 0: copy and ksm clones are restored without write tracking (read by config.write_tracking)
WRITE_TRACKING_ENV = "BUNSHIN_WRITE_TRACKING"


@cache
def _warn_once(why: str) -> None:
    log.info("copy and ksm clones are not write-tracked (their snapshots are full dumps): %s", why)


def available(p: Paths) -> bool:
    """Whether clones restored by copy get a write tracker on this host."""
    why = uffd.write_tracking_unavailable_reason(p)
    if why:
        _warn_once(why)
    return why is None


def start(rec: Record, p: Paths) -> dict[str, str]:
    """Start the clone's tracker (before its restore) if the host can; the restore's CRIU
    environment (empty without a tracker)."""
    if not available(p):
        return {}
    uffd.start(rec, p, track_writes=True)
    return uffd.restore_env(rec)


def chain_depth(criu_dir: Path) -> int:
    """How many snapshots a snapshot's images reach through their ``parent`` links."""
    n, link = 0, criu_dir / "parent"
    while link.is_symlink() or link.exists():
        n += 1
        link = link.resolve() / "parent"
    return n


def can_dump_delta(rec: Record, parent_id: str, p: Paths) -> bool:
    """A snapshot of this clone may be a delta of ``parent_id``: its writes were tracked since
    its restore from that snapshot, and the chain of deltas a restore would read through stays
    within the snapshot depth limit (past it, a full dump starts a new chain)."""
    if not uffd.tracking_since(rec, parent_id):
        return False
    parent_criu = p.snapshots / parent_id / "criu"
    return (parent_criu / "inventory.img").exists() and chain_depth(parent_criu) + 1 < max_snapshot_depth()


def stop(rec: Record, p: Paths) -> None:
    """The clone's processes are gone: stop its tracker."""
    uffd.stop(rec, p)
