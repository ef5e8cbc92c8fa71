"""Every public exception of bunshin-gym, under one base: :class:`BunshinError`.

The lowest layer of the package: it imports nothing of bunshin_gym, so any module may
import it. The modules that used to define these classes re-export them, so the old import
paths (``bunshin_gym.workspace.errors``, ``bunshin_gym.core.env``, ...) keep working.

Each class also keeps the standard base it always had (``RuntimeError``, ``ValueError``,
``KeyError``, ``OSError``), so code that caught those still does; :class:`ResetNeeded` is
gymnasium's own ``gymnasium.error.ResetNeeded`` as well, so a caller that catches
gymnasium's error (as gymnasium's wrappers raise it) catches bunshin's too.

The subsystems above the env families define their own errors where they live, each a
``BunshinError`` too: the service's (``bunshin_gym.serve``: ``ServeError`` and its HTTP
statuses, ``FrameError``, ``TokenFileError``) and its client's (``bunshin_gym.remote.RemoteError``).

The hierarchy::

    BunshinError
    ├── WorkspaceError (RuntimeError)      a workspace could not be created, reached or used
    │   ├── WorkspaceClosed
    │   ├── UnknownImage (KeyError)
    │   ├── AgentError                     the request ran and failed inside the workspace
    │   ├── ChannelError                   a server inside could not be reached / timed out / too large
    │   ├── SetupError                     a host prerequisite is missing
    │   ├── ForkError
    │   └── SnapshotError
    │       └── FlattenUnavailable
    ├── ProtocolError                      the wire (bunshin_gym.workspace.protocol) and its subclasses
    ├── TaskError (ValueError)             a malformed task file
    ├── ActionError (ValueError)           a malformed or impossible action
    ├── ActionSyntaxError (ValueError)     a WebArena action off the grammar
    ├── URLRefused (ValueError)            a URL outside the env's sites
    ├── ResetNeeded (gymnasium.error.ResetNeeded, RuntimeError)
    ├── DriverError (RuntimeError)         the browser driver answered with an error
    └── XError (OSError)                   the X server refused a connection or a request

Example:
    >>> from bunshin_gym.errors import BunshinError
    >>> try:
    ...     env.step("ls")
    ... except BunshinError as e:
    ...     print("bunshin says:", e)
"""

from __future__ import annotations

import gymnasium.error


class BunshinError(Exception):
    """The base of every exception bunshin-gym raises on purpose."""


# workspaces ----------------------------------------------------------------------------
class WorkspaceError(BunshinError, RuntimeError):
    """A workspace could not be created, reached or used. Every message names the
    workspace, image or path at fault."""


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


class FlattenUnavailable(SnapshotError):
    """pycriu (or its protobuf runtime) is missing: run scripts/setup.sh (criu/pycriu.sh)."""


# the wire --------------------------------------------------------------------------------
class ProtocolError(BunshinError):
    """The peer sent something that is not a message, or closed mid-message.

    The controller's :mod:`bunshin_gym.workspace.protocol` raises this class and its
    subclasses there (``ReplyTooLarge``, ``RequestTimeout``, ``Unreachable``); the copy of
    that module shipped into a workspace, where bunshin_gym is not importable, defines its
    own."""


# tasks and episodes ------------------------------------------------------------------------
class TaskError(BunshinError, ValueError):
    """A task file is malformed or names something unsupported (the message says what)."""


class ActionError(BunshinError, ValueError):
    """A malformed or impossible action: reported in the observation/info, never raised by
    ``step``."""


class ActionSyntaxError(BunshinError, ValueError):
    """A WebArena action string does not follow the grammar (the message shows the right form)."""


class URLRefused(BunshinError, ValueError):
    """A URL outside the env's sites (a local file, a browser page, another host or port)."""


class ResetNeeded(BunshinError, gymnasium.error.ResetNeeded, RuntimeError):
    """``step`` before ``reset``, or after the episode ended (gymnasium's own error, too)."""


# env families' servers ---------------------------------------------------------------------
class DriverError(BunshinError, RuntimeError):
    """The browser driver answered with an error (a failed browser operation). ``reply``: the
    driver's whole reply where it answered (a failed action's ``element_box`` besides its
    ``error``), else None."""

    def __init__(self, message: str, reply: dict | None = None):
        super().__init__(message)
        self.reply = reply


class XError(BunshinError, OSError):
    """The X server refused the connection or a request."""


__all__ = [
    "ActionError", "ActionSyntaxError", "AgentError", "BunshinError", "ChannelError", "DriverError",
    "FlattenUnavailable", "ForkError", "ProtocolError", "ResetNeeded", "SetupError", "SnapshotError", "TaskError",
    "URLRefused", "UnknownImage", "WorkspaceClosed", "WorkspaceError", "XError",
]
