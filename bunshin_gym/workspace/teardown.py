"""Taking a workspace down, in one place and in one order, and the snapshot deletions that
follow from it.

:func:`reclaim` is the one teardown of a workspace (a handle's ``close``, a failed create or
fork, a rollback's replaced state, ``bunshin gc``); it is safe on a half-made workspace and
idempotent. Its order, and why:

1. **Processes** (:func:`stop_processes`): SIGKILL PID 1 (its death kills the whole pid
   namespace), thaw the cgroup (a frozen task cannot die on cgroup v1: the pending SIGKILL
   lands first), wait for PID 1 to go (:func:`wait_gone`), then kill whatever the cgroup still
   holds until it is empty.
2. **What served them** (the memory backend's ``on_stop``, e.g. a uffd monitor): only once
   nothing it served runs, or a clone would fault on a page nobody answers.
3. **Cgroup**, then **files** (the subvolume), then the **record**: the record goes last, so
   that until then ``bunshin gc`` finds whatever a crash left.
4. **Helpers** (the backend's ``on_reclaim``): ksmd's user count, and the kmod holder of the
   workspace's snapshot once no kmod clone of it is left. A holder is itself a workspace and
   is reclaimed by this same function, passed in (backends never import this module).
5. **The snapshot** it was restored from is released (:func:`release_snapshot`): an ephemeral
   one that nothing else uses is deleted, which first closes the snapshot's holders and drops
   the backends' state for it, then releases the ancestors it kept alive.
6. **Image copies** no clone maps any more (the backends' ``release_unused``: share's tmpfs copy
   of the snapshot's images), after the release, which may have dropped the last user.

A rollback replaces a workspace's processes: the replaced ones are SIGKILLed at once and
reclaimed on one background thread (:func:`reclaim_later`); until that is done they still count
as users of their snapshot, and :meth:`~.snapshots.store.Store.users` waits for them.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace import memory, pool, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.errors import ForkError, WorkspaceError
from bunshin_gym.workspace.snapshots import store
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot

log = logging.getLogger(__name__)


def reclaim(rec: records.Record, p: Paths | None = None) -> None:
    """Kill a workspace's processes and remove its cgroup, upper layer and record, in the order
    the module's docstring gives. Safe on a half-created workspace and idempotent."""
    p = p or paths()
    cg = Cgroup(rec.cgroup)
    stop_processes(rec, p=p)  # its memory backend's on_stop last (a uffd monitor)
    if cg.exists():
        cg.remove()
    pool.delete_subvolume(Path(rec.subvolume))
    records.remove(rec.id, p)
    memory.for_record(rec).on_reclaim(rec, p, reclaim)  # ksmd's user, the kmod holder of its snapshot
    release_snapshot(rec.snapshot, p)
    memory.registry.release_unused(p, rec.snapshot)  # share's image copy of the snapshot, if unused now


def stop_processes(rec: records.Record, timeout: float = 10.0, p: Paths | None = None) -> None:
    """Kill every process of a workspace and wait until its cgroup is empty; then its memory
    backend stops what served them (a uffd monitor)."""
    cg = Cgroup(rec.cgroup)
    running = rec.running()
    if running:
        try:
            os.kill(rec.pid1, signal.SIGKILL)  # PID 1's death kills the whole pid namespace
        except ProcessLookupError:
            pass
    if cg.exists():
        try:  # a frozen task cannot die (cgroup v1): thaw, the pending SIGKILL then lands first
            cg.thaw(timeout=1)
        except (WorkspaceError, OSError):
            pass
    if running:
        wait_gone(rec.pid1, timeout)
    deadline = time.monotonic() + timeout
    while cg.exists() and cg.pids():
        cg.kill_all()
        if time.monotonic() > deadline:
            raise ForkError(f"workspace {rec.id}: processes {cg.pids()} survive SIGKILL")
        time.sleep(0.001)
    memory.for_record(rec).on_stop(rec, p or paths())  # only once nothing it served runs


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` to exit; whether it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


# the snapshots a teardown lets go ------------------------------------------------------------
def release_snapshot(snap: StoredSnapshot | str | None, p: Paths) -> None:
    """Release a snapshot (:meth:`~.snapshots.store.Store.release`): given an id, an ephemeral
    snapshot (made by ``Workspace.fork``) is deleted once nothing uses it."""
    store.Store(p).release(snap, reclaim)


def delete_snapshot(snap: StoredSnapshot, p: Paths) -> None:
    """Delete a snapshot; refused (``SnapshotError``) while a clone or a child snapshot uses it."""
    store.Store(p).delete(snap, reclaim)


def remove_snapshot_dir(path: Path, p: Paths | None = None) -> None:
    """Remove a snapshot directory, complete or not, whatever uses it (a failed take, ``bunshin
    gc``'s sweep of incomplete ones, a failed migration)."""
    store.Store(p).remove_dir(path, reclaim)


# what rollbacks replaced ---------------------------------------------------------------------
#: reclaims of what rollbacks replaced (processes killed, not yet gone), off the caller's path
#: on one thread (they touch the store's bookkeeping: releases, image copies); pending work is
#: finished at interpreter exit (concurrent.futures joins the thread)
_reclaimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=store.RECLAIM_THREAD)


def reclaim_later(rec: records.Record, p: Paths) -> Future:
    """Reclaim a rollback's replaced workspace state on the reclaim thread; until it is done,
    the snapshot it ran from counts it as a user (``store.note_leaving``)."""
    future = _reclaimer.submit(_reclaim_replaced, rec, p)
    store.note_leaving(rec.snapshot, future)
    return future


def _reclaim_replaced(rec: records.Record, p: Paths) -> None:
    try:
        reclaim(rec, p)
    except Exception:  # noqa: BLE001 - its record stays: `bunshin gc` retries
        log.exception("reclaiming %s (replaced by a rollback) failed; `bunshin gc` will retry", rec.id)
