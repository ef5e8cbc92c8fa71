"""BunshinFork's snapshot handle: ``Snapshot`` (fork clones from it, delete or release it) and
``SnapshotStore`` (the snapshots on this host, as handles).

This is their import path; they are defined with the ``Workspace`` handle in
:mod:`bunshin_gym.workspace.workspace`, since each makes the other. Below them: the snapshot
store (:mod:`bunshin_gym.workspace.snapshots`: metadata, lineage, deltas, flattening),
taking and restoring (:mod:`bunshin_gym.workspace.forking`) and teardown
(:mod:`bunshin_gym.workspace.teardown`).

Example:
    >>> ws = Workspace.create("base")
    >>> snap = ws.snapshot()                 # source frozen only while dumping
    >>> a, b = snap.fork(2)                  # two live clones, fresh namespaces each
    >>> a.exec("touch /root/a"); ws.rollback(snap)
    >>> SnapshotStore().get(snap.id).users()
"""

from __future__ import annotations

from bunshin_gym.workspace.workspace import Snapshot, SnapshotStore

__all__ = ["Snapshot", "SnapshotStore"]
