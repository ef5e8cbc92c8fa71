"""The one thread that runs an env's calls on the server (``EnvLease.runner``).

It runs two kinds of work, one at a time and in the order they come:

- calls submitted by the HTTP routes and the WebSocket channel (:meth:`EnvThread.submit`,
  as a one-thread ``ThreadPoolExecutor`` takes them: a future, ``RuntimeError`` once shut
  down);
- the requests of the env's local channels (:mod:`bunshin_gym.serve.local_channel`): their
  sockets are watched by this thread itself (:meth:`EnvThread.attach`) and a request is
  read, run and answered here with blocking I/O. No event loop and no other thread is
  woken on a request's way: a hop to the env's thread and back cost ~0.6 ms of a ~4.8 ms
  desktop step through the WebSocket channel on this 2-core host (bench serve run 9).

One thread an env, as before: glibc gives each thread its own malloc arena, and a desktop's
screenshots made on whichever thread was free took ~1000 page faults a step (see
``EnvLease.runner``).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

#: serves one request of a ready local channel; False: the channel is done (closed by its
#: client, broken, or a protocol error), and the thread closes its socket
Handler = Callable[[socket.socket], bool]


class _Attached:
    __slots__ = ("sock", "handler", "idle", "last")

    def __init__(self, sock: socket.socket, handler: Handler, idle: float | None):
        self.sock, self.handler, self.idle, self.last = sock, handler, idle, time.monotonic()


class EnvThread:
    """An env's thread: :meth:`submit` work to it, :meth:`attach` local channels to it,
    :meth:`shutdown` it (the work already submitted still runs; channels are closed)."""

    def __init__(self, name: str = "bunshin-env"):
        self._lock = threading.Lock()
        self._work: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._new: list[_Attached] = []  # attached, not yet polled
        self._channels: dict[int, _Attached] = {}  # by fd: owned by the thread
        self._stopping = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # what other threads call ----------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on this thread; its future. ``RuntimeError`` once shut down."""
        future: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the env's thread is shut down")
            self._work.append((future, fn, args))
        self._poke()
        return future

    def attach(self, sock: socket.socket, handler: Handler, idle: float | None) -> None:
        """Serve ``sock`` on this thread from now on: ``handler(sock)`` whenever it is
        readable; closed after ``idle`` seconds without a request (None: never), when the
        handler says so, or at shutdown. The thread owns the socket from here on, also when
        this raises ``RuntimeError`` (shut down: the socket is closed)."""
        with self._lock:
            if not self._stopping:
                self._new.append(_Attached(sock, handler, idle))
                sock = None
        if sock is not None:
            sock.close()
            raise RuntimeError("the env's thread is shut down")
        self._poke()

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking work; the thread runs what was submitted, closes its channels, ends."""
        with self._lock:
            self._stopping = True
        self._poke()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def channels(self) -> int:
        """Local channels attached now (tests, diagnostics)."""
        with self._lock:
            return len(self._channels) + len(self._new)

    def _poke(self) -> None:
        with self._lock:  # never a write to the fd number once closed (it may be reused)
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)

    # the thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        poll = select.poll()
        wake = self._wake
        poll.register(wake, select.POLLIN)
        try:
            while True:
                with self._lock:
                    work, self._work = self._work, deque()
                    new, self._new = self._new, []
                    stopping = self._stopping
                for ch in new:
                    self._channels[ch.sock.fileno()] = ch
                    poll.register(ch.sock, select.POLLIN)
                for future, fn, args in work:
                    self._run(future, fn, args)
                if stopping:
                    with self._lock:
                        if not self._work and not self._new:
                            return
                    continue
                if work:
                    # work may have taken long: a channel's request waiting meanwhile is served
                    # before the thread sleeps (a poll with no wait)
                    timeout_ms = 0
                else:
                    timeout_ms = self._next_expiry_ms()
                for fd, _ in poll.poll(timeout_ms):
                    if fd == wake:
                        try:
                            os.eventfd_read(wake)
                        except BlockingIOError:
                            pass
                        continue
                    ch = self._channels.get(fd)
                    if ch is None:
                        continue
                    keep = False
                    try:
                        keep = ch.handler(ch.sock)
                    except Exception:  # noqa: BLE001 - the channel ends, the env's thread goes on
                        log.exception("a local channel's request failed")
                    ch.last = time.monotonic()
                    if not keep:
                        self._drop(poll, fd)
                self._expire(poll)
        finally:
            with self._lock:
                self._stopping = True
                work, self._work = self._work, deque()
                new, self._new = self._new, []
            for future, _, _ in work:  # only after an unexpected error in the loop itself
                future.set_exception(RuntimeError("the env's thread ended"))
            for ch in new:
                ch.sock.close()
            for fd in list(self._channels):
                self._drop(poll, fd)
            with self._lock:
                os.close(self._wake)
                self._wake = -1

    @staticmethod
    def _run(future: Future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as an executor does
            future.set_exception(e)
        else:
            future.set_result(result)

    def _next_expiry_ms(self) -> int:
        deadlines = [ch.last + ch.idle for ch in self._channels.values() if ch.idle]
        if not deadlines:
            return -1  # no timeout
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _expire(self, poll: select.poll) -> None:
        now = time.monotonic()
        for fd, ch in list(self._channels.items()):
            if ch.idle and now - ch.last >= ch.idle:
                log.info("a local channel had no request for %.0f s: closed", ch.idle)
                self._drop(poll, fd)

    def _drop(self, poll: select.poll, fd: int) -> None:
        ch = self._channels.pop(fd, None)
        if ch is None:
            return
        poll.unregister(fd)
        ch.sock.close()
