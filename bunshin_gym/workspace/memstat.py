"""Memory of groups of workspaces, counted the way sharing makes meaningful.

A page shared copy-on-write by many clones is charged to whichever cgroup touched it
first, and PSS splits it among its mappers; neither tells what a *group* of clones costs.
:func:`group_memory` counts the distinct physical pages the group maps (each once, from
``/proc/PID/pagemap`` page frame numbers, readable as root), next to the sum of PSS.

Example:
    >>> clones = snap.fork(8)
    >>> group_memory([p for c in clones for p in c.pids()]).unique_mb
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
_PFN_MASK = np.uint64((1 << 55) - 1)
_PRESENT = np.uint64(1 << 63)
_FILE_OR_SHARED = np.uint64(1 << 61)  # pagemap: a page-cache (or shared anonymous) page


@dataclass
class GroupMemory:
    unique: int  # bytes of distinct resident pages (anonymous and file) mapped by the group
    unique_anon: int  # ... of which in private anonymous or CoW-ed mappings
    pss: int  # sum of PSS over the group's processes
    rss: int
    processes: int

    @property
    def unique_mb(self) -> float:
        return round(self.unique / 2**20, 1)

    def as_mb(self) -> dict:
        return {k: (round(v / 2**20, 1) if k != "processes" else v) for k, v in vars(self).items()}


def _resident_maps(pid: int) -> list[str]:
    """The ``/proc/PID/maps`` lines of the mappings that have resident pages (from ``smaps``:
    chromium reserves tens of GB it never touches, whose pagemap would be read for nothing)."""
    out, head = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line[:1].isupper() or ":" not in line.split(None, 1)[0]:
            head = line  # a mapping's header line; its fields follow
        elif head is not None and line.startswith("Rss:"):
            if int(line.split()[1]):
                out.append(head)
            head = None
    return out


def _frames(pid: int) -> tuple[np.ndarray, np.ndarray]:
    """Physical frame numbers of a process's resident pages: (all, anonymous/private-writable)."""
    frames, anon = [], []
    try:
        maps = _resident_maps(pid)
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    try:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if fields[-1] == "[vsyscall]":
                continue
            n = (end - start) // PAGE
            raw = os.pread(fd, n * 8, (start // PAGE) * 8)
            entries = np.frombuffer(raw, dtype=np.uint64)
            present = entries[(entries & _PRESENT) != 0] & _PFN_MASK
            frames.append(present)
            private_writable = fields[1][1] == "w" and fields[1][3] == "p"
            if private_writable and (len(fields) < 6 or fields[-1].startswith("[")):
                anon.append(present)
    finally:
        os.close(fd)
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0, np.uint64)  # noqa: E731
    return cat(frames), cat(anon)


ROLLUP_KEYS = ("Pss", "Rss", "Private_Clean", "Private_Dirty")


def rollup(pids: list[int]) -> dict[str, int]:
    """Bytes of PSS, RSS and private memory summed over processes (``smaps_rollup``);
    processes that exited meanwhile count nothing."""
    total = dict.fromkeys(ROLLUP_KEYS, 0)
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in total:
                total[key] += int(rest.split()[0]) * 1024
    return total


def group_memory(pids: list[int]) -> GroupMemory:
    """Memory of a group of processes, shared pages counted once."""
    all_frames, anon_frames = [], []
    for pid in pids:
        f, a = _frames(pid)
        all_frames.append(f)
        anon_frames.append(a)
    roll = rollup(pids)
    uniq = lambda xs: int(np.unique(np.concatenate(xs)).size) if xs else 0  # noqa: E731
    return GroupMemory(unique=uniq(all_frames) * PAGE, unique_anon=uniq(anon_frames) * PAGE,
                       pss=roll["Pss"], rss=roll["Rss"], processes=len(pids))


@dataclass
class CopiedPages:
    """Private copies a group made of pages of files it maps ``MAP_PRIVATE`` (copy-on-write),
    by whether the copy still holds the file page's content. A share clone's anonymous memory
    is such a mapping of its snapshot's page image: ``changed`` is what the clone really wrote,
    ``unchanged`` pages a program rewrote with the bytes they held (a repaint of the same pixels)."""

    unchanged: int  # bytes
    changed: int

    def as_mb(self) -> dict:
        return {k: round(v / 2**20, 1) for k, v in vars(self).items()}


def _compare_copies(pagemap: int, mem: int, backing: int, fields: list[str]) -> tuple[int, int]:
    """(unchanged, changed) private copies in one mapping of ``backing``."""
    start, end = (int(x, 16) for x in fields[0].split("-"))
    entries = np.frombuffer(os.pread(pagemap, (end - start) // PAGE * 8, start // PAGE * 8), np.uint64)
    same = changed = 0
    for i in np.nonzero((entries & _PRESENT != 0) & (entries & _FILE_OR_SHARED == 0))[0].tolist():
        try:
            ours = os.pread(mem, PAGE, start + i * PAGE)
        except OSError:
            break  # unmapped meanwhile
        theirs = os.pread(backing, PAGE, int(fields[2], 16) + i * PAGE).ljust(PAGE, b"\0")
        same, changed = (same + 1, changed) if ours == theirs else (same, changed + 1)
    return same, changed


def copied_pages(pids: list[int], device: int) -> CopiedPages:
    """Private copies the processes made of pages of files on ``device`` (``st_dev``), e.g. the
    tmpfs of share clones' page images (:func:`bunshin_gym.workspace.uffd.images_root`)."""
    same = changed = 0
    for pid in pids:
        with contextlib.ExitStack() as files:
            def fd(path: str) -> int:
                n = os.open(path, os.O_RDONLY)
                files.callback(os.close, n)
                return n

            try:
                maps = _resident_maps(pid)
                pagemap, mem = fd(f"/proc/{pid}/pagemap"), fd(f"/proc/{pid}/mem")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # the process exited meanwhile
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or fields[1][3] != "p" or not fields[5].startswith("/"):
                    continue
                try:  # the mapped file itself, whatever path the process sees it under
                    backing = os.open(f"/proc/{pid}/map_files/{fields[0]}", os.O_RDONLY)
                except OSError:
                    continue
                try:
                    if os.fstat(backing).st_dev == device:
                        s, c = _compare_copies(pagemap, mem, backing, fields)
                        same, changed = same + s, changed + c
                finally:
                    os.close(backing)
    return CopiedPages(unchanged=same * PAGE, changed=changed * PAGE)


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes, by field name."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024
    return info


def used_memory() -> int:
    """Host memory in use (MemTotal - MemAvailable), for peaks during a fork."""
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]
