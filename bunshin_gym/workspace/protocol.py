"""The one wire protocol between the controller and the servers inside a workspace.

Used on both sides: the controller imports it as ``bunshin_gym.workspace.protocol``; inside
a workspace it is ``/.bunshin/protocol.py`` (shipped in the runtime layer next to the
agent), imported by the agent, the desktop input server and the browser driver. So it uses
the standard library only; the one exception is its error base, taken from
:mod:`bunshin_gym.errors` where that is importable (on the controller, so that every error
the package raises is a ``BunshinError``) and defined here where it is not (inside a workspace).

Framing (unchanged since the first agent): a message is a 4-byte big-endian header length,
a JSON header, then the binary blobs whose lengths the header lists under ``"_blobs"``.
Every request gets exactly one reply.

Nothing a peer sends is trusted by size or by time: :func:`recv_msg` refuses a header or a
set of blobs over its caps before reading (a reply over the cap is an error, never buffered
whole), and a deadline bounds the whole message, not each ``recv`` (a peer dripping one
byte per second cannot stretch a request forever).

Example:
    >>> client = Client(lambda: connect_path("/run/bunshin/agent.sock"), name="agent", timeout=30)
    >>> reply, blobs = client.request({"op": "ping"})
    >>> client.close()
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

#: the well-known sockets inside every workspace (paths inside its root)
AGENT_SOCKET = "/run/bunshin/agent.sock"

MAX_HEADER = 1 << 20
#: default cap on the blobs of one message (a request's or a reply's), in bytes
MAX_BLOBS = 64 << 20
_LEN = struct.Struct("!I")


class _Default:
    """The type of :data:`DEFAULT`: "the client's own timeout" (None already means none)."""


DEFAULT = _Default()


try:  # on the controller a wire error is a bunshin error (bunshin_gym.errors); inside a
    # workspace, where this file is /.bunshin/protocol.py, only the standard library exists
    from bunshin_gym.errors import ProtocolError
except ImportError:
    class ProtocolError(Exception):  # type: ignore[no-redef]
        """The peer sent something that is not a message, or closed mid-message."""


class ReplyTooLarge(ProtocolError):
    """A message announced more bytes than the receiver's cap (nothing of it was buffered)."""


class RequestTimeout(ProtocolError):
    """The peer did not send the whole message before the deadline."""


class Unreachable(ProtocolError):
    """No connection to the peer could be opened."""


# framing ------------------------------------------------------------------------------
def recv_into(sock: socket.socket, buf: bytearray, deadline: float | None) -> None:
    """Fill ``buf`` from ``sock``; the deadline (``time.monotonic()``, None: none) bounds the
    whole of it, so a peer dripping one byte at a time cannot stretch it."""
    view = memoryview(buf)
    got, n = 0, len(buf)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no complete message within the deadline ({got} of {n} bytes came)")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError as e:
            raise RequestTimeout(f"no complete message within the deadline ({got} of {n} bytes came)") from e
        if k == 0:
            raise ProtocolError("connection closed")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, buf, deadline)
    return bytes(buf)


def send_msg(sock: socket.socket, header: dict, blobs: Sequence[bytes] = ()) -> None:
    header = dict(header, _blobs=[len(b) for b in blobs])
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for blob in blobs:
        sock.sendall(blob)


def recv_msg(sock: socket.socket, *, max_header: int = MAX_HEADER, max_blobs: int = MAX_BLOBS,
             timeout: float | None = None) -> tuple[dict, list[bytes]]:
    """One message; :class:`ReplyTooLarge` when its header or blobs exceed the caps (checked
    against the announced sizes, before any of it is read), :class:`RequestTimeout` when the
    whole message has not come within ``timeout`` seconds (None: no deadline)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > max_header:
        raise ReplyTooLarge(f"a message header of {n} bytes (cap {max_header})")
    try:
        header = json.loads(_recv_exact(sock, n, deadline))
        sizes = header.pop("_blobs", [])
    except (ValueError, AttributeError, TypeError) as e:
        raise ProtocolError(f"a message header that is not a JSON object: {e}") from e
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise ProtocolError(f"bad blob sizes {sizes!r:.200}")
    if sum(sizes) > max_blobs:
        raise ReplyTooLarge(f"a message of {sum(sizes)} bytes of blobs (cap {max_blobs})")
    return header, [_recv_exact(sock, size, deadline) for size in sizes]


# the server loop (inside the workspace) ------------------------------------------------
def serve_unix(path: str, handle: Callable[[dict, list[bytes]], tuple[dict, Iterable[bytes]]], *,
               mode: int = 0o600, backlog: int = 4, name: str = "server") -> None:
    """Serve one connection at a time on a unix socket, each request answered by
    ``handle(req, blobs) -> (reply, blobs)``: the loop of the env daemons (the desktop input
    server, the web driver)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    srv.bind(path)  # bound at its final name: CRIU re-binds a restored socket at the name it was bound to
    os.chmod(path, mode)
    srv.listen(backlog)
    print(f"{name} {os.getpid()} on {path}", file=sys.stderr, flush=True)  # the daemon's log line
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                try:
                    req, blobs = recv_msg(conn)
                except (ProtocolError, OSError, ValueError):
                    break
                try:
                    reply, out = handle(req, blobs)
                except Exception as e:  # noqa: BLE001 - a failure of this request, not of the server
                    # (a handler's own error path can fail too: a late SIGALRM, a broken display)
                    print(f"{name}: {req.get('op')!r} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    reply, out = {"error": f"{name} failed on this request: {type(e).__name__}: {e}"}, []
                try:
                    send_msg(conn, reply, list(out))
                except OSError:
                    break


# the client (the controller) -----------------------------------------------------------
def connect_path(path: str, timeout: float | None = 10.0) -> socket.socket:
    """A connected unix stream socket to a plain path (for a path nobody else controls)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


class Client:
    """One lazily opened connection to a server, droppable at any time (before a CRIU dump).

    Every request has a deadline (``timeout``, or the request's own) and a cap on the reply
    (``max_header``, ``max_blobs``); on a timeout, an oversized reply or a broken connection
    the connection is dropped (its stream is out of step) and ``error`` is raised. A request
    on a stale connection (the server restarted, or the workspace was rolled back) is sent
    again once on a fresh one, but only for ops in ``retry_ops`` (safe to repeat). Requests
    on one client are serialised; use several clients for concurrency.

    Args:
        connect: opens a connected socket (called for every new connection).
        name: what the server is, for messages.
        timeout: default seconds for one request (None: no deadline; avoid).
        error: the exception class raised (a subclass of the caller's error hierarchy).
    """

    def __init__(self, connect: Callable[[], socket.socket], *, name: str, timeout: float | None = 60.0,
                 max_header: int = MAX_HEADER, max_blobs: int = MAX_BLOBS, retry_ops: Iterable[str] = ("ping",),
                 error: type[Exception] = ProtocolError):
        self._connect = connect
        self.name = name
        self.timeout = timeout
        self.max_header = max_header
        self.max_blobs = max_blobs
        self.retry_ops = frozenset(retry_ops)
        self.error = error
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, header: dict, blobs: Sequence[bytes] = (), *,
                timeout: float | None | _Default = DEFAULT, max_blobs: int | None = None) -> tuple[dict, list[bytes]]:
        """Send one request, return the reply's header and blobs (an ``"error"`` in the reply
        is the caller's to judge). ``timeout``: seconds for this request (default: the
        client's); ``max_blobs``: the cap on this reply's blobs (default: the client's)."""
        limit = self.timeout if isinstance(timeout, _Default) else timeout
        cap = self.max_blobs if max_blobs is None else max_blobs
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    if fresh:
                        try:
                            self._sock = self._connect()
                        except OSError as e:
                            raise Unreachable(f"cannot connect: {e}") from e
                    self._sock.settimeout(limit)
                    send_msg(self._sock, header, blobs)
                    return recv_msg(self._sock, max_header=self.max_header, max_blobs=cap, timeout=limit)
                except (OSError, ProtocolError) as e:
                    self._drop()
                    if isinstance(e, TimeoutError):
                        e = RequestTimeout(f"no reply within {limit} s")
                    stale = not fresh and attempt == 0 and not isinstance(e, (RequestTimeout, ReplyTooLarge))
                    if stale and header.get("op") in self.retry_ops:
                        continue
                    raise self.error(f"{self.name}: {header.get('op')}: {_describe(e, limit)}") from e
        raise AssertionError("unreachable")


def _describe(e: Exception, limit: float | None) -> str:
    if isinstance(e, RequestTimeout):
        return f"no reply within {limit} s (request timed out)"
    if isinstance(e, ReplyTooLarge):
        return f"reply refused: {e}"
    if isinstance(e, Unreachable):
        return str(e)
    return f"connection failed: {e}"
