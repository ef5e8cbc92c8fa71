"""The controller's side of the in-workspace browser driver (see ``driver.py``).

The driver's socket is reached through ``/proc/<pid1>/root/run/bunshin/web.sock``; the
connection is opened lazily and must be closed (:meth:`BrowserClient.close`) before every
snapshot, clone or rollback of the workspace.
"""

from __future__ import annotations

import socket
import time

from bunshin_gym.workspace.agent import ProtocolError, recv_msg, send_msg
from bunshin_gym.workspace.errors import WorkspaceError

SOCKET = "/run/bunshin/web.sock"


class DriverError(RuntimeError):
    """The driver answered with an error (a failed browser operation)."""


class BrowserClient:
    """One connection to a workspace's browser driver.

    Args:
        pid1: host pid of the workspace's PID 1 (the path goes through its root).
        timeout: seconds to wait for one reply.

    Example:
        >>> c = BrowserClient(ws.pid)
        >>> c.request({"op": "observe"})[0]["url"]
        'http://127.0.0.1:7770/'
        >>> c.close()
    """

    def __init__(self, pid1: int, timeout: float = 60.0):
        self.path = f"/proc/{pid1}/root{SOCKET}"
        self.timeout = timeout
        self._sock: socket.socket | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, header: dict, timeout: float | None = None) -> tuple[dict, list[bytes]]:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise WorkspaceError(f"cannot reach the browser driver at {self.path}: {e}") from e
            self._sock = sock
        self._sock.settimeout(timeout or self.timeout)
        try:
            send_msg(self._sock, header)
            reply, blobs = recv_msg(self._sock)
        except (OSError, ProtocolError) as e:
            self.close()
            raise WorkspaceError(f"browser driver connection failed during {header.get('op')}: {e}") from e
        if "error" in reply:
            raise DriverError(reply["error"])
        return reply, blobs

    def wait_ready(self, timeout: float = 60.0, alive=lambda: True) -> None:
        """Wait until the driver answers ``ping`` (its socket appears once the browser runs)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request({"op": "ping"}, timeout=10)
                return
            except WorkspaceError:
                self.close()
                if time.monotonic() > deadline or not alive():
                    raise
                time.sleep(0.05)
