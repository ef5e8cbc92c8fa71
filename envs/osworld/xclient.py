"""A minimal X11 protocol client for host-side screenshots (no Xlib needed on the host).

It speaks just enough of the core protocol (connection set-up, ``GetImage``) over a unix
socket, which for a workspace is ``/proc/<pid1>/root/tmp/.X11-unix/X0``. A 1920x1080
screen is one request and an 8 MB reply: a few milliseconds. The connection must be closed
before the workspace is snapshotted (CRIU cannot dump a connection that leaves it):
:meth:`XScreen.close`, and the next :meth:`XScreen.capture` reconnects.

Example:
    >>> scr = XScreen(f"/proc/{ws.pid}/root/tmp/.X11-unix/X0")
    >>> rgb = scr.capture()          # numpy uint8 array (height, width, 3)
    >>> scr.close()
"""

from __future__ import annotations

import socket
import struct

import numpy as np


class XError(OSError):
    """The X server refused the connection or a request."""


class XScreen:
    """One lazily opened connection to an X server's first screen."""

    def __init__(self, path: str, timeout: float = 10.0):
        self.path = path
        self.timeout = timeout
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
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
            s.sendall(struct.pack("<BxHHHHxx", ord("l"), 11, 0, 0, 0))
            head = _recv(s, 8)
            status, reason_len, _major, _minor, extra = struct.unpack("<BBHHH", head)
            data = _recv(s, extra * 4)
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
        try:
            self._sock.sendall(struct.pack("<BBHIhhHHI", 73, 2, 5, self.root, x, y, w, h, 0xFFFFFFFF))
            self._seq = (self._seq + 1) & 0xFFFF
            head = self._reply()
            length, = struct.unpack_from("<I", head, 4)
            buf = bytearray(length * 4)
            _recv_into(self._sock, buf)
        except BaseException:
            self.close()
            raise
        if len(buf) < w * h * 4:
            raise XError(f"GetImage: {len(buf)} bytes for {w}x{h} (depth {self.depth} is not 24/32-bit)")
        return np.frombuffer(buf, np.uint8, w * h * 4).reshape(h, w, 4)

    def _reply(self) -> bytes:
        """The next reply's 32-byte head; events (MappingNotify reaches every client) are skipped."""
        while True:
            head = _recv(self._sock, 32)
            if head[0] == 1:
                return head
            if head[0] == 0:
                raise XError(f"X request failed: error code {head[1]}")
            if head[0] & 0x7F == 35:  # GenericEvent: 32 bytes plus its length
                _recv(self._sock, struct.unpack_from("<I", head, 4)[0] * 4)

    def capture(self) -> np.ndarray:
        """The whole screen as an RGB (height, width, 3) uint8 array."""
        return np.ascontiguousarray(self.capture_bgrx()[:, :, 2::-1])


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, buf)
    return bytes(buf)


def _recv_into(sock: socket.socket, buf: bytearray) -> None:
    view = memoryview(buf)
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise XError("X server closed the connection")
        got += k
