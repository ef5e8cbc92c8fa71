"""One snapshot of the store: its directory and its metadata, nothing that runs.

A snapshot is an immutable directory of the pool's snapshot store::

    snapshots/<id>/meta.json   parent, image, runtime layer, memory mode, timings, tags (meta.py)
    snapshots/<id>/criu/       CRIU images of the whole process tree (dumped --leave-running)
    snapshots/<id>/fs          read-only btrfs snapshot of the workspace's upper layer
    snapshots/<id>/flat/       page files taken over from its ancestors (flatten.py)

``meta.json`` is written last: a snapshot without it is incomplete and reported as corrupt.
The ``Snapshot`` handle (forks, deletion) subclasses :class:`StoredSnapshot`.
"""

from __future__ import annotations

import os
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace import records
from bunshin_gym.workspace.memory import MemoryMode
from bunshin_gym.workspace.snapshots.meta import SnapshotMeta


class StoredSnapshot:
    """A snapshot directory of the store and its typed metadata (:attr:`metadata`)."""

    def __init__(self, path: Path, metadata: SnapshotMeta, p: Paths | None = None):
        self.path = path
        self.metadata = metadata
        self._p = p or paths()

    @property
    def meta(self) -> dict:
        """``meta.json`` as a JSON object (a copy; :attr:`metadata` is the typed record)."""
        return self.metadata.to_dict()

    id = property(lambda self: self.metadata.id)
    parent = property(lambda self: self.metadata.parent)
    image = property(lambda self: self.metadata.image)
    depth = property(lambda self: self.metadata.depth)
    tags = property(lambda self: self.metadata.tags)
    mode = property(lambda self: MemoryMode(self.metadata.memory_mode))
    criu_dir = property(lambda self: self.path / "criu")
    fs = property(lambda self: self.path / "fs")

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.metadata.workspace} parent={self.parent}>"

    def size(self) -> int:
        """Bytes of this snapshot's own CRIU images (the files are a btrfs delta)."""
        return sum(f.stat().st_size for f in self.criu_dir.iterdir() if f.is_file())

    def abandoned(self) -> bool:
        """Held (:attr:`~.meta.SnapshotMeta.holder`) by a process that is gone (the env that
        would have released it died first), or kept by an owner whose directory is gone
        (:attr:`~.meta.SnapshotMeta.kept_by`: a prefix cache deleted with its tree, which was
        the only record of it): ``bunshin gc`` releases it."""
        holder, kept_by = self.metadata.holder, self.metadata.kept_by
        if holder is not None and not records.process_alive(holder[0], holder[1]):
            return True
        return kept_by is not None and not os.path.isdir(kept_by)

    def may_need(self) -> list[str]:
        """The snapshots this one may need besides itself: its parent and those its images name."""
        return sorted({self.parent, *(self.metadata.refs or ())} - {None})
