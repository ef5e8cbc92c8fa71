"""The memory modes and the backend of each: the one table a new mode is added to.

Adding a mode: write its backend (a :class:`~.base.MemoryBackend` subclass in a file of its
own), then add its name to :class:`MemoryMode` and its class to ``_BACKENDS`` here.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path

from bunshin_gym.config import Paths
from bunshin_gym.workspace.memory.base import MemoryBackend, Reclaim
from bunshin_gym.workspace.memory.copy import CopyBackend
from bunshin_gym.workspace.memory.kmod import KmodBackend
from bunshin_gym.workspace.memory.ksm import KsmBackend
from bunshin_gym.workspace.memory.map_anon import MapAnonBackend
from bunshin_gym.workspace.memory.share import ShareBackend
from bunshin_gym.workspace.records import Record

log = logging.getLogger(__name__)

class MemoryMode(StrEnum):
    COPY = "copy"
    KSM = "ksm"
    SHARE = "share"
    KMOD = "kmod"
    MAP_ANON = "map-anon"

    @classmethod
    def parse(cls, value: str | MemoryMode) -> MemoryMode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown memory mode {value!r}; choose one of "
                             f"{', '.join(m.value for m in cls)}") from None


DEFAULT_MODE = MemoryMode.SHARE

_BACKENDS: dict[MemoryMode, MemoryBackend] = {
    MemoryMode(b.name): b for b in (CopyBackend(), KsmBackend(), ShareBackend(), KmodBackend(), MapAnonBackend())
}
if set(_BACKENDS) != set(MemoryMode):  # a mode without a backend (or the reverse) fails at import
    raise RuntimeError(f"memory modes without a backend: {sorted(set(MemoryMode) - set(_BACKENDS))}")


def backend(mode: str | MemoryMode) -> MemoryBackend:
    """The backend of a mode (``ValueError`` naming the modes for an unknown one)."""
    return _BACKENDS[MemoryMode.parse(mode)]


def for_record(rec: Record) -> MemoryBackend:
    """The backend that restored a workspace and tears it down: its mode's, except for a kmod
    holder (recorded in ``copy`` mode, which is how its memory is restored), which belongs to
    the kmod backend that made it. A record of a mode this version does not know (written by
    another version) gets the plain backend, so that it can still be checked and reclaimed."""
    if rec.holder_of:
        return _BACKENDS[MemoryMode.KMOD]
    try:
        return _BACKENDS[MemoryMode(rec.memory_mode)]
    except ValueError:
        log.warning("workspace %s has memory mode %r, unknown to this version: torn down as a plain "
                    "copy clone", rec.id, rec.memory_mode)
        return _BACKENDS[MemoryMode.COPY]


def all_backends() -> list[MemoryBackend]:
    return list(_BACKENDS.values())


def dump_env(p: Paths) -> dict[str, str]:
    """Environment for ``criu dump`` of any workspace: every backend's."""
    env: dict[str, str] = {}
    for b in _BACKENDS.values():
        env.update(b.dump_env(p))
    return env


def release_unused(p: Paths, snap_id: str | None) -> None:
    """A workspace restored from ``snap_id`` (or a fresh one: None) was reclaimed."""
    for b in _BACKENDS.values():
        b.release_unused(p, snap_id)


def snapshot_removed(snap_id: str, p: Paths, reclaim: Reclaim) -> None:
    """A snapshot is being deleted: every backend drops what it keeps for it."""
    for b in _BACKENDS.values():
        b.on_snapshot_removed(snap_id, p, reclaim)


def images_rewritten(snap_id: str, criu_dir: Path, names: list[str], p: Paths) -> None:
    """A snapshot's images ``names`` were rewritten in place: every backend updates its copies."""
    for b in _BACKENDS.values():
        b.on_images_rewritten(snap_id, criu_dir, names, p)


def collect(p: Paths, reclaim: Reclaim) -> list[str]:
    """gc: every backend's helper workspaces that nothing needs any more (ids reclaimed)."""
    return [ws_id for b in _BACKENDS.values() for ws_id in b.collect(p, reclaim)]


def sweep(p: Paths) -> list[str]:
    """gc: every backend's state of workspaces that no longer exist (what was dropped)."""
    return [name for b in _BACKENDS.values() for name in b.sweep(p)]
