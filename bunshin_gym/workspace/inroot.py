"""Paths inside a workspace, resolved by the controller without following what the workspace controls.

The controller runs as host root and reaches the sockets inside a workspace (the agent, the
desktop input server, the X display, the browser driver) through ``/proc/<pid1>/root``. A
plain ``connect("/proc/<pid1>/root/run/bunshin/agent.sock")`` lets the workspace decide
where that lands: an absolute symlink placed at that name is followed from the *host's*
root, so ``agent.sock -> /proc/<other pid1>/root/run/bunshin/agent.sock`` sends the next
request to another workspace (tried: an exec on workspace A ran in workspace B).

Here every such path is resolved with ``openat2(2)`` from a descriptor of the workspace's
root, with ``RESOLVE_IN_ROOT`` (``..`` and absolute symlinks stay inside that root) and
``RESOLVE_NO_MAGICLINKS`` (no ``/proc/*/root`` or ``/proc/*/fd`` jumps out of it); the last
component is opened ``O_PATH | O_NOFOLLOW`` and must be what was asked for (a socket for
:meth:`RootedPath.connect`), and the socket is then connected through
``/proc/self/fd/N`` of that descriptor, i.e. the exact inode that was checked.

Python has no openat2 wrapper: it is called through libc's ``syscall`` (number 437 on every
architecture, Linux 5.6+).

Example:
    >>> RootedPath(ws.pid, "/run/bunshin/agent.sock").connect(timeout=5.0)
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
from dataclasses import dataclass

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """``openat2(dirfd, path, {flags, mode, resolve})``; returns the new descriptor or raises OSError."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


@dataclass(frozen=True)
class RootedPath:
    """``inner`` (an absolute path) inside the root of the workspace whose PID 1 is host pid ``pid1``."""

    pid1: int
    inner: str

    def __str__(self) -> str:
        return f"/proc/{self.pid1}/root{self.inner}"

    def open(self, flags: int = os.O_PATH | os.O_NOFOLLOW) -> int:
        """A descriptor of the path's last component, resolved inside the workspace's root
        (symlinks clamped to it, magic links refused); ``O_NOFOLLOW`` by default, so a symlink
        at the last component is opened as the link itself, never followed."""
        root = os.open(f"/proc/{self.pid1}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return openat2(root, self.inner.lstrip("/") or ".", flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(root)

    def stat(self) -> os.stat_result:
        """``lstat`` of the path as the workspace sees it."""
        fd = self.open()
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def exists(self) -> bool:
        try:
            self.stat()
            return True
        except OSError:
            return False

    def connect(self, timeout: float | None = 10.0) -> socket.socket:
        """A unix stream socket connected to the socket inode at this path.

        Raises OSError (``ENOTSOCK`` when the path is not a socket: a symlink, a FIFO, ...).
        ``timeout`` also bounds the connect: a server whose backlog is full blocks it.
        """
        fd = self.open()
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise OSError(errno.ENOTSOCK, f"not a socket (a symlink or another file type): {self}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(timeout)
                sock.connect(f"/proc/self/fd/{fd}")  # the very inode checked above
            except OSError:
                sock.close()
                raise
            return sock
        finally:
            os.close(fd)
