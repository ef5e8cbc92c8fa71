"""Errors of the workspace layer, re-exported from :mod:`bunshin_gym.errors` (where every
public exception of the package lives, under ``BunshinError``); this import path stays."""

from __future__ import annotations

from bunshin_gym.errors import (
    AgentError,
    ChannelError,
    ForkError,
    SetupError,
    SnapshotError,
    UnknownImage,
    WorkspaceClosed,
    WorkspaceError,
)

__all__ = ["AgentError", "ChannelError", "ForkError", "SetupError", "SnapshotError", "UnknownImage",
           "WorkspaceClosed", "WorkspaceError"]
