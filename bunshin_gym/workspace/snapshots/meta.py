"""``meta.json``, typed: :class:`SnapshotMeta`, and its one reader and one writer.

The file's layout is that of every earlier version: a flat JSON object. A key this version
does not know (``migrated_from``, written by ``bunshin cluster``; a later version's) is kept
in :attr:`SnapshotMeta.other` and written back; a known key that an older snapshot lacks
gets its default and stays absent when the file is written again, so a file read and
written back has the same keys (``tests/workspace/test_snapshot_meta.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunshin_gym.errors import SnapshotError
from bunshin_gym.workspace import buildonce

#: the file of a snapshot directory that holds its metadata, written last
META_FILE = "meta.json"


@dataclass
class SnapshotMeta:
    """What ``meta.json`` records of one snapshot."""

    id: str
    image: str = ""
    image_path: str = ""
    layer: str = ""
    memory_mode: str = "copy"
    parent: str | None = None
    workspace: str | None = None  # the workspace it was taken of
    depth: int = 0  # snapshots above it in its parent chain
    #: how many ancestors' page files its images may name (0: none; see ``flatten``; None:
    #: taken before this was recorded)
    ref_depth: int | None = None
    #: the snapshots whose files its images name (None: taken before this was recorded)
    refs: list[str] | None = None
    userns_base: int | None = None  # the id map its processes and files have
    limits: dict | None = None  # the workspace's limits, inherited by every clone
    created: float = 0.0
    ephemeral: bool = False  # deleted by its last user's close (``release``)
    #: [pid, start time] of the process that releases it when done with it (an env's boot and
    #: reset snapshots); ``bunshin gc`` releases it once that process is gone (None: kept)
    holder: list[int] | None = None
    #: the directory of the owner that keeps it past every process (a prefix cache's, where
    #: its tree names it); ``bunshin gc`` releases it once that directory is gone (None: kept)
    kept_by: str | None = None
    tags: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    criu_bytes: int = 0
    #: ``{image name: [size, "crc32:<hex>"]}`` (None: taken before images carried sums)
    checksums: dict[str, list] | None = None
    flattened: dict | None = None  # what flattening did, when it did (``flatten.flatten_dir``)
    flatten_error: str | None = None  # why a snapshot past the depth limit stayed a chain
    #: keys this version does not know, written back as they were read
    other: dict[str, Any] = field(default_factory=dict)
    #: the keys the file has, in its order: a known key an older file lacks is written only
    #: once it is set to something other than its default
    _keys: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def new(cls, **fields: Any) -> SnapshotMeta:
        """The metadata of a snapshot being taken: the keys given are the file's."""
        return cls(**fields, _keys=tuple(fields))

    @classmethod
    def from_dict(cls, data: dict) -> SnapshotMeta:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("not a snapshot's metadata (an object with an id)")
        return cls(**{k: v for k, v in data.items() if k in _NAMES},
                   other={k: v for k, v in data.items() if k not in _NAMES}, _keys=tuple(data))

    def to_dict(self) -> dict:
        """The JSON object of ``meta.json``: its keys in the order read (or given), then known
        keys set since, unknown keys as they were."""
        values = {f.name: getattr(self, f.name) for f in _FIELDS}
        values.update(self.other)
        out = {k: values[k] for k in self._keys if k in values}
        for f in _FIELDS:
            if f.name not in out and values[f.name] != _default(f):
                out[f.name] = values[f.name]
        out.update({k: v for k, v in self.other.items() if k not in out})
        return out


_FIELDS = [f for f in dataclasses.fields(SnapshotMeta) if f.name not in ("other", "_keys")]
_NAMES = {f.name for f in _FIELDS}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return object()  # a required field: always written


def read(path: Path) -> SnapshotMeta:
    """The metadata of the snapshot directory ``path``; :class:`SnapshotError` naming the
    snapshot when it has none (incomplete) or an unreadable one (corrupt)."""
    try:
        data = json.loads((path / META_FILE).read_text())
        return SnapshotMeta.from_dict(data)
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {path.name} is corrupt or incomplete: no {META_FILE}") from None
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise SnapshotError(f"snapshot {path.name} is corrupt: {META_FILE}: {e}") from None


def write(path: Path, meta: SnapshotMeta) -> None:
    """Write ``meta.json`` atomically: a failed write (a full disk) leaves the old one, or none.
    Each write goes through a temporary file of its own: with one shared name, two writers
    (threads keeping and releasing one snapshot) renamed each other's file half written, and
    readers saw an empty ``meta.json`` ("corrupt") or the rename failed."""
    buildonce.replace_text(path / META_FILE, json.dumps(meta.to_dict(), indent=1), 0o644)


@contextlib.contextmanager
def updating(path: Path) -> Iterator[SnapshotMeta]:
    """``meta.json`` of ``path`` as on disk now, written back when the block ends: a
    read-modify-write that no other one (thread or process) interleaves with, so none loses
    another's change (an ``flock`` on the snapshot directory itself)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {path.name} is corrupt or incomplete: no {META_FILE}") from None
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        meta = read(path)
        yield meta
        write(path, meta)
    finally:
        os.close(dir_fd)  # drops the lock
