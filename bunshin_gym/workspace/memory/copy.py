"""The ``copy`` memory mode: a stock CRIU restore, every page copied into the clone."""

from __future__ import annotations

from bunshin_gym.workspace.memory.base import MemoryBackend


class CopyBackend(MemoryBackend):
    """Nothing shared, nothing to set up: the base class's defaults are this mode."""

    name = "copy"
