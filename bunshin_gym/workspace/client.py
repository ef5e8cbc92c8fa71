"""The controller's side of the agent protocol (see :mod:`bunshin_gym.workspace.agent` and
:mod:`bunshin_gym.workspace.protocol`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from bunshin_gym.workspace.errors import AgentError, ChannelError, WorkspaceError
from bunshin_gym.workspace.inroot import RootedPath
from bunshin_gym.workspace.protocol import AGENT_SOCKET, DEFAULT, Client, _Default

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


class AgentClient:
    """One connection to a workspace's agent, opened lazily and droppable at any time.

    The socket is reached through the workspace's root, resolved with openat2 so that
    nothing inside the workspace can redirect it (:class:`~bunshin_gym.workspace.inroot.RootedPath`).
    Every request has a deadline and a cap on its reply (:data:`MAX_REPLY`); a command's
    output is cut by the agent at :data:`MAX_OUTPUT` per stream unless the request says
    otherwise. Requests on one client are serialised; use several clients for concurrency.
    """

    def __init__(self, pid1: int, name: str, *, max_output: int = MAX_OUTPUT, max_read: int = MAX_READ):
        target = RootedPath(pid1, AGENT_SOCKET)
        self._name = name
        self.max_output = max_output
        self.max_read = max_read
        # the connector holds the path, not self: no reference cycle, so a dropped client
        # closes its socket at once (an open one would keep the workspace from a snapshot)
        self._client = Client(lambda: target.connect(timeout=REQUEST_TIMEOUT), name=f"{name}: agent",
                              timeout=REQUEST_TIMEOUT, max_blobs=MAX_REPLY, retry_ops=IDEMPOTENT, error=ChannelError)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request({"op": "ping"}, timeout=max(1.0, timeout))
                return
            except WorkspaceError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)

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
