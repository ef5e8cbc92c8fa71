"""A local channel's messages on non-blocking sockets (bunshin_gym.serve.local_wire): whole
messages however they arrive, bounded in size and in time."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bunshin_gym.serve import local_wire
from bunshin_gym.serve.codec import LOCAL_HEADER


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("size", [0, 1, 300, local_wire.FIRST_READ - LOCAL_HEADER.size,
                                  local_wire.FIRST_READ, 3 * local_wire.FIRST_READ + 7, 6 << 20])
def test_a_message_comes_whole_whatever_its_size(pair, size):
    a, b = pair
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    # a writer thread: a large message fills the socket's buffer, and the writer waits for room
    t = threading.Thread(target=local_wire.write, args=(a, 7, body[:size // 2], body[size // 2:]),
                         kwargs={"timeout": 10})
    t.start()
    kind, got = local_wire.read(b, 8 << 20, 10, wait_first=True)
    t.join()
    assert kind == 7 and bytes(got) == body


def test_a_message_that_arrives_in_pieces_is_read_whole(pair):
    a, b = pair
    raw = LOCAL_HEADER.pack(3, 10) + b"0123456789"

    def trickle():
        for i in range(len(raw)):
            a.send(raw[i:i + 1])
            time.sleep(0.01)

    t = threading.Thread(target=trickle)
    t.start()
    kind, got = local_wire.read(b, 100, 10)
    t.join()
    assert (kind, bytes(got)) == (3, b"0123456789")


def test_a_message_longer_than_taken_is_refused_by_its_header(pair):
    a, b = pair
    a.send(LOCAL_HEADER.pack(1, 1 << 30))  # says 1 GiB: nothing that long is read
    with pytest.raises(local_wire.TooLong, match="1073741824 bytes"):
        local_wire.read(b, 1 << 20, 5)


def test_a_message_cut_short_ends_the_read(pair):
    a, b = pair
    a.send(LOCAL_HEADER.pack(1, 100) + b"only part")
    a.close()
    with pytest.raises(EOFError):
        local_wire.read(b, 1 << 20, 5)


def test_a_silent_or_stalled_peer_is_bounded_in_time(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        local_wire.read(b, 1 << 20, 0.3)  # nothing at all
    a.send(LOCAL_HEADER.pack(1, 100) + b"half")
    with pytest.raises(TimeoutError):
        local_wire.read(b, 1 << 20, 0.3)  # a message started and not finished
    assert time.monotonic() - t0 < 3
    # a reader that never reads: the writer gives up once the buffer stays full
    with pytest.raises(TimeoutError):
        local_wire.write(a, 1, bytes(64 << 20), timeout=0.3)


def test_two_messages_at_once_break_the_protocol(pair):
    """A peer speaks only when it is its turn: a second message behind the first is refused,
    not left to be taken for the answer of a later request."""
    a, b = pair
    a.send(LOCAL_HEADER.pack(1, 2) + b"ok" + LOCAL_HEADER.pack(1, 2) + b"no")
    time.sleep(0.05)
    with pytest.raises(EOFError, match="more bytes than one message"):
        local_wire.read(b, 100, 5)
