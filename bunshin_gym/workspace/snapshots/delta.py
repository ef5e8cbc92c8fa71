"""Snapshots of clones as deltas: pages "in parent".

A clone in share mode maps its anonymous memory from a tmpfs copy of its snapshot's page
images (:mod:`bunshin_gym.workspace.uffd`). When it is snapshotted, CRIU (patch 0014) records
every page the clone never wrote since its restore as "in parent" instead of dumping it: a
child snapshot holds only what changed, and its CRIU images name the parent's
(``criu/parent``). Restoring it maps those pages from the parent's tmpfs copy.

A clone in copy or ksm mode is write-tracked (:mod:`bunshin_gym.workspace.memory.tracking`):
its private anonymous memory was write-protected in userfaultfd's asynchronous mode right
after its restore, and CRIU (patch 0018) records every page still write-protected (PAGEMAP_SCAN:
not written since) as in the parent. Its changed pages of private file mappings are dumped in
full (userfaultfd cannot write-protect regular files).

:func:`dump_delta` gives ``criu dump`` what it needs for that; :func:`materialize` makes a
delta self-contained again (before flattening, so that its ancestors may go), copying its
pages in parent into a pages image of its own. Pagemaps are read and written with CRIU's
pycriu.

Example:
    >>> args, env = delta.dump_delta(rec, parent_id)   # extra ``criu dump`` arguments
    >>> delta.materialize(snap.criu_dir)               # no ``criu/parent`` afterwards
"""

from __future__ import annotations

import bisect
import os
import shutil
from pathlib import Path

from bunshin_gym.config import Paths, criu_carries, paths, uffd_delta
from bunshin_gym.workspace import memory, records
from bunshin_gym.workspace.errors import ForkError
from bunshin_gym.workspace.snapshots.criu_images import load_image, write_image

#: the criu binary dumps share clones as deltas if it contains this string (criu/patches/0014-*)
DELTA_MARKER = b"CRIU_UFFD_PARENT"


def criu_has_delta(p: Paths) -> bool:
    """The criu binary can dump share clones as deltas (criu/patches/0014-*)."""
    return criu_carries(DELTA_MARKER, p)


# pagemap-N.img (read and written with CRIU's pycriu): a head {pages_id}, then entries {vaddr,
# nr_pages, flags}; the data of PE_PRESENT entries follow each other in pages-<pages_id>.img;
# PE_PARENT entries have theirs in the parent's images (criu_dir/parent).
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
PAGE = 4096


def read_pagemap(path: Path) -> tuple[str, int, list[tuple[int, int, int]]]:
    """(magic, pages_id, [(vaddr, nr_pages, flags)]) of a pagemap-N.img."""
    img = load_image(path)
    if not img["entries"]:
        return img["magic"], 0, []
    head, *ents = img["entries"]
    return img["magic"], head["pages_id"], [
        (e["vaddr"], e.get("nr_pages") or e.get("compat_nr_pages", 0),
         e.get("flags", PE_PARENT if e.get("in_parent") else PE_PRESENT)) for e in ents]


def write_pagemap(path: Path, magic: str, pages_id: int, ents: list[tuple[int, int, int]]) -> None:
    entries = [{"pages_id": pages_id}] + [{"vaddr": v, "compat_nr_pages": 0, "nr_pages": n, "flags": fl}
                                               for v, n, fl in ents]
    write_image({"magic": magic, "entries": entries}, path, paths())


def _task_pagemaps(criu_dir: Path) -> list[Path]:
    return sorted(f for f in criu_dir.glob("pagemap-*.img") if f.stem.split("-", 1)[1].isdigit())


def pagemaps_with_parent(criu_dir: Path) -> list[Path]:
    """The task pagemaps of a snapshot that have pages in its parent."""
    return [f for f in _task_pagemaps(criu_dir) if any(fl & PE_PARENT for _, _, fl in read_pagemap(f)[2])]


def _copy(src: int, off: int, dst, n: int) -> None:
    while n:
        chunk = os.pread(src, min(n, 8 << 20), off)
        if not chunk:
            raise ForkError("a pages image is shorter than its pagemap says")
        dst.write(chunk)
        off += len(chunk)
        n -= len(chunk)


class _Level:
    """The present runs of one snapshot's pagemap of a task (for resolving pages in parent)."""

    def __init__(self, criu_dir: Path, name: str):
        self.dir = criu_dir
        _, self.pages_id, ents = read_pagemap(criu_dir / name)
        self.runs, off = [], 0  # (vaddr, nr, flags, offset in the pages image)
        for v, n, fl in ents:
            self.runs.append((v, n, fl, off))
            if fl & PE_PRESENT:
                off += n * PAGE
        self.runs.sort()
        self.starts = [r[0] for r in self.runs]

    def find(self, a: int):
        k = bisect.bisect_right(self.starts, a) - 1
        if k >= 0 and a < self.runs[k][0] + self.runs[k][1] * PAGE:
            return self.runs[k]
        return None


def _resolve(levels: list[_Level], files: dict, a: int, end: int, out, name: str) -> None:
    """Copy the pages [a, end) from levels[0], the parent, into ``out``; runs the parent has in
    its own parent come from further up the chain (levels[1:])."""
    if not levels:
        raise ForkError(f"{name}: page {a:#x} is in parent, but no ancestor has it")
    lv = levels[0]
    while a < end:
        r = lv.find(a)
        if r is None:
            raise ForkError(f"{name}: page {a:#x} is in parent, but {lv.dir} lacks it")
        v, n, fl, off = r
        m = min(end, v + n * PAGE) - a
        if fl & PE_PRESENT:
            if lv.dir not in files:
                files[lv.dir] = open(lv.dir / f"pages-{lv.pages_id}.img", "rb")  # noqa: SIM115
            _copy(files[lv.dir].fileno(), off + (a - v), out, m)
        elif fl & PE_PARENT:
            _resolve(levels[1:], files, a, a + m, out, name)
        else:
            raise ForkError(f"{name}: page {a:#x} is neither present nor in parent in {lv.dir}")
        a += m


def _chain(criu_dir: Path) -> list[Path]:
    out = []
    link = criu_dir / "parent"
    while link.is_symlink() or link.exists():
        d = link.resolve()
        out.append(d)
        link = d / "parent"
    return out


def _flatten_pagemaps(criu_dir: Path, out_dir: Path, new_pages_id) -> None:
    """Write into ``out_dir`` the task pagemaps of ``criu_dir`` that have pages in parent, with
    those pages copied in from its ancestors, and their pages images (renamed by new_pages_id)."""
    chain = _chain(criu_dir)
    for pm in pagemaps_with_parent(criu_dir):
        magic, pages_id, ents = read_pagemap(pm)
        levels = [_Level(d, pm.name) for d in chain if (d / pm.name).exists()]
        files: dict = {}
        pid_ = new_pages_id(pages_id)
        new, src_off = [], 0
        try:
            with open(criu_dir / f"pages-{pages_id}.img", "rb") as srcf, \
                    open(out_dir / f"pages-{pid_}.img", "wb") as out:
                for v, n, fl in ents:
                    if fl & PE_PRESENT:
                        _copy(srcf.fileno(), src_off, out, n * PAGE)
                        src_off += n * PAGE
                    elif fl & PE_PARENT:
                        _resolve(levels, files, v, v + n * PAGE, out, str(pm))
                        fl = (fl & ~PE_PARENT) | PE_PRESENT
                    new.append((v, n, fl))
        finally:
            for f in files.values():
                f.close()
        write_pagemap(out_dir / pm.name, magic, pid_, new)


def dump_delta(rec: records.Record, parent_id: str | None, p: Paths | None = None) -> tuple[list[str], dict]:
    """``criu dump`` arguments and environment that make a snapshot of a clone served by its
    monitor a delta: the pages it never wrote since its restore from ``parent_id`` are recorded
    as in the parent (criu/patches/0014-*, 0018-*). ``BUNSHIN_UFFD_DELTA=0`` turns it off.
    Whether a clone may be dumped so is its memory backend's call (share over uffd: the parent's
    tmpfs copy of the images, which the clone maps, exists; copy and ksm: its write tracker has
    run since its restore from ``parent_id``)."""
    p = p or paths()
    if (not parent_id or not uffd_delta() or not memory.for_record(rec).can_dump_delta(rec, parent_id, p)
            or not criu_has_delta(p)):
        return [], {}
    return ["--prev-images-dir", f"../../{parent_id}/criu"], {"CRIU_UFFD_PARENT": parent_id}


def materialize(criu_dir: Path) -> bool:
    """Make a snapshot's images independent of its parent's (before flattening, so that the
    parent may go): every page in parent is copied into a new pages image (a new id: the old
    file, which clones may map or images may name, stays as it is) and ``parent`` is removed.
    Clones running from the snapshot's tmpfs copy keep it. Returns whether anything was done."""
    if not pagemaps_with_parent(criu_dir):
        return False
    tmp = criu_dir.parent / ".materialize"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        ids = [int(f.stem[6:]) for f in criu_dir.glob("pages-*.img") if f.stem[6:].isdigit()]
        base = max(ids, default=0) + 1000
        _flatten_pagemaps(criu_dir, tmp, lambda old: base + old)
        written = [f for f in tmp.iterdir() if f.is_file()]
        for f in sorted(written, key=lambda f: not f.name.startswith("pages-")):  # data first
            os.replace(f, criu_dir / f.name)
        (criu_dir / "parent").unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


