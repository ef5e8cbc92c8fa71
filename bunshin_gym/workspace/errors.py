"""Errors of the workspace layer. Every message names the workspace, image or path at fault."""

from __future__ import annotations


class WorkspaceError(RuntimeError):
    """A workspace could not be created, reached or used."""


class WorkspaceClosed(WorkspaceError):
    """The workspace was closed; it cannot be used any more."""


class UnknownImage(WorkspaceError, KeyError):
    """No image of that name exists (the message lists the known ones)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class AgentError(WorkspaceError):
    """The agent ran the request and it failed inside the workspace (no such file, ...)."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ChannelError(WorkspaceError):
    """A server inside the workspace (the agent, the desktop input server, the browser driver,
    the X server) could not be reached, did not answer within the request's time, or sent a
    reply over the size cap. The request failed; the controller is unharmed and reconnects
    on the next request."""


class SetupError(WorkspaceError):
    """A host prerequisite is missing; the message says which command fixes it."""


class ForkError(WorkspaceError):
    """A snapshot, fork or rollback failed; the message names the CRIU log. The source is
    left running and unchanged."""


class SnapshotError(WorkspaceError):
    """No such snapshot, a corrupt one (named), or one still in use."""
