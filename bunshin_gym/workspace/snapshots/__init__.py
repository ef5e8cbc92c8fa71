"""The snapshot store: snapshot directories and their metadata, lineage (who needs whom), CRIU
image helpers, share-mode deltas and flattening. Knows nothing of processes or ``Workspace``:
forks, rollbacks and the ``Snapshot`` handle are above it (``workspace/snapshot.py``)."""
