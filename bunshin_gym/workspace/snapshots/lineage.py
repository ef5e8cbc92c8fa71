"""Who needs whom among snapshots, and which live workspaces use one.

A snapshot needs its parent until it is flattened (the conservative rule, whatever its
mode), and every snapshot whose page files its images name (``refs``; an ancestor further up
when a snapshot in between was flattened after the clone it was taken from had been
restored). A live clone uses the snapshot it was restored from, and, when that snapshot was
flattened after the clone's restore, the snapshots whose files the clone still maps
(:func:`stale_clones`). A kmod holder serves its snapshot; it does not use it.

The depth of references: a clone restored with pages mapped from its snapshot keeps those
mappings when dumped again, so its snapshot names its ancestors' page files, one more level
each time (``ref_depth``), until flattened (:mod:`.flatten`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from bunshin_gym.errors import SnapshotError
from bunshin_gym.workspace import memory, records
from bunshin_gym.workspace.snapshots.flatten import references
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot


def needs(child: StoredSnapshot, snap_id: str) -> bool:
    """Whether snapshot ``child`` needs snapshot ``snap_id`` to exist: it is its parent and
    ``child`` is not flattened (any mode: the conservative rule), or its images name files of
    it (``refs``: an ancestor further up, needed directly when a snapshot in between was
    flattened after the clone that ``child`` was taken from had been restored)."""
    m = child.metadata
    if child.parent == snap_id and not m.flattened:
        return True
    refs = m.refs
    # a snapshot that recorded no ref_depth is as old as the rule: assume it may name files
    if refs is None and (m.ref_depth if m.ref_depth is not None else 2) >= 2 and not m.flattened:
        refs = _refs_of_older(child)  # taken before refs were recorded
    return snap_id in (refs or ())


def _refs_of_older(snap: StoredSnapshot) -> frozenset[str]:
    try:
        st = (snap.criu_dir / "files.img").stat()
        return _refs_cached(str(snap.criu_dir), snap.id, st.st_mtime_ns)
    except (OSError, SnapshotError):  # no pycriu: the parent chain is all there is to go by
        return frozenset()


@functools.lru_cache(maxsize=4096)
def _refs_cached(criu_dir: str, snap_id: str, mtime_ns: int) -> frozenset[str]:
    return frozenset(r["holder"] for r in references(Path(criu_dir), snap_id))


def stale_clones(snap_id: str, snaps: list[StoredSnapshot], running: list[records.Record]) -> list[str]:
    """Live clones that map files of ``snap_id`` through a snapshot that was flattened after
    they were restored (they still map the files its images named before)."""
    flat = {s.id: s.metadata.flattened for s in snaps
            if s.metadata.flattened and snap_id in s.metadata.flattened.get("refs_before", ())}
    if not flat:
        return []
    return [r.id for r in running if r.snapshot in flat and r.created <= flat[r.snapshot]["at"]]


def users(snap_id: str, snaps: list[StoredSnapshot], running: list[records.Record]) -> dict[str, list[str]]:
    """Live workspaces (among ``running``) restored from ``snap_id``, and child snapshots
    (among ``snaps``) that need it."""
    clones = [r.id for r in running if r.snapshot == snap_id and not r.holder_of]  # a holder serves, not uses
    clones += stale_clones(snap_id, snaps, running)
    children = [s.id for s in snaps if needs(s, snap_id)]
    return {"clones": clones, "children": children}


def ref_depth(rec: records.Record, parent: StoredSnapshot | None) -> int:
    """How many ancestors' page files a new snapshot of this workspace may reference: a clone
    restored with pages mapped from its snapshot keeps those mappings when dumped again, so
    its snapshots need their ancestors (kept alive by the parent chain) until flattened."""
    if parent is None or not memory.for_record(rec).maps_images:
        return 0
    return (parent.metadata.ref_depth or 0) + 1
