"""The controller's side of the in-workspace browser driver (see ``driver.py``).

The driver's socket is ``/run/bunshin/web.sock`` inside the workspace, reached through its
root without following anything the workspace controls
(:class:`~bunshin_gym.workspace.inroot.RootedPath`); the connection is opened lazily and
must be closed (:meth:`BrowserClient.close`) before every snapshot, clone or rollback of the
workspace. Every request has a deadline and its reply a size cap.
"""

from __future__ import annotations

from collections.abc import Callable

from bunshin_gym.errors import DriverError
from bunshin_gym.workspace.client import WorkspaceClient
from bunshin_gym.workspace.inroot import RootedPath

SOCKET = "/run/bunshin/web.sock"
#: cap on one reply's blobs (a PNG screenshot of the viewport)
MAX_REPLY = 64 << 20


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
        self.path = RootedPath(pid1, SOCKET)
        self.timeout = timeout
        # nothing is sent twice, not even a ping: every op of the driver may act on the page
        self._client = WorkspaceClient(self.path, name=f"the browser driver at {self.path}", timeout=timeout,
                                       max_blobs=MAX_REPLY, retry_ops=())

    def close(self) -> None:
        self._client.close()

    def request(self, header: dict, timeout: float | None = None) -> tuple[dict, list[bytes]]:
        """One request; :class:`ChannelError` when the driver cannot be reached, does not
        answer in time or answers over the cap, :class:`DriverError` with its ``reply`` when the
        operation failed."""
        reply, blobs = self._client.request(header, timeout=timeout or self.timeout)
        if "error" in reply:
            raise DriverError(reply["error"], reply)
        return reply, blobs

    def wait_ready(self, timeout: float = 60.0, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait until the driver answers ``ping`` (its socket appears once the browser runs);
        :class:`ChannelError` after ``timeout`` or once ``alive()`` is False."""
        reply = self._client.wait_ready(timeout, ping_timeout=10.0, interval=0.05, alive=alive)
        if "error" in reply:
            raise DriverError(reply["error"])
