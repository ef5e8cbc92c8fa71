"""EnvThread (an env's one thread on the server): submitted work and local channels' requests
run on the same thread, in order; shutdown lets submitted work finish, refuses new work and
closes the channels; a silent channel is closed after its idle time. No server needed."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

from bunshin_gym.serve.env_thread import EnvThread


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_work_and_channel_requests_run_on_one_thread_in_order():
    before = _fds()
    t = EnvThread("test-env")
    a, b = socket.socketpair()
    seen: list[tuple[str, int]] = []

    def handler(sock: socket.socket) -> bool:
        data = sock.recv(100)
        if not data:
            return False
        seen.append((data.decode(), threading.get_ident()))
        sock.sendall(b"ok:" + data)
        return True

    try:
        ident = t.submit(threading.get_ident).result(10)
        assert ident != threading.get_ident()
        t.attach(b, handler, idle=None)
        a.sendall(b"step")
        assert a.recv(100) == b"ok:step"
        assert seen == [("step", ident)], "a channel's request ran on another thread than the env's work"
        with pytest.raises(ZeroDivisionError):  # the caller gets the work's error, as from an executor
            t.submit(lambda: 1 / 0).result(10)
        a.sendall(b"again")  # the channel goes on after a failed piece of work
        assert a.recv(100) == b"ok:again"
        assert t.channels() == 1
    finally:
        t.shutdown(wait=True)
    assert a.recv(100) == b"", "shutdown did not close the channel"
    a.close()
    with pytest.raises(RuntimeError):
        t.submit(print)
    c, d = socket.socketpair()
    with pytest.raises(RuntimeError):
        t.attach(d, handler, idle=None)
    assert d.fileno() == -1  # attach owns the socket, also when refused
    c.close()
    assert _fds() <= before, "an fd leaked"


def test_submitted_work_finishes_after_shutdown_and_a_handler_saying_no_closes_its_channel():
    t = EnvThread("test-env")
    gate = threading.Event()
    first = t.submit(gate.wait, 10)
    second = t.submit(lambda: "done")
    a, b = socket.socketpair()
    t.attach(b, lambda sock: sock.recv(10) and False, idle=None)
    gate.set()
    assert first.result(10) is True and second.result(10) == "done"
    a.sendall(b"x")  # the handler answers False: the thread closes the channel
    assert select.select([a], [], [], 10)[0] and a.recv(10) == b""
    t.shutdown(wait=True)
    a.close()


def test_a_silent_channel_is_closed_after_its_idle_time():
    t = EnvThread("test-env")
    a, b = socket.socketpair()
    try:
        t0 = time.monotonic()
        t.attach(b, lambda sock: bool(sock.recv(10)), idle=0.3)
        assert select.select([a], [], [], 10)[0] and a.recv(10) == b""
        assert 0.25 <= time.monotonic() - t0 < 5
        assert t.channels() == 0
    finally:
        t.shutdown(wait=True)
        a.close()
