"""What a workspace sees at ``/.snap``: only the page images its own restore maps.

Clones in the modes that map page images (``share``, ``map-anon``) map files of their
snapshot, and of the ancestors its images name, at ``/.snap/<snapshot>/criu/...`` (and
``/.snap/<snapshot>/flat/...`` once flattened): CRIU records those paths and opens them inside
the workspace's root, so the paths must exist there. The store itself (every rollout's files
and memory) must not: a policy would read a sibling rollout's answer from it.

A *view* is a directory of the pool with the same layout, holding hard links to exactly the
files one snapshot's clones may map: its own ``criu/`` and ``flat/`` files and those of the
snapshots its images reference (``refs`` in its meta). Hard links keep the inodes, so the
page cache is shared as before and CRIU's paths resolve to the same files. The view is
bind-mounted read-only and ``nosuid,nodev`` at ``/.snap`` (CRIU's external mount ``snap``;
not ``noexec``: clones map executable pages from it), and workspace root holds no
CAP_SYS_ADMIN to remount it. A fresh workspace sees an empty view. Page images on tmpfs
(uffd mode) and the snapshots' ``fs/`` trees are never in a view.

Views are synced at every fork: a link whose store file was replaced (flattening) is
replaced too, so a clone never maps an inode the store no longer names.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.errors import SnapshotError
from bunshin_gym.workspace.snapshots import meta as meta_file
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot

log = logging.getLogger(__name__)

EMPTY = "_empty"
#: the parts of a snapshot directory a clone may map (never ``fs/``, never ``meta.json``)
MAPPED_PARTS = ("criu", "flat")


def root(p: Paths | None = None) -> Path:
    """The directory holding every view (in the pool, beside the store: hard links need it)."""
    return (p or paths()).pool / "snap-views"


def empty_view(p: Paths | None = None) -> Path:
    """The view of a workspace started from an image: nothing."""
    d = root(p) / EMPTY
    d.mkdir(parents=True, exist_ok=True)
    return d


def needed(snap: StoredSnapshot) -> list[str]:
    """The snapshots whose files ``snap``'s clones may map: itself and those its images name.

    Snapshots taken before ``refs`` was recorded name their whole parent chain.
    """
    ids = [snap.id]
    refs = snap.metadata.refs
    if refs is not None:
        return ids + [r for r in refs if r != snap.id]
    parent, store = snap.parent, snap._p.snapshots
    while parent and parent not in ids:
        ids.append(parent)
        try:
            parent = meta_file.read(store / parent).parent
        except (SnapshotError, OSError):
            break
    return ids


@contextmanager
def _locked(p: Paths) -> Iterator[None]:
    r = root(p)
    r.mkdir(parents=True, exist_ok=True)
    with open(r / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def view_for(snap: StoredSnapshot) -> Path:
    """The view for clones of ``snap``, made or brought in line with the store first."""
    p = snap._p
    view = root(p) / snap.id
    with _locked(p):
        wanted: dict[Path, Path] = {}
        for snap_id in needed(snap):
            src_dir = p.snapshots / snap_id
            for part in MAPPED_PARTS:
                base = src_dir / part
                for dirpath, _dirs, files in os.walk(base):
                    for name in files:
                        src = Path(dirpath) / name
                        wanted[view / src.relative_to(p.snapshots)] = src
        for dst, src in wanted.items():
            _link(src, dst)
        for dirpath, _dirs, files in os.walk(view):  # files the store no longer names
            for name in files:
                if (f := Path(dirpath) / name) not in wanted:
                    f.unlink()
    view.mkdir(parents=True, exist_ok=True)
    return view


def _link(src: Path, dst: Path) -> None:
    try:
        s = src.stat()
    except FileNotFoundError:
        return  # removed meanwhile (a store file being replaced): the next sync links it
    try:
        d = dst.stat()
        if (d.st_ino, d.st_dev) == (s.st_ino, s.st_dev):
            return
        dst.unlink()
    except FileNotFoundError:
        dst.parent.mkdir(parents=True, exist_ok=True)
    os.link(src, dst)


def remove(snap_id: str, p: Paths | None = None) -> None:
    """Drop a snapshot's view (its clones keep their bind mount of the files they map)."""
    p = p or paths()
    with _locked(p):
        shutil.rmtree(root(p) / snap_id, ignore_errors=True)


def sweep(p: Paths | None = None) -> list[str]:
    """Remove the views of snapshots that no longer exist (``bunshin gc``)."""
    p = p or paths()
    gone = []
    if not root(p).exists():
        return gone
    with _locked(p):
        for d in root(p).iterdir():
            if d.is_dir() and d.name != EMPTY and not (p.snapshots / d.name).is_dir():
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    if gone:
        log.info("removed %d snapshot views of deleted snapshots", len(gone))
    return gone
