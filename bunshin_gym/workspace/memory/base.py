"""The interface every memory backend implements: one backend per memory mode.

A backend is asked at each point of a clone's life where its mode differs from a plain
CRIU restore: before a fork (checks, work done once for all clones, a helper workspace),
for ``criu restore`` (environment, arguments, images directory), after the restore, on
each health check, when the clone's processes are gone, when it is reclaimed, when a
snapshot is deleted, when it is dumped again (delta support), and by ``bunshin gc``.
Backends get what they need passed in (the snapshot, the record, paths, the ``reclaim``
function): they never import the ``Workspace`` or ``Snapshot`` modules, which import them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from bunshin_gym.config import Paths
from bunshin_gym.workspace.records import Record

#: reclaims a workspace named by its record (``teardown.reclaim``), passed in by the caller
Reclaim = Callable[[Record, Paths], None]


class SnapshotRef(Protocol):
    """What a backend uses of a snapshot: its id, its directory, its CRIU images, and its fork
    (the kmod backend restores its holder through it)."""

    @property
    def id(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def criu_dir(self) -> Path: ...

    def fork(self, n: int = 1, *, mode: str | None = None, detached: bool = False,
             _holder: bool = False) -> list: ...


@dataclass
class RestorePlan:
    """How ``criu restore`` of one clone differs by memory mode."""

    images: Path  # the images directory ``criu restore -D`` reads
    env: dict[str, str] = field(default_factory=dict)  # added to CRIU's environment
    args: list[str] = field(default_factory=list)  # added to CRIU's arguments
    ksm: bool = False  # the restored tree is made KSM-mergeable (the init's restore flag)


class MemoryBackend:
    """A memory mode. The defaults are a plain CRIU restore (every page copied into the clone)
    with nothing to set up, check or clean; a backend overrides what its mode changes."""

    #: the mode's name, as records and snapshot metadata store it (``MemoryMode`` values)
    name: ClassVar[str]
    #: clones map the snapshot's page files (so the snapshot must outlive them, and their own
    #: snapshots reference their ancestors' page files until flattened)
    maps_images: ClassVar[bool] = False
    #: clones are recorded and restored one after the other, after :meth:`helper` (not side by
    #: side in threads)
    one_by_one: ClassVar[bool] = False

    def uses_uffd(self) -> bool:
        """Anonymous memory is served by a userfaultfd monitor per clone."""
        return False

    def uses_ksm(self) -> bool:
        """Clones are made KSM-mergeable (and ksmd is tuned up while they run)."""
        return False

    # before and during a restore -----------------------------------------------------------
    def check_available(self, p: Paths) -> None:
        """Raise ``SetupError`` (saying why and what to do) where the mode cannot be used."""

    def prepare(self, snap: SnapshotRef, p: Paths) -> None:
        """Work done once per fork for all its clones, before any restore starts."""

    def helper(self, snap: SnapshotRef, p: Paths) -> Record | None:
        """A workspace the mode's restores need (the kmod holder), made on first use once the
        clones' records exist; None for most modes."""
        return None

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        """Set up one clone's restore (may start processes and save ``rec``) and say how to run it."""
        return RestorePlan(images=snap.criu_dir)

    def restored(self, rec: Record, succeeded: bool, p: Paths, log: Path) -> None:
        """After ``criu restore`` exited (``succeeded``: exit 0): read what the restore left;
        raise ``ForkError`` if the clone must not run."""

    def adopted(self, rec: Record) -> None:
        """A rollback's restore, made under a temporary id, now runs as ``rec``."""

    # while it runs -----------------------------------------------------------------------------
    def health(self, rec: Record, p: Paths) -> str | None:
        """Why the clone can no longer be used (the clone is then stopped), None while it can."""
        return None

    def dump_env(self, p: Paths) -> dict[str, str]:
        """Environment for ``criu dump`` of any workspace on this host."""
        return {}

    def can_dump_delta(self, rec: Record, parent_id: str, p: Paths) -> bool:
        """A snapshot of this clone may be a delta of ``parent_id``'s images (pages it never
        wrote recorded as in the parent; ``delta.dump_delta``)."""
        return False

    # teardown ----------------------------------------------------------------------------------
    def on_stop(self, rec: Record, p: Paths) -> None:
        """The clone's processes are all gone: stop what served them."""

    def on_reclaim(self, rec: Record, p: Paths, reclaim: Reclaim) -> None:
        """The clone's cgroup, files and record are gone; its snapshot not yet released."""

    def release_unused(self, p: Paths, snap_id: str | None) -> None:
        """A workspace (of any mode) restored from ``snap_id`` was reclaimed: drop what this
        backend keeps for that snapshot and no running clone uses."""

    def on_snapshot_removed(self, snap_id: str, p: Paths, reclaim: Reclaim) -> None:
        """The snapshot is being deleted: drop everything this backend keeps for it."""

    def on_images_rewritten(self, snap_id: str, criu_dir: Path, names: list[str], p: Paths) -> None:
        """Images ``names`` of the snapshot were rewritten in place on purpose (flattening's
        ``files.img``): bring any copy of them this backend keeps in line."""

    # bunshin gc --------------------------------------------------------------------------------
    def collected_later(self, rec: Record) -> bool:
        """gc's first pass leaves this record to :meth:`collect` (a helper workspace)."""
        return False

    def collect(self, p: Paths, reclaim: Reclaim) -> list[str]:
        """gc, after the dead workspaces are reclaimed: reclaim this backend's helper workspaces
        nothing needs any more; returns their ids."""
        return []

    def sweep(self, p: Paths) -> list[str]:
        """gc, after the snapshots: drop state of workspaces that no longer exist; returns what."""
        return []
