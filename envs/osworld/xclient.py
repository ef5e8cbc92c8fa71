"""A minimal X11 protocol client for host-side screenshots (no Xlib needed on the host).

It speaks just enough of the core protocol (connection set-up, ``GetImage``) over a unix
socket, which for a workspace is ``/tmp/.X11-unix/X0`` inside its root, reached without
following anything the workspace controls (a
:class:`~bunshin_gym.workspace.inroot.RootedPath`). A 1920x1080 screen is one request and an
8 MB reply. The connection must be closed before the workspace is snapshotted (CRIU cannot
dump a connection that leaves it): :meth:`XScreen.close`, and the next
:meth:`XScreen.capture` reconnects.

Damage tracking (the default, where the server has the DAMAGE and XFIXES extensions): the
client keeps the last frame and, on each capture, asks the server what was drawn since
(``DamageSubtract`` into a region, ``XFixesFetchRegion``) and reads only those rectangles,
all under a server grab, so no other client draws between the question and the reads: the
frame is what a whole-screen ``GetImage`` at that moment gives, pixel for pixel. A step
that changed little reads little (a pointer move: nothing). The first capture of a
connection reads the whole screen. The rectangles read for the last few captures stay
known (:meth:`XScreen.damage_between`), so whoever holds an earlier frame can be sent what
changed since without comparing frames (``bunshin serve`` does).

The X server runs inside the workspace and is not trusted: each request has a deadline
(``timeout``, for the whole reply), and a reply longer than the image asked for (or than
``max_reply``) is refused before anything is allocated for it.

Example:
    >>> scr = XScreen(RootedPath(ws.pid, "/tmp/.X11-unix/X0"))
    >>> rgb = scr.capture()          # numpy uint8 array (height, width, 3)
    >>> scr.close()
"""

from __future__ import annotations

import logging
import socket
import struct
import time
import weakref
from collections import deque

import numpy as np

from bunshin_gym.errors import XError
from bunshin_gym.workspace.inroot import RootedPath
from bunshin_gym.workspace.protocol import ProtocolError, RequestTimeout, connect_path, recv_into

log = logging.getLogger(__name__)

#: default cap on one reply (a 4K screen at 32 bits is 33 MB)
MAX_REPLY = 128 << 20
#: cap on an event the client skips (a GenericEvent carries its own length)
MAX_EVENT = 1 << 20
#: cap on a damage region reply (8 bytes a rectangle)
MAX_REGION = 8 << 20
#: more damaged rectangles than this are read as their bounding box
MAX_RECTS = 64
#: captures whose rectangles are remembered (what :meth:`XScreen.damage_between` answers for)
DAMAGE_LOG = 16


class XScreen:
    """One lazily opened connection to an X server's first screen."""

    def __init__(self, path: str | RootedPath, timeout: float = 10.0, max_reply: int = MAX_REPLY,
                 damage: bool = True):
        self.path = path
        self.timeout = timeout
        self.max_reply = max_reply
        self.damage = damage
        self._sock: socket.socket | None = None
        self.root = 0
        self.width = 0
        self.height = 0
        self.depth = 0
        self._seq = 0
        self._ids = (0, 0)  # resource-id base and mask of the connection
        #: damage tracking of this connection: (damage opcode, xfixes opcode, damage, region);
        #: None: not set up yet; False: the server cannot (whole frames then)
        self._tracking: tuple[int, int, int, int] | bool | None = None
        self._untrackable = False  # the server refused to set it up once: not asked again
        self._frame: np.ndarray | None = None  # RGB of the last capture on this connection
        #: pixels the last capture read from the server (the whole screen without tracking)
        self.last_read_pixels = 0
        #: the last captures of this connection's frame: (the array returned, weakly; the
        #: rectangles read for it). Weak: nothing is kept alive for an in-process env
        self._captures: deque[tuple[weakref.ref, list[tuple[int, int, int, int]]]] = deque(maxlen=DAMAGE_LOG)

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
            self._ids = struct.unpack_from("<II", data, 4)
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
        self._tracking, self._frame = None, None  # the server frees a connection's objects
        self._captures.clear()  # a new connection's first frame owes nothing to these

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
            self._sock.sendall(self._get_image(x, y, w, h))
            return self._read_image(w, h, deadline)
        except BaseException:
            self.close()
            raise

    def _get_image(self, x: int, y: int, w: int, h: int) -> bytes:
        # 4 bytes a pixel is the most a ZPixmap image can take; the screen size itself came
        # from the server, so it is capped as well
        if w * h * 4 > self.max_reply:
            raise XError(f"GetImage of {w}x{h} would be {w * h * 4} bytes, over the cap of {self.max_reply}")
        self._seq = (self._seq + 1) & 0xFFFF
        return struct.pack("<BBHIhhHHI", 73, 2, 5, self.root, x, y, w, h, 0xFFFFFFFF)

    def _read_image(self, w: int, h: int, deadline: float) -> np.ndarray:
        want = w * h * 4
        head = self._reply(deadline)
        length, = struct.unpack_from("<I", head, 4)
        if length * 4 > want:
            raise XError(f"X reply refused: {length * 4} bytes announced for a {w}x{h} image (at most {want})")
        buf = bytearray(length * 4)
        _recv_into(self._sock, buf, deadline)
        if len(buf) < want:
            raise XError(f"GetImage: {len(buf)} bytes for {w}x{h} (depth {self.depth} is not 24/32-bit)")
        return np.frombuffer(buf, np.uint8, want).reshape(h, w, 4)

    def capture(self, verify: bool = False) -> np.ndarray:
        """The whole screen as an RGB (height, width, 3) uint8 array (a new one each call).

        ``verify``: with damage tracking, also read the whole screen under the same grab and
        raise :class:`XError` if the tracked frame differs from it (a check for tests and
        for debugging a server; it costs a whole-screen read)."""
        if not self.damage:
            return self._whole_frame()
        self.connect()
        deadline = time.monotonic() + self.timeout
        try:
            if self._tracking is None:
                try:
                    self._tracking = self._start_tracking(deadline)
                except XError as e:  # whole frames from now on, on a fresh connection
                    log.info("X server at %s: no damage tracking (%s); reading whole frames", self.path, e)
                    self.close()
                    self.connect()
                    self._tracking = False
            if self._tracking is False:
                return self._whole_frame()
            rects = self._update_frame(deadline, verify)
        except BaseException:
            self.close()
            raise
        out = self._frame.copy()
        self._captures.append((weakref.ref(out), rects))
        return out

    def damage_between(self, old: np.ndarray, new: np.ndarray) -> list[tuple[int, int, int, int]] | None:
        """The rectangles ``(x, y, w, h)`` read between two frames this connection's
        :meth:`capture` returned, ``old`` before ``new`` (by identity): ``new`` is ``old`` with
        those rectangles replaced by ``new``'s pixels, as long as neither array was written
        since. None when either is not among the last :data:`DAMAGE_LOG` captures of this
        connection, or ``new`` is not later than ``old``."""
        at = {id(ref()): i for i, (ref, _) in enumerate(self._captures) if ref() is not None}
        i, j = at.get(id(old)), at.get(id(new))
        if i is None or j is None or j < i:
            return None
        return [r for _, rects in list(self._captures)[i + 1:j + 1] for r in rects]

    def _whole_frame(self) -> np.ndarray:
        frame = bgrx_to_rgb(self.capture_bgrx())
        self.last_read_pixels = frame.shape[0] * frame.shape[1]
        return frame

    def _update_frame(self, deadline: float, verify: bool = False) -> list[tuple[int, int, int, int]]:
        """Read what was drawn since the last capture into ``_frame`` (all of it the first time),
        under a server grab: no client draws between the damage taken and the pixels read;
        returns the rectangles read."""
        damage_op, xfixes_op, damage, region = self._tracking
        first = self._frame is None
        grab = struct.pack("<BxH", 36, 1)
        # DamageSubtract(damage, repair None, parts region): the damage since the last call,
        # into the region, and the damage emptied (parts None the first time: only emptied)
        subtract = struct.pack("<BBHIII", damage_op, 3, 4, damage, 0, 0 if first else region)
        self._seq = (self._seq + 2) & 0xFFFF
        if first:
            rects = [(0, 0, self.width, self.height)]
            self._sock.sendall(grab + subtract)
        else:
            self._sock.sendall(grab + subtract + struct.pack("<BBHI", xfixes_op, 19, 2, region))
            self._seq = (self._seq + 1) & 0xFFFF
            rects = self._read_region(deadline)
        whole = [(0, 0, self.width, self.height)] if verify else []
        self._sock.sendall(b"".join(self._get_image(*r) for r in rects + whole) + struct.pack("<BxH", 37, 1))
        self._seq = (self._seq + 1) & 0xFFFF
        if first:
            self._frame = np.empty((self.height, self.width, 3), np.uint8)
        for x, y, w, h in rects:
            self._frame[y:y + h, x:x + w] = bgrx_to_rgb(self._read_image(w, h, deadline))
        self.last_read_pixels = sum(w * h for _, _, w, h in rects)
        if verify:
            truth = bgrx_to_rgb(self._read_image(self.width, self.height, deadline))
            if not np.array_equal(truth, self._frame):
                bad = np.argwhere((truth != self._frame).any(axis=2))
                (y0, x0), (y1, x1) = bad.min(axis=0), bad.max(axis=0)
                raise XError(f"damage tracking missed {len(bad)} pixels, in x {x0}..{x1}, y {y0}..{y1} "
                             f"(read this time: {rects})")
        return rects

    def _read_region(self, deadline: float) -> list[tuple[int, int, int, int]]:
        """The rectangles of a ``XFixesFetchRegion`` reply, clipped to the screen; their
        bounding box when there are many (one read instead of hundreds)."""
        head = self._reply(deadline)
        length, = struct.unpack_from("<I", head, 4)
        if length * 4 > MAX_REGION:
            raise XError(f"X reply refused: a damage region of {length * 4} bytes (cap {MAX_REGION})")
        raw = _recv(self._sock, length * 4, deadline)
        rects = []
        for i in range(0, len(raw) - 7, 8):
            x, y, w, h = struct.unpack_from("<hhHH", raw, i)
            x0, y0 = max(0, x), max(0, y)
            x1, y1 = min(self.width, x + w), min(self.height, y + h)
            if x1 > x0 and y1 > y0:
                rects.append((x0, y0, x1 - x0, y1 - y0))
        if len(rects) > MAX_RECTS:
            x0, y0 = min(r[0] for r in rects), min(r[1] for r in rects)
            x1, y1 = max(r[0] + r[2] for r in rects), max(r[1] + r[3] for r in rects)
            rects = [(x0, y0, x1 - x0, y1 - y0)]
        return rects

    def _start_tracking(self, deadline: float) -> tuple[int, int, int, int] | bool:
        """Set up damage tracking on this connection; False where the server cannot (no DAMAGE
        or XFIXES, or it refused a request: then never asked again by this client)."""
        if self._untrackable:
            return False
        ops = []
        for name in (b"DAMAGE", b"XFIXES"):
            self._sock.sendall(struct.pack("<BxHHxx", 98, 2 + (len(name) + 3) // 4, len(name))
                               + name + b"\0" * (-len(name) % 4))
            self._seq = (self._seq + 1) & 0xFFFF
            head = self._reply(deadline)
            if not head[8]:
                self._untrackable = True
                return False
            ops.append(head[9])
        damage_op, xfixes_op = ops
        base, mask = self._ids
        step = mask & -mask  # the lowest bit of the mask: ids are base | k * step
        damage, region = base | step, base | (2 * step)
        try:
            # the versions must be asked before any other request of either extension
            self._sock.sendall(struct.pack("<BBHII", xfixes_op, 0, 3, 5, 0)
                               + struct.pack("<BBHII", damage_op, 0, 3, 1, 1))
            self._seq = (self._seq + 2) & 0xFFFF
            self._reply(deadline)
            self._reply(deadline)
            # DamageCreate(level NonEmpty: one event when it becomes non-empty, skipped here),
            # XFixesCreateRegion(empty), and a FetchRegion whose reply shows both worked
            self._sock.sendall(struct.pack("<BBHIIB3x", damage_op, 1, 4, damage, self.root, 3)
                               + struct.pack("<BBHI", xfixes_op, 5, 2, region)
                               + struct.pack("<BBHI", xfixes_op, 19, 2, region))
            self._seq = (self._seq + 3) & 0xFFFF
            self._read_region(deadline)
        except XError:
            self._untrackable = True
            raise
        return damage_op, xfixes_op, damage, region

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
