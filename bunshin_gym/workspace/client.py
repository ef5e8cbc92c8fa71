"""The controller's side of the servers inside a workspace: :class:`WorkspaceClient`, the one
client of every such server (the agent, the desktop input server, the browser driver), and
:class:`AgentClient`, the agent's requests on top of it (see
:mod:`bunshin_gym.workspace.agent` and :mod:`bunshin_gym.workspace.protocol`).

The env families build their clients on :class:`WorkspaceClient` too
(``envs/osworld/desktop.py``, ``envs/webarena/browser.py``), so the reconnect policy (only
idempotent requests are sent again, once, on a fresh connection), the deadlines, the size
caps and the way a socket is reached (openat2 inside the workspace's root, never a path the
workspace controls) are written once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bunshin_gym.errors import AgentError, ChannelError
from bunshin_gym.workspace.inroot import RootedPath
from bunshin_gym.workspace.protocol import AGENT_SOCKET, DEFAULT, MAX_BLOBS, Client, _Default

IDEMPOTENT = {"ping", "read_file"}
#: default cap on each output stream of one command (the agent keeps its head and tail and
#: puts a marker between them); a command printing 800 MB costs the controller this, not that
MAX_OUTPUT = 1 << 20
#: default cap on a file read through the agent (the agent refuses a larger one)
MAX_READ = 64 << 20
#: cap on one reply's blobs: the largest read plus slack for the framing of both streams
MAX_REPLY = MAX_READ + 4 * MAX_OUTPUT
#: seconds a request may take on top of a command's own timeout (the agent's kill and drain)
EXEC_SLACK = 30.0
#: seconds for a request that runs no command (ping, read/write a file, spawn)
REQUEST_TIMEOUT = 60.0


@dataclass
class ExecResult:
    """What a command run in a workspace produced."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode(errors="replace")


class WorkspaceClient(Client):
    """A :class:`~bunshin_gym.workspace.protocol.Client` of a server inside a workspace.

    The socket is reached through the workspace's root, resolved with openat2 so that nothing
    inside the workspace can redirect it (:class:`~bunshin_gym.workspace.inroot.RootedPath`);
    failures are :class:`~bunshin_gym.errors.ChannelError`. The connection opens lazily,
    must be dropped (:meth:`close`) before every snapshot, clone or rollback (CRIU cannot dump
    a unix connection that leaves the workspace), and is reopened on the next request.

    Args:
        target: the socket inside the workspace, or a function returning it at each connect
            (a rollback gives the workspace a new PID 1, so a client that outlives one asks).
        name: what the server is, for messages (name the workspace).
        timeout: default seconds for one request.
        max_blobs: cap on one reply's blobs.
        retry_ops: the ops safe to send twice (they change nothing); only they are sent again,
            once, when a connection turns out stale. A server that dropped the connection may
            have run the request and died, so an action is never sent twice.
        connect_timeout: seconds for the connect itself (a server whose backlog is full).

    Example:
        >>> c = WorkspaceClient(RootedPath(ws.pid, "/run/bunshin/web.sock"), name="the driver", retry_ops=())
        >>> c.wait_ready(60.0)
        >>> reply, blobs = c.request({"op": "observe"})
        >>> c.close()
    """

    def __init__(self, target: RootedPath | Callable[[], RootedPath], *, name: str, timeout: float | None = 60.0,
                 max_blobs: int = MAX_BLOBS, retry_ops: Iterable[str] = ("ping",), connect_timeout: float = 10.0):
        where = target if callable(target) else (lambda: target)
        # the connector holds the target, not self: no reference cycle, so a dropped client
        # closes its socket at once (an open one would keep the workspace from a snapshot)
        super().__init__(lambda: where().connect(timeout=connect_timeout), name=name, timeout=timeout,
                         max_blobs=max_blobs, retry_ops=retry_ops, error=ChannelError)

    def wait_ready(self, timeout: float, *, ping_timeout: float = 10.0, interval: float = 0.05,
                   alive: Callable[[], bool] = lambda: True) -> dict:
        """Wait until the server answers ``ping`` (its socket appears once it runs) and return
        the reply; the last :class:`ChannelError` once ``timeout`` seconds have passed or
        ``alive()`` says the server will not come (its process died)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.request({"op": "ping"}, timeout=ping_timeout)[0]
            except ChannelError:
                if time.monotonic() > deadline or not alive():
                    raise
                time.sleep(interval)


class AgentClient:
    """One connection to a workspace's agent, opened lazily and droppable at any time.

    The socket is reached through the workspace's root, resolved with openat2 so that
    nothing inside the workspace can redirect it (:class:`~bunshin_gym.workspace.inroot.RootedPath`).
    Every request has a deadline and a cap on its reply (:data:`MAX_REPLY`); a command's
    output is cut by the agent at :data:`MAX_OUTPUT` per stream unless the request says
    otherwise. Requests on one client are serialised; use several clients for concurrency.
    """

    def __init__(self, pid1: int, name: str, *, max_output: int = MAX_OUTPUT, max_read: int = MAX_READ):
        self._name = name
        self.max_output = max_output
        self.max_read = max_read
        self._client = WorkspaceClient(RootedPath(pid1, AGENT_SOCKET), name=f"{name}: agent", timeout=REQUEST_TIMEOUT,
                                       max_blobs=MAX_REPLY, retry_ops=IDEMPOTENT, connect_timeout=REQUEST_TIMEOUT)

    def wait_ready(self, timeout: float) -> None:
        # polled fast: a restored agent answers within milliseconds, and a fork waits on it
        self._client.wait_ready(timeout, ping_timeout=max(1.0, timeout), interval=0.002)

    def rename(self, name: str) -> None:
        """Name another workspace in errors (a restore made beside one and handed to another)."""
        self._name = name
        self._client.name = f"{name}: agent"

    def disconnect(self) -> None:
        """Drop the connection (CRIU cannot dump a unix connection that leaves the workspace)."""
        self._client.close()

    def request(self, header: dict, blobs: Sequence[bytes] = (), *,
                timeout: float | None | _Default = DEFAULT) -> tuple[dict, list[bytes]]:
        """One request; :class:`ChannelError` when the agent cannot be reached, does not answer
        in time or answers over the cap, :class:`AgentError` when the request failed inside."""
        op = header.get("op")
        cap = MAX_REPLY
        if op == "exec":
            header = dict(header)
            if header.get("max_output") is None:
                header["max_output"] = self.max_output
            if isinstance(timeout, _Default):
                # the agent enforces the command's own timeout; ours covers its kill and drain
                timeout = None if header.get("timeout") is None else header["timeout"] + EXEC_SLACK
            cap = max(cap, 2 * header["max_output"] + 4096)  # both streams, each with its marker
        elif op == "read_file":
            header = dict(header)
            if header.get("max_bytes") is None:
                header["max_bytes"] = self.max_read
            cap = max(cap, header["max_bytes"])
        reply, out = self._client.request(header, blobs, timeout=timeout, max_blobs=cap)
        if "error" in reply:
            raise AgentError(f"{self._name}: {op}: {reply['error']}", reply.get("errno"))
        return reply, out
