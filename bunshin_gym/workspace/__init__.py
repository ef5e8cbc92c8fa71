"""The workspace runtime: images, live container workspaces, their snapshots, forks and rollbacks."""

from bunshin_gym.workspace.client import ExecResult
from bunshin_gym.workspace.errors import (
    AgentError,
    SetupError,
    UnknownImage,
    WorkspaceClosed,
    WorkspaceError,
)
from bunshin_gym.workspace.images import ImageStore
from bunshin_gym.workspace.workspace import MemoryStats, Workspace

__all__ = [
    "AgentError", "ExecResult", "ImageStore", "MemoryStats", "SetupError", "UnknownImage",
    "Workspace", "WorkspaceClosed", "WorkspaceError",
]
