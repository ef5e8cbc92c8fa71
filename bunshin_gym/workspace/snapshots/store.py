"""The snapshot store: the one path by which snapshots are read, listed, written, deleted and
released, and the check of their images before a restore.

Deleting a snapshot (:meth:`Store.delete`) is refused while a live clone or a child snapshot
uses it (:mod:`.lineage`); releasing one (:meth:`Store.release`) deletes it now if nothing
does, else marks it ephemeral: whoever drops its last user (a workspace's reclaim, a child's
deletion, ``bunshin gc``) releases it again, and it goes. Removing a directory
(:meth:`Store.remove_dir`) first lets every memory backend drop what it keeps for the
snapshot (kmod holders, share's tmpfs copy of the images), then its ``/.snap`` view.

The store starts and stops nothing itself: what removing a snapshot's helpers takes, the
``reclaim`` of a workspace, is passed in by the layer above (``teardown.reclaim``).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

from bunshin_gym.config import Paths, paths
from bunshin_gym.errors import SnapshotError
from bunshin_gym.workspace import memory, pool, records
from bunshin_gym.workspace.memory.base import Reclaim
from bunshin_gym.workspace.snapshots import integrity, lineage, views
from bunshin_gym.workspace.snapshots import meta as meta_file
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot

log = logging.getLogger(__name__)

#: the parts a complete snapshot has besides meta.json
_REQUIRED = ("criu/inventory.img", "criu/pstree.img", "fs/upper")

#: the thread that reclaims what rollbacks replaced (teardown.reclaim_later); a reclaim there
#: releases its snapshot, so it never waits for the reclaims pending on that snapshot
RECLAIM_THREAD = "bunshin-reclaim"
_leaving_lock = threading.Lock()
#: (snapshot id, reclaim) of workspaces a rollback replaced: killed, not yet gone; they still
#: use the snapshot until their reclaim is done, and :meth:`Store.users` waits for it, so that
#: a snapshot a rollback left is deletable at once
_leaving: list[tuple[str | None, Future]] = []


def note_leaving(snap_id: str | None, reclaim: Future) -> None:
    """A workspace restored from ``snap_id`` is being reclaimed by ``reclaim`` (a future)."""
    with _leaving_lock:
        _leaving[:] = [(s, f) for s, f in _leaving if not f.done()]
        _leaving.append((snap_id, reclaim))


def wait_leaving(snap_id: str) -> None:
    """Wait for the pending reclaims of workspaces restored from ``snap_id`` (except on the
    reclaim thread itself, which would wait for itself)."""
    if threading.current_thread().name.startswith(RECLAIM_THREAD):
        return
    with _leaving_lock:
        pending = [f for s, f in _leaving if s == snap_id]
    for future in pending:
        future.result()


class Store:
    """The snapshots on this host. ``snapshot_type`` is what :meth:`get` and :meth:`list` make
    of a directory (the ``Snapshot`` handle's store makes handles)."""

    snapshot_type: ClassVar[type[StoredSnapshot]] = StoredSnapshot

    def __init__(self, p: Paths | None = None):
        self.p = p or paths()

    # reading -----------------------------------------------------------------------------
    def get(self, snap_id: str) -> StoredSnapshot:
        """A complete snapshot; :class:`SnapshotError` naming it when it is missing, incomplete
        or corrupt."""
        path = self.p.snapshots / snap_id
        if not path.is_dir():
            raise SnapshotError(f"no snapshot {snap_id!r} in {self.p.snapshots}")
        metadata = meta_file.read(path)
        for part in _REQUIRED:
            if not (path / part).exists():
                raise SnapshotError(f"snapshot {snap_id} is corrupt: {part} is missing")
        return self.snapshot_type(path, metadata, self.p)

    def list(self) -> list[StoredSnapshot]:
        """Every snapshot whose metadata is written (complete ones, and damaged ones that
        :meth:`get` refuses)."""
        out = []
        for d in sorted(self.p.snapshots.iterdir()) if self.p.snapshots.exists() else []:
            if (d / meta_file.META_FILE).exists():
                try:
                    out.append(self.snapshot_type(d, meta_file.read(d), self.p))
                except SnapshotError:  # deleted while we list, or unreadable
                    continue
        return out

    def users(self, snap_id: str) -> dict[str, list[str]]:
        """Live workspaces restored from ``snap_id``, and child snapshots that need it."""
        wait_leaving(snap_id)  # a rollback's replaced processes are killed: let them go first
        running = [r for r in records.all_records(self.p) if r.running()]
        return lineage.users(snap_id, self.list(), running)

    def verify(self, snap: StoredSnapshot) -> None:
        """Refuse (:class:`SnapshotError`, naming the snapshot and the image) a snapshot whose
        images, or those of a snapshot its images need (parent chain, referenced page files),
        are missing, truncated or altered. Cheap after the first call per process."""
        seen: set[str] = set()
        todo = [snap]
        while todo:
            s = todo.pop()
            if s.id in seen:
                continue
            seen.add(s.id)
            integrity.verify_dir(s.id, s.criu_dir, s.metadata.checksums)
            for need in s.may_need():
                if lineage.needs(s, need):
                    try:
                        todo.append(self.get(need))
                    except SnapshotError as e:
                        raise SnapshotError(f"snapshot {snap.id} needs snapshot {need}, which is unusable: "
                                            f"{e}") from e

    # writing -----------------------------------------------------------------------------
    def write(self, snap: StoredSnapshot) -> None:
        """Write a snapshot's metadata (atomically: a failed write leaves the old file)."""
        meta_file.write(snap.path, snap.metadata)

    def reseal(self, snap: StoredSnapshot) -> None:
        """Record the checksums of a snapshot's images again, after rewriting them on purpose
        (flattening, ``delta.materialize``); a snapshot without sums stays without."""
        if snap.metadata.checksums is None:
            return
        snap.metadata.checksums = integrity.checksums(snap.criu_dir)
        with meta_file.updating(snap.path) as on_disk:
            on_disk.checksums = snap.metadata.checksums

    def keep(self, snap: StoredSnapshot, by: str | os.PathLike | None = None) -> None:
        """Keep a held snapshot (:attr:`~.meta.SnapshotMeta.holder`) after its holder is gone:
        someone else now deletes it when done (a prefix cache keeping a task's start). ``by``:
        that owner's directory (:attr:`~.meta.SnapshotMeta.kept_by`), whose removal leaves the
        snapshot to ``bunshin gc``."""
        kept_by = os.path.realpath(by) if by is not None else snap.metadata.kept_by
        if snap.metadata.holder is None and snap.metadata.kept_by == kept_by:
            return
        snap.metadata.holder, snap.metadata.kept_by = None, kept_by
        with meta_file.updating(snap.path) as on_disk:
            on_disk.holder, on_disk.kept_by = None, kept_by

    # deleting ----------------------------------------------------------------------------
    def delete(self, snap: StoredSnapshot, reclaim: Reclaim) -> None:
        """Delete a snapshot; refused (:class:`SnapshotError`) while a clone or a child snapshot
        uses it. Ephemeral snapshots it kept alive are released."""
        used = self.users(snap.id)
        if used["clones"] or used["children"]:
            raise SnapshotError(f"snapshot {snap.id} is in use by clones {used['clones']} and child "
                                f"snapshots {used['children']}; close or delete those first")
        self._remove(snap, reclaim)

    def release(self, snap: StoredSnapshot | str | None, reclaim: Reclaim) -> None:
        """Delete a snapshot now if nothing uses it, else as soon as nothing does: it is marked
        ephemeral, and whoever drops its last user releases it again. Given an id, only an
        ephemeral snapshot is deleted (its last user went); an id of no snapshot is ignored."""
        if snap is None:
            return
        if isinstance(snap, str):
            try:
                snap = self.get(snap)
            except SnapshotError:
                return
            if not snap.metadata.ephemeral:
                return
        elif not snap.metadata.ephemeral:
            if not any(self.users(snap.id).values()):
                self._remove(snap, reclaim)
                return
            snap.metadata.ephemeral = True
            with meta_file.updating(snap.path) as on_disk:  # as on disk: another process may have written it
                on_disk.ephemeral = True
        if not any(self.users(snap.id).values()):  # the last user may have gone meanwhile
            self._remove(snap, reclaim)

    def _remove(self, snap: StoredSnapshot, reclaim: Reclaim) -> None:
        self.remove_dir(snap.path, reclaim)
        for needed in snap.may_need():
            self.release(needed, reclaim)  # an ephemeral ancestor this one kept alive goes now

    def remove_dir(self, path: Path, reclaim: Reclaim) -> None:
        """Remove a snapshot directory, complete or not, whatever uses it: every memory backend
        first drops what it keeps for it (kmod holders, share's tmpfs copy of the images), then
        its files, its directory and its ``/.snap`` view."""
        memory.registry.snapshot_removed(path.name, self.p, reclaim)
        if (path / "fs").exists():
            pool.delete_subvolume(path / "fs")
        shutil.rmtree(path, ignore_errors=True)
        views.remove(path.name, self.p)
