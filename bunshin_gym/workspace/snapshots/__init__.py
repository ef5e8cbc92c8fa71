"""The snapshot store: snapshot directories and their metadata, lineage (who needs whom), CRIU
image helpers, share-mode deltas, flattening and the ``/.snap`` views. Knows nothing of
processes or ``Workspace``: taking and restoring are ``workspace/forking.py``, the ``Snapshot``
handle is in ``workspace/workspace.py`` (imported as ``bunshin_gym.workspace.snapshot``)."""
