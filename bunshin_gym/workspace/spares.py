"""Spare restores: a snapshot restored ahead of time, frozen, and swapped in by a rollback.

A rollback restores its snapshot beside the workspace and swaps it in
(:func:`~.forking.restore_beside`, :func:`~.forking.swap_in`); CRIU's restore is most of its
time (0.4-0.9 s of a desktop's here). A spare is that restore done before it is asked for,
off the caller's path (the prefix cache makes one for a snapshot it keeps hot, while the
policy thinks), then frozen in its cgroup's freezer until a rollback of a workspace of the
same image, memory mode and limits takes it: the rollback then thaws and swaps it in.

What the workspace's programs observe is what a restore gives them. A spare runs from its
restore until its agent answers (a few ms) and is frozen there; after the thaw it goes on
from that point. The workspaces run without a time namespace, so a restored workspace's
clocks have already moved on by the time since its snapshot; a spare's have moved on by
as much, in one more pause, as under a host that paused the restored processes for a while.

A spare keeps the connection its agent answered on before the freeze, and the workspace that
takes it keeps that one too: each connection is served on a thread of the agent, which takes
a pid in the workspace, and a fork or a rollback that takes a spare must leave the next pid its
programs see where a plain restore leaves it.

A spare is a workspace record owned by this process: ``bunshin gc`` reclaims it after a
crash, and :func:`discard` (called at exit) before. Its snapshot counts it as a user, so a
snapshot's owner discards its spares before deleting it.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace import forking, records, teardown
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.client import AgentClient
from bunshin_gym.workspace.errors import WorkspaceError
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot

log = logging.getLogger(__name__)

__all__ = ["count", "discard", "memory_bytes", "pids", "prepare", "take"]

#: seconds a thawed spare's agent has to answer (it answered before the freeze)
_READY_TIMEOUT = 10.0
_lock = threading.Lock()
#: snapshot id -> frozen spares restored from it (records owned by this process, each with the
#: connection its agent answered on)
_spares: dict[str, list[tuple[records.Record, AgentClient]]] = {}


def _fits(spare: records.Record, rec: records.Record) -> bool:
    """Whether ``spare`` can become ``rec``'s workspace: what a rollback keeps of the record
    (its image, memory mode and limits) must be what the spare was restored with."""
    return (spare.image_path, spare.memory_mode, spare.limits) == (rec.image_path, rec.memory_mode, rec.limits)


def prepare(rec: records.Record, snap: StoredSnapshot, p: Paths | None = None) -> records.Record:
    """Restore ``snap`` beside ``rec``'s workspace (as its rollback would), freeze it, and keep
    it for the next rollback of a workspace like ``rec`` to ``snap``; returns its record.
    Raises what the restore raises; nothing is kept then."""
    p = p or paths()
    spare, client = forking.restore_beside(rec, snap, p)
    try:
        Cgroup(spare.cgroup).freeze()
    except BaseException:
        client.disconnect()
        teardown.reclaim(spare, p)
        raise
    with _lock:
        _spares.setdefault(snap.id, []).append((spare, client))
    log.debug("spare %s of snapshot %s ready (frozen)", spare.id, snap.id)
    return spare


def take(rec: records.Record, snap_id: str, p: Paths | None = None) -> tuple[records.Record, AgentClient] | None:
    """A spare of ``snap_id`` that fits ``rec``, thawed, for :func:`~.forking.swap_in`, with
    the connection its agent answered on (for the workspace to keep); None if there is none
    (or the one found died: it is reclaimed)."""
    p = p or paths()
    while True:
        with _lock:
            kept = _spares.get(snap_id, [])
            found = next((s for s in kept if _fits(s[0], rec)), None)
            if found is None:
                return None
            kept.remove(found)
            if not kept:
                _spares.pop(snap_id, None)
        spare, client = found
        try:
            # a frozen task cannot die (cgroup v1): one killed meanwhile has SIGKILL pending
            if not spare.running() or _kill_pending(spare.pid1):
                raise WorkspaceError(f"spare {spare.id} of snapshot {snap_id} was killed")
            Cgroup(spare.cgroup).thaw()
            client.wait_ready(_READY_TIMEOUT)  # it answers, as after a restore (on its connection)
            return spare, client
        except (WorkspaceError, OSError) as e:
            log.warning("%s; restoring instead", e)
            _reclaim(found, p)


def _kill_pending(pid: int) -> bool:
    """Whether ``pid`` has SIGKILL pending (to it or its thread group): killed, not yet dead."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return True
    bit = 1 << (signal.SIGKILL - 1)
    return any(int(ln.split()[1], 16) & bit for ln in lines if ln.startswith(("SigPnd:", "ShdPnd:")))


def count(snap_id: str | None = None) -> int:
    """Spares kept (of one snapshot, or of all)."""
    with _lock:
        return len(_spares.get(snap_id, [])) if snap_id else sum(map(len, _spares.values()))


def pids(snap_id: str) -> set[int]:
    """PID 1 of each spare of the snapshot (a workspace that took one runs on it)."""
    with _lock:
        return {s.pid1 for s, _ in _spares.get(snap_id, []) if s.pid1 is not None}


def memory_bytes(snap_id: str | None = None) -> int:
    """Bytes charged to the spares' memory cgroups (of one snapshot, or of all)."""
    with _lock:
        kept = [s for s, _ in _spares.get(snap_id, [])] if snap_id else [s for v in _spares.values() for s, _ in v]
    total = 0
    for spare in kept:
        try:
            total += Cgroup(spare.cgroup).memory_usage()
        except OSError:
            pass  # taken and reclaimed meanwhile
    return total


def discard(snap_id: str | None = None, p: Paths | None = None) -> int:
    """Reclaim the spares of one snapshot (or all of them); returns how many."""
    with _lock:
        if snap_id is None:
            gone = [s for v in _spares.values() for s in v]
            _spares.clear()
        else:
            gone = _spares.pop(snap_id, [])
    for kept in gone:
        _reclaim(kept, p or paths())
    return len(gone)


def _reclaim(kept: tuple[records.Record, AgentClient], p: Paths) -> None:
    spare, client = kept
    client.disconnect()
    try:
        teardown.reclaim(spare, p)
    except Exception:  # noqa: BLE001 - its record stays, owned by this process: `bunshin gc` retries
        log.exception("reclaiming spare %s failed; `bunshin gc` will retry", spare.id)


atexit.register(discard)
