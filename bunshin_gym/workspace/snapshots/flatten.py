"""Flattening snapshot chains: a snapshot made self-contained with respect to page files.

A clone restored in a mode that maps page images (``share``, ``map-anon``:
:func:`memory.maps_images`) has private file mappings of its snapshot's ``pages-N.img``
(paths under ``/.snap/<snapshot>/criu/``, the store as the clone sees it). Snapshotting the
clone again, CRIU records those mappings as mappings of the same files (``files.img``
reg-file entries by path; the VMAs in ``mm-N.img`` name the entry by id): a child snapshot
needs its ancestors' page files, and every level adds one (``ref_depth`` in the metadata).
Deep chains fragment mappings and keep every ancestor alive.

Flattening keeps those mappings as file mappings (their pages the clone never touched are only
in the ancestor's file, so dumping them as anonymous memory would lose them) and moves the
files instead: every ancestor file the images name is linked into the snapshot's own
directory, ``flat/<owner>/<path in owner>``, and the reg-file entries are rewritten to the new
path (``/.snap/<snapshot>/flat/<owner>/criu/pages-N.img``) with CRIU's own image library
(pycriu, installed by ``criu/pycriu.sh``). The link is a hard link (same inode: no copy, and
clones of the flattened snapshot share page cache with clones of the ancestor), else a btrfs
reflink, else a copy; size and mode, which CRIU's restore checks, are the original's. A file a
flattened ancestor already holds under its ``flat/`` is taken over under its original owner's
name, so flattening a chain of flattened snapshots does not nest.

The btrfs file layer (``fs/``) is a full read-only snapshot of the upper layer and never
depends on the parent. So after flattening, ``parent`` is lineage only: the snapshot needs no
other snapshot, and every ancestor can be deleted (:mod:`.lineage`).

When: :func:`on_take` flattens a new snapshot whose ``ref_depth`` would exceed
:func:`max_depth` (``BUNSHIN_MAX_SNAPSHOT_DEPTH``, default 8, read at use); on demand
``Snapshot.flatten`` (``bunshin snap flatten ID``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import warnings
from pathlib import Path

from bunshin_gym.config import Paths, max_snapshot_depth, paths
from bunshin_gym.errors import FlattenUnavailable, SnapshotError
from bunshin_gym.workspace import memory
from bunshin_gym.workspace.snapshots import delta, integrity
from bunshin_gym.workspace.snapshots import meta as meta_file
from bunshin_gym.workspace.snapshots.criu_images import load_image, write_image
from bunshin_gym.workspace.snapshots.meta import SnapshotMeta
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot

#: where the snapshot store is mounted in every workspace (forking.DUMP_FLAGS' external mount)
SNAP_MOUNT = "/.snap"
#: the directory of a snapshot that holds the files it took over from its ancestors
FLAT_DIR = "flat"
#: FICLONE ioctl (linux/fs.h): a reflink copy on btrfs
_FICLONE = 0x40049409


def max_depth() -> int:
    """How many ancestors' page files a snapshot may reference before it is flattened
    (``BUNSHIN_MAX_SNAPSHOT_DEPTH``, read at use)."""
    return max_snapshot_depth()


def _split(name: str) -> tuple[str, str, str] | None:
    """``/.snap/<holder>/<rest>`` -> (holder, owner, path in owner), where a file the holder
    took over from ``owner`` (``<holder>/flat/<owner>/<path>``) is named by its owner."""
    parts = name.split("/")
    if len(parts) < 4 or parts[0] != "" or parts[1] != SNAP_MOUNT.strip("/") or not parts[2]:
        return None
    holder, rest = parts[2], parts[3:]
    owner = holder
    while len(rest) > 2 and rest[0] == FLAT_DIR:
        owner, rest = rest[1], rest[2:]
    return holder, owner, "/".join(rest)


def references(criu_dir: Path, snap_id: str, p: Paths | None = None) -> list[dict]:
    """The files of OTHER snapshots that a snapshot's CRIU images name: one dict per reg-file
    entry (``name``, ``holder``: the snapshot directory the file is in, ``owner``, ``path``)."""
    out = []
    for e in load_image(criu_dir / "files.img", p)["entries"]:
        reg = e.get("reg")
        if e.get("type") != "REG" or not reg:
            continue
        where = _split(reg.get("name", ""))
        if where and where[0] != snap_id:
            out.append({"id": reg["id"], "name": reg["name"], "holder": where[0], "owner": where[1],
                        "path": where[2]})
    return out


def _link(src: Path, dst: Path) -> str:
    """Make ``dst`` the same content as ``src``: hard link, else reflink, else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:
        pass
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        with open(src, "rb") as s, open(tmp, "wb") as d:
            try:
                fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
                how = "reflink"
            except OSError:
                shutil.copyfileobj(s, d, 1 << 20)
                how = "copy"
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return how


def flatten_dir(path: Path, snap_id: str, p: Paths | None = None) -> dict:
    """Take over every file of another snapshot that the images in ``path/criu`` name and
    rewrite ``files.img`` to name the taken-over files. Returns what was done (for meta.json).
    A share-mode delta first gets the pages it has in its parent (:func:`delta.materialize`)."""
    p = p or paths()
    t0 = time.perf_counter()
    delta.materialize(path / "criu")
    files_img = path / "criu" / "files.img"
    img = load_image(files_img, p)
    taken: dict[str, dict] = {}
    refs_before: set[str] = set()
    for e in img["entries"]:
        reg = e.get("reg")
        where = _split(reg.get("name", "")) if e.get("type") == "REG" and reg else None
        if not where or where[0] == snap_id:
            continue
        holder, owner, rel = where
        refs_before.add(holder)
        src = p.snapshots / reg["name"][len(SNAP_MOUNT) + 1:]
        new_rel = f"{FLAT_DIR}/{owner}/{rel}"
        dst = path / new_rel
        if new_rel not in taken:
            try:
                st = src.stat()
            except FileNotFoundError:
                raise SnapshotError(f"cannot flatten {snap_id}: {reg['name']} (snapshot {holder}) is gone") from None
            if not src.is_file():
                raise SnapshotError(f"cannot flatten {snap_id}: its images name {reg['name']}, not a regular file")
            if reg.get("size") is not None and st.st_size != reg["size"]:
                raise SnapshotError(f"cannot flatten {snap_id}: {src} has {st.st_size} bytes, the images recorded "
                                    f"{reg['size']} (snapshot files must be immutable)")
            how = "existing" if dst.exists() else _link(src, dst)
            taken[new_rel] = {"from": reg["name"], "to": f"{SNAP_MOUNT}/{snap_id}/{new_rel}", "bytes": st.st_size,
                              "how": how}
        reg["name"] = taken[new_rel]["to"]
    if taken:
        write_image(img, files_img, p)
    return {"at": time.time(), "refs_before": sorted(refs_before), "files": list(taken.values()),
            "bytes": sum(f["bytes"] for f in taken.values()), "ms": round((time.perf_counter() - t0) * 1e3, 2)}


# when ----------------------------------------------------------------------------------
def on_take(path: Path, meta: SnapshotMeta, p: Paths) -> None:
    """Called by ``take`` before meta.json is written: record the snapshots the images
    reference (``refs``) and flatten the snapshot if its ref_depth exceeds max_depth(). The
    ref_depth from the parent's metadata undercounts for a clone restored before its snapshot
    was flattened on demand (it still maps that snapshot's former references): it is raised to
    the number of snapshots actually referenced. Without pycriu the snapshot stays a chain (a
    warning, ``flatten_error`` in the metadata)."""
    if not meta.ref_depth:
        return
    try:
        meta.refs = sorted({r["holder"] for r in references(path / "criu", meta.id, p)})
        meta.ref_depth = max(meta.ref_depth, len(meta.refs))
        if meta.ref_depth > max_depth():
            info = flatten_dir(path, meta.id, p)
            info["reason"] = f"ref_depth {meta.ref_depth} > {max_depth()}"
            meta.ref_depth, meta.refs, meta.flattened = 0, [], info
            meta.timings["flatten_ms"] = info["ms"]
    except FlattenUnavailable as e:
        warnings.warn(str(e), stacklevel=3)
        meta.flatten_error = str(e)


@contextlib.contextmanager
def _lock(p: Paths):
    p.run.mkdir(parents=True, exist_ok=True)
    with open(p.run / "flatten.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def flatten_snapshot(snap: StoredSnapshot) -> dict:
    """Flatten an existing snapshot in place (see ``Snapshot.flatten``). Idempotent; clones
    restored before keep the files they map, and keep those snapshots in use
    (``lineage.stale_clones``)."""
    p = snap._p
    with _lock(p):
        before = meta_file.read(snap.path)
        info = flatten_dir(snap.path, snap.id, p)
        if not info["files"] and before.flattened:
            snap.metadata = before
            return before.flattened
        info["reason"] = "on demand"
        memory.registry.images_rewritten(snap.id, snap.criu_dir, ["files.img"], p)  # share's tmpfs copy
        # as on disk now: a keep or release during the flattening is not undone
        with meta_file.updating(snap.path) as meta:
            meta.ref_depth, meta.refs, meta.flattened = 0, [], info
            if meta.checksums is not None:  # the images were rewritten: their sums too
                meta.checksums = integrity.checksums(snap.criu_dir)
        snap.metadata = meta
        return info
