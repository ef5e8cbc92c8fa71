"""A local channel's messages (:mod:`bunshin_gym.serve.local_channel`) read and written on a
non-blocking socket, on both ends, with a deadline and as few system calls as can be.

A message is ``LOCAL_HEADER`` (kind, length) and its bytes (:mod:`bunshin_gym.serve.codec`).
A Python socket with a timeout polls before every ``recv`` and ``send``, and a message read
as its header then its body takes two of each: eight system calls a round trip at the client
and seven at the server, for a step's answer of a few hundred bytes. Here a read takes what
is there in one ``recv`` (header and body, up to :data:`FIRST_READ` bytes) and waits with
``poll`` only when nothing is; a write is one ``sendmsg`` unless the socket's buffer is full.
On this 2-core VM every system call on a step's path counts: the server's share of a desktop
step is a few hundred microseconds.
"""

from __future__ import annotations

import select
import socket
import time

from bunshin_gym.errors import BunshinError
from bunshin_gym.serve.codec import LOCAL_HEADER

#: bytes a read asks for first: a step's answer without pixels (a few hundred bytes) or a
#: request comes whole; a longer message is read on once its length is known
FIRST_READ = 16 << 10


class TooLong(BunshinError, ValueError):
    """A message longer than the reader takes (its length is in the message)."""

    def __init__(self, length: int, limit: int):
        super().__init__(f"a message of {length} bytes (at most {limit})")
        self.length, self.limit = length, limit


def _wait(sock: socket.socket, events: int, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    poll = select.poll()
    poll.register(sock, events)
    if not poll.poll(max(1, int(left * 1000 + 0.999))):
        raise TimeoutError("timed out")


def read(sock: socket.socket, limit: int, timeout: float, *, wait_first: bool = False) -> tuple[int, memoryview]:
    """One message from non-blocking ``sock``: its kind and bytes; ``TooLong`` past ``limit``
    bytes, ``EOFError`` when the connection ends first (before or inside the message),
    ``TimeoutError`` when it is not all there within ``timeout`` seconds. ``wait_first``: the
    message cannot be there yet (an answer just asked for): wait before the first read."""
    deadline = time.monotonic() + timeout
    buf = bytearray(FIRST_READ)
    got, end = 0, None
    if wait_first:
        _wait(sock, select.POLLIN, deadline)
    while end is None or got < end:
        try:
            n = sock.recv_into(memoryview(buf)[got:end])
        except BlockingIOError:
            _wait(sock, select.POLLIN, deadline)
            continue
        if n == 0:
            raise EOFError("the connection ended")
        got += n
        if end is None and got >= LOCAL_HEADER.size:
            kind, length = LOCAL_HEADER.unpack_from(buf)
            if length > limit:
                raise TooLong(length, limit)
            end = LOCAL_HEADER.size + length
            if got > end:  # a peer speaks only when it is its turn: nothing follows a message
                raise EOFError("more bytes than one message: the peer broke the protocol")
            if end > len(buf):
                whole = bytearray(end)
                whole[:got] = memoryview(buf)[:got]
                buf = whole
    return kind, memoryview(buf)[LOCAL_HEADER.size:end]


def write(sock: socket.socket, kind: int, *parts: bytes | memoryview, timeout: float) -> None:
    """One message from ``parts`` on non-blocking ``sock`` (one system call when its buffer
    takes it all: no copy); ``TimeoutError`` when it cannot all be sent within ``timeout``."""
    buffers = [memoryview(LOCAL_HEADER.pack(kind, sum(len(p) for p in parts))), *map(memoryview, parts)]
    deadline = None
    while buffers:
        try:
            sent = sock.sendmsg(buffers)
        except BlockingIOError:
            if deadline is None:
                deadline = time.monotonic() + timeout
            _wait(sock, select.POLLOUT, deadline)
            continue
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]
