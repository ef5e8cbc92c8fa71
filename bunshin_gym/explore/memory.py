"""Memory of live workspaces and snapshots for the explorer, split into shared and private.

A share-mode clone maps its snapshot's page images (the tmpfs copy of the CRIU images,
:func:`bunshin_gym.workspace.uffd.images_root`) copy-on-write: the pages it only reads are the
snapshot's, mapped by every clone of it; the pages it writes become its own. Neither the
cgroup (the tmpfs pages are charged to whoever copied the images) nor PSS (which splits a
page among all its mappers) says which is which, so this module counts physical pages, each
once, from ``/proc/PID/pagemap`` (as ``bunshin bench fork`` does, with
:func:`~bunshin_gym.workspace.memstat.group_memory` and
:func:`~bunshin_gym.workspace.memstat.copied_pages`):

- per workspace: ``cgroup`` (bytes charged to its memory cgroup), ``unique`` (distinct
  resident pages of its processes), ``shared`` (those that are page-image pages of a snapshot,
  still the snapshot's), ``private`` (the rest: its own; for a share clone, what it wrote or
  allocated since its restore), ``written`` (for a share clone: its private copies of image
  pages, ``changed`` or rewritten with the bytes they held), PSS and RSS;
- per snapshot: ``disk`` (its own CRIU images), and of its tmpfs image copy: ``pages``
  (resident page-image data), ``other`` (the other image files), ``mapped`` (page-image pages
  mapped by live clones, each counted once, whichever snapshot they were restored from: a
  delta's clones map the pages it left in its parent), ``held_only`` (pages no live clone maps:
  what the snapshot alone keeps in memory) and ``mapped_by`` (those clones).

Example:
    >>> s = survey()
    >>> s.workspaces["ws-1a2b"]["private"], s.snapshots["snap-3c4d"]["held_only"]
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace import records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.memstat import (
    _FILE_OR_SHARED,
    _PFN_MASK,
    _PRESENT,
    PAGE,
    copied_pages,
    group_memory,
)

log = logging.getLogger(__name__)


@dataclass
class Survey:
    """One look at the host: memory per running workspace and per snapshot with an image copy."""

    workspaces: dict[str, dict] = field(default_factory=dict)
    snapshots: dict[str, dict] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # the running workspaces it looked at
    taken: float = 0.0  # when (time.time()) it started
    seconds: float = 0.0  # how long it took


def images_dir(p: Paths | None = None) -> Path | None:
    """The tmpfs of share clones' page images, if mounted (looked at, never mounted here)."""
    root = (p or paths()).run / "uffd-images"
    return root if os.path.ismount(root) else None


def _image_files(root: Path) -> tuple[dict[int, str], dict[str, dict]]:
    """(page-image inode -> snapshot id, snapshot id -> bytes its copy holds: pages, other)."""
    owners: dict[int, str] = {}
    held: dict[str, dict] = {}
    for d in root.iterdir():
        if not d.is_dir():
            continue
        sizes = {"pages": 0, "other": 0}
        try:
            for f in d.iterdir():
                if not f.is_file() or f.is_symlink():
                    continue
                st = f.stat()
                # allocated bytes: the page images are sparse, 64 GB long past their data
                if f.name.startswith("pages-"):
                    owners[st.st_ino] = d.name
                    sizes["pages"] += st.st_blocks * 512
                else:
                    sizes["other"] += st.st_blocks * 512
        except FileNotFoundError:  # released while we look
            continue
        held[d.name] = sizes
    return owners, held


def image_frames(pids: list[int], device: int, owners: dict[int, str]) -> dict[str, np.ndarray]:
    """Physical frames of page-image pages (not private copies of them) the processes map,
    by the snapshot whose image they belong to: ``owners`` maps a page image's inode on
    ``device`` to its snapshot. Reads ``/proc/PID/maps`` (device and inode of each mapping's
    file), not ``smaps``: a clone maps its image only where it had memory, and a desktop's
    smaps is tens of thousands of lines."""
    out: dict[str, list[np.ndarray]] = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile
        try:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0":
                    continue  # anonymous
                major, minor = fields[3].split(":")
                snap = owners.get(int(fields[4])) if os.makedev(int(major, 16), int(minor, 16)) == device else None
                if snap is None:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                entries = np.frombuffer(os.pread(pagemap, (end - start) // PAGE * 8, start // PAGE * 8), np.uint64)
                cached = entries[((entries & _PRESENT) != 0) & ((entries & _FILE_OR_SHARED) != 0)] & _PFN_MASK
                out.setdefault(snap, []).append(cached)
        finally:
            os.close(pagemap)
    return {snap: np.unique(np.concatenate(parts)) for snap, parts in out.items()}


def _workspace(rec: records.Record, device: int, owners: dict[int, str]) -> tuple[dict, dict[str, np.ndarray]]:
    """One workspace's row, and the image frames it maps by snapshot."""
    cg = Cgroup(rec.cgroup)
    pids = cg.pids()
    charged = cg.memory_usage()
    frames = image_frames(pids, device, owners) if owners else {}
    total = group_memory(pids)
    shared = int(np.unique(np.concatenate(list(frames.values()))).size) * PAGE if frames else 0
    row = {"processes": len(pids), "cgroup": charged, "pss": total.pss, "rss": total.rss, "unique": total.unique,
           "shared": shared, "private": max(0, total.unique - shared), "written": None}
    if frames:  # a share clone: which of its own pages are copies of image pages
        copies = copied_pages(pids, device)
        row["written"] = {"changed": copies.changed, "unchanged": copies.unchanged}
    return row, frames


def survey(p: Paths | None = None, only: Collection[str] | None = None) -> Survey:
    """Memory of every running workspace and of every snapshot's image copy (see the module
    docs). Reads every page table of the workspaces' processes and their ``smaps``: seconds for
    a desktop (chromium has thousands of mappings), see :func:`bunshin_gym.explore.live.current_survey`.
    ``only``: look at these workspaces alone (a snapshot's ``mapped`` then counts their pages only)."""
    p = p or paths()
    out = Survey(taken=time.time())
    t0 = time.perf_counter()
    root = images_dir(p)
    owners, held = _image_files(root) if root is not None else ({}, {})
    device = os.stat(root).st_dev if root is not None else -1
    mapped: dict[str, list[np.ndarray]] = {}
    mappers: dict[str, set[str]] = {}
    for rec in records.all_records(p):
        if not rec.running() or (only is not None and rec.id not in only):
            continue
        out.seen.add(rec.id)
        try:
            row, frames = _workspace(rec, device, owners)
        except OSError as e:  # going away while we read it (its processes, its cgroup)
            log.debug("workspace %s: memory not readable: %s", rec.id, e)
            continue
        out.workspaces[rec.id] = row
        for snap, f in frames.items():
            mapped.setdefault(snap, []).append(f)
            mappers.setdefault(snap, set()).add(rec.id)
    for snap, sizes in held.items():
        n = int(np.unique(np.concatenate(mapped[snap])).size) * PAGE if snap in mapped else 0
        out.snapshots[snap] = {**sizes, "mapped": n, "held_only": max(0, sizes["pages"] - n),
                               "mapped_by": sorted(mappers.get(snap, ()))}
    out.seconds = round(time.perf_counter() - t0, 3)
    return out
