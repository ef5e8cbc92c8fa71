"""The controller's side of the agent protocol (see :mod:`bunshin_gym.workspace.agent`)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from bunshin_gym.workspace.agent import SOCKET_PATH, ProtocolError, recv_msg, send_msg
from bunshin_gym.workspace.errors import AgentError, WorkspaceError

IDEMPOTENT = {"ping", "read_file"}


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

    The socket is reached through ``/proc/<pid1>/root``, so no host mount is needed.
    Requests on one client are serialised; use several clients for concurrency.
    """

    def __init__(self, pid1: int, name: str):
        self._path = f"/proc/{pid1}/root{SOCKET_PATH}"
        self._name = name
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request({"op": "ping"})
                return
            except WorkspaceError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)

    def disconnect(self) -> None:
        """Drop the connection (CRIU cannot dump a unix connection that leaves the workspace)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def request(self, header: dict, blobs: list[bytes] = ()) -> tuple[dict, list[bytes]]:
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    if fresh:
                        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                        self._sock.connect(self._path)
                    send_msg(self._sock, header, blobs)
                    reply, out = recv_msg(self._sock)
                    break
                except (OSError, ProtocolError) as e:
                    if self._sock is not None:
                        self._sock.close()
                        self._sock = None
                    # a stale connection (the agent restarted) is retried once on a fresh one, but
                    # only for requests that are safe to repeat: an exec may already have run
                    if fresh or attempt == 1 or header.get("op") not in IDEMPOTENT:
                        raise WorkspaceError(f"{self._name}: cannot reach the agent: {e}") from e
        if "error" in reply:
            raise AgentError(f"{self._name}: {header.get('op')}: {reply['error']}", reply.get("errno"))
        return reply, out
