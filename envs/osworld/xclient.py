"""A minimal X11 protocol client for host-side screenshots (no Xlib needed on the host).

It speaks just enough of the core protocol (connection set-up, ``GetImage``) over a unix
socket, which for a workspace is ``/tmp/.X11-unix/X0`` inside its root, reached without
following anything the workspace controls (a
:class:`~bunshin_gym.workspace.inroot.RootedPath`). A 1920x1080 screen is one request and an
8 MB reply: a few milliseconds. The connection must be closed before the workspace is
snapshotted (CRIU cannot dump a connection that leaves it): :meth:`XScreen.close`, and the
next :meth:`XScreen.capture` reconnects.

The X server runs inside the workspace and is not trusted: each request has a deadline
(``timeout``, for the whole reply), and a reply longer than the image asked for (or than
``max_reply``) is refused before anything is allocated for it.

Example:
    >>> scr = XScreen(RootedPath(ws.pid, "/tmp/.X11-unix/X0"))
    >>> rgb = scr.capture()          # numpy uint8 array (height, width, 3)
    >>> scr.close()
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np

from bunshin_gym.errors import XError
from bunshin_gym.workspace.inroot import RootedPath
from bunshin_gym.workspace.protocol import ProtocolError, RequestTimeout, connect_path, recv_into

#: default cap on one reply (a 4K screen at 32 bits is 33 MB)
MAX_REPLY = 128 << 20
#: cap on an event the client skips (a GenericEvent carries its own length)
MAX_EVENT = 1 << 20


class XScreen:
    """One lazily opened connection to an X server's first screen."""

    def __init__(self, path: str | RootedPath, timeout: float = 10.0, max_reply: int = MAX_REPLY):
        self.path = path
        self.timeout = timeout
        self.max_reply = max_reply
        self._sock: socket.socket | None = None
        self.root = 0
        self.width = 0
        self.height = 0
        self.depth = 0
        self._seq = 0

    # connection ---------------------------------------------------------------------
    def connect(self) -> None:
        if self._sock is not None:
            return
        deadline = time.monotonic() + self.timeout
        if isinstance(self.path, RootedPath):
            s = self.path.connect(timeout=self.timeout)
        else:
            s = connect_path(self.path, timeout=self.timeout)
        try:
            s.sendall(struct.pack("<BxHHHHxx", ord("l"), 11, 0, 0, 0))
            head = _recv(s, 8, deadline)
            status, reason_len, _major, _minor, extra = struct.unpack("<BBHHH", head)
            data = _recv(s, extra * 4, deadline)  # at most 256 kB: a 16-bit count of 4-byte units
            if status != 1:
                why = data[:reason_len].decode(errors="replace") if status == 0 else "authentication required"
                raise XError(f"X server at {self.path} refused the connection: {why}")
            vendor_len, = struct.unpack_from("<H", data, 16)
            n_screens, n_formats = data[20], data[21]
            if n_screens < 1:
                raise XError("X server has no screen")
            off = 32 + (vendor_len + 3) // 4 * 4 + 8 * n_formats
            self.root, = struct.unpack_from("<I", data, off)
            self.width, self.height = struct.unpack_from("<HH", data, off + 20)
            self.depth = data[off + 38]
        except BaseException:
            s.close()
            raise
        self._sock, self._seq = s, 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # requests -----------------------------------------------------------------------
    def capture_bgrx(self, x: int = 0, y: int = 0, w: int | None = None, h: int | None = None) -> np.ndarray:
        """The screen's pixels as an (h, w, 4) uint8 array in the server's BGRX order."""
        self.connect()
        w = self.width - x if w is None else w
        h = self.height - y if h is None else h
        deadline = time.monotonic() + self.timeout
        try:
            # 4 bytes a pixel is the most a ZPixmap image can take; the screen size itself came
            # from the server, so it is capped as well
            want = w * h * 4
            if want > self.max_reply:
                raise XError(f"GetImage of {w}x{h} would be {want} bytes, over the cap of {self.max_reply}")
            self._sock.sendall(struct.pack("<BBHIhhHHI", 73, 2, 5, self.root, x, y, w, h, 0xFFFFFFFF))
            self._seq = (self._seq + 1) & 0xFFFF
            head = self._reply(deadline)
            length, = struct.unpack_from("<I", head, 4)
            if length * 4 > want:
                raise XError(f"X reply refused: {length * 4} bytes announced for a {w}x{h} image "
                             f"(at most {want})")
            buf = bytearray(length * 4)
            _recv_into(self._sock, buf, deadline)
        except BaseException:
            self.close()
            raise
        if len(buf) < w * h * 4:
            raise XError(f"GetImage: {len(buf)} bytes for {w}x{h} (depth {self.depth} is not 24/32-bit)")
        return np.frombuffer(buf, np.uint8, w * h * 4).reshape(h, w, 4)

    def _reply(self, deadline: float) -> bytes:
        """The next reply's 32-byte head; events (MappingNotify reaches every client) are skipped."""
        while True:
            head = _recv(self._sock, 32, deadline)
            if head[0] == 1:
                return head
            if head[0] == 0:
                raise XError(f"X request failed: error code {head[1]}")
            if head[0] & 0x7F == 35:  # GenericEvent: 32 bytes plus its length
                extra = struct.unpack_from("<I", head, 4)[0] * 4
                if extra > MAX_EVENT:
                    raise XError(f"X event refused: {extra} bytes announced (cap {MAX_EVENT})")
                _recv(self._sock, extra, deadline)

    def capture(self) -> np.ndarray:
        """The whole screen as an RGB (height, width, 3) uint8 array."""
        return bgrx_to_rgb(self.capture_bgrx())


def bgrx_to_rgb(bgrx: np.ndarray) -> np.ndarray:
    """A new C-contiguous RGB array from an (h, w, 4) BGRX one. One channel at a time: numpy
    copies a reversed 3-of-4 slice (``ascontiguousarray(bgrx[..., 2::-1])``) element by element,
    about 4x slower on a 1920x1080 frame (~35 ms of CPU, most of a desktop step)."""
    rgb = np.empty((*bgrx.shape[:2], 3), np.uint8)
    rgb[..., 0] = bgrx[..., 2]
    rgb[..., 1] = bgrx[..., 1]
    rgb[..., 2] = bgrx[..., 0]
    return rgb


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, buf, deadline)
    return bytes(buf)


def _recv_into(sock: socket.socket, buf: bytearray, deadline: float) -> None:
    """Fill ``buf``; the deadline bounds the whole reply (a server dripping bytes cannot stretch it)."""
    try:
        recv_into(sock, buf, deadline)
    except RequestTimeout as e:
        raise XError(f"X server did not send its reply in time: {e}") from e
    except ProtocolError as e:
        raise XError("X server closed the connection") from e
