"""The local env channel: for a client on the server's own host, an env's hot calls
(``reset``, ``step``, ``rollback``) over a Unix socket, read, run and answered on the env's
own thread with blocking I/O (:class:`~bunshin_gym.serve.env_thread.EnvThread`).

Through the WebSocket channel (:mod:`bunshin_gym.serve.channel`) a request wakes uvicorn's
event loop, which hands it to the env's thread and is woken again for the answer: four
thread wake-ups a round trip, ~0.6 ms of server time besides the WebSocket framing on this
2-core host (bench serve run 9). Here the env's thread itself sleeps in ``poll`` on its
channels: a request wakes it, it answers, and the client wakes. The wire format, the
answers and the errors are the WebSocket channel's; only the framing differs.

The socket is in Linux's abstract namespace (``\\0bunshin-serve-<random>``): no file any
workspace could reach or replace, gone with the server's process, reachable only from the
server's network namespace (a workspace has its own). Its name is given to a token's
holder by ``GET /channel/local``; a client that cannot connect to it (another host, another
namespace) uses the WebSocket channel. Nothing is trusted from the connection itself:

- hello (client to server): ``{"token": ..., "env": env_id}``, one message of at most
  :data:`MAX_HELLO` bytes within :data:`HELLO_TIMEOUT` seconds; answered ``LOCAL_OK``, or
  ``LOCAL_ERROR`` with the HTTP API's status and message (401 bad token, 404 an env the
  token does not own) and the connection is closed;
- then requests, each a JSON object as the WebSocket channel's (``{"op": "step", ...}``),
  at most :data:`MAX_REQUEST` bytes; each answered ``LOCAL_ANSWER`` (``CHANNEL_TIMING``
  then the frame) or ``LOCAL_ERROR`` (JSON, the channel stays open).

Every message is ``LOCAL_HEADER`` (kind, length) and its bytes (:mod:`bunshin_gym.serve.codec`),
read and written on non-blocking sockets by :mod:`bunshin_gym.serve.local_wire`.
Requests are served one at a time, in order, between the env's other calls. A message
started must end within :data:`IO_TIMEOUT` seconds, and an answer must be taken within as
long, or the channel is closed (a stalled client holds its own env's thread that long, no
one else's). A channel without a request for its env's idle timeout is closed; closing a
channel leaves the env as it is.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from bunshin_gym.errors import BunshinError
from bunshin_gym.serve import local_wire
from bunshin_gym.serve.auth import Principal
from bunshin_gym.serve.channel import error_of, parse_request
from bunshin_gym.serve.codec import CHANNEL_TIMING, LOCAL_ANSWER, LOCAL_ERROR, LOCAL_JSON, LOCAL_OK
from bunshin_gym.serve.envs_api import EnvLease
from bunshin_gym.serve.registry import NotFound, Registry, ServeError

log = logging.getLogger(__name__)

#: the largest hello and request accepted (an action is small; a task object may be larger)
MAX_HELLO = 64 << 10
MAX_REQUEST = 16 << 20
#: seconds a client has to send its hello
HELLO_TIMEOUT = 10.0
#: seconds the rest of a started message, or the sending of an answer, may take
IO_TIMEOUT = 30.0
#: hellos read at once (each on a short thread of its own); more connections wait in the backlog
MAX_HANDSHAKES = 32


class MessageError(BunshinError):
    """A message that breaks the protocol (too long, of a kind not expected here)."""


def read_message(sock: socket.socket, limit: int, timeout: float = IO_TIMEOUT) -> tuple[int, memoryview]:
    """One message: its kind and its bytes (at most ``limit`` of them, else MessageError)."""
    try:
        return local_wire.read(sock, limit, timeout)
    except local_wire.TooLong as e:
        raise MessageError(str(e)) from None


def send_message(sock: socket.socket, kind: int, *parts: bytes | memoryview) -> None:
    """One message from ``parts`` (one system call when the socket takes it all: no copy)."""
    local_wire.write(sock, kind, *parts, timeout=IO_TIMEOUT)


def send_error(sock: socket.socket, e: BaseException) -> None:
    send_message(sock, LOCAL_ERROR, json.dumps(error_of(e)).encode())


class _Requests:
    """Serves one request of a local channel of env ``env_id`` for ``who`` (on the env's
    thread: :class:`~bunshin_gym.serve.env_thread.EnvThread` calls it when readable)."""

    def __init__(self, registry: Registry, env_id: str, who: Principal):
        self.registry, self.env_id, self.who = registry, env_id, who

    def __call__(self, sock: socket.socket) -> bool:
        try:
            kind, raw = read_message(sock, MAX_REQUEST)
        except EOFError:
            return False  # the client closed it (between requests, or in the middle of one)
        except MessageError as e:
            log.warning("local channel of %s: %s: closed", self.env_id, e)
            try:
                send_error(sock, ServeError(f"{e}: the channel is closed", 413))
            except OSError:
                pass
            return False
        except OSError as e:  # a message started and not finished in time
            log.warning("local channel of %s: %s: closed", self.env_id, e)
            return False
        t0 = time.perf_counter()
        lease = None
        try:
            if kind != LOCAL_JSON:
                raise ServeError(f"a request must be a JSON message (kind {LOCAL_JSON}), got kind {kind}", 400)
            lease, work = parse_request(self.registry, self.env_id, self.who, raw)
            data, encode_s = work()
        except Exception as e:  # noqa: BLE001 - answered; the channel goes on
            reply: tuple = (LOCAL_ERROR, json.dumps(error_of(e)).encode())
        else:
            reply = (LOCAL_ANSWER, CHANNEL_TIMING.pack(time.perf_counter() - t0, encode_s), data)
        try:
            send_message(sock, *reply)
        except OSError as e:
            log.warning("local channel of %s: the answer could not be sent (%s): closed", self.env_id, e)
            return False
        if lease is not None and lease.frames.pending():
            lease.frames.settle()  # off the answer's path, as the other channels do it
        return True


class Listener:
    """The server's local-channel socket: takes connections, reads their hello on a short
    thread, and hands each accepted one to its env's thread."""

    def __init__(self, tokens, registry: Registry):
        self.tokens, self.registry = tokens, registry
        #: the socket's name in the abstract namespace (without the leading NUL)
        self.name = f"bunshin-serve-{secrets.token_hex(16)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.name)
        self._sock.listen(128)
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="bunshin-local-channel", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No new connections (the channels already handed over end with their envs)."""
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._thread.join(10)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._stopped.is_set():
                    return
                log.warning("local channel: accept failed: %s", e)
                time.sleep(0.1)  # out of fds, say: not a busy loop
                continue
            self._slots.acquire()  # a flood of connections waits here, not in threads
            try:
                threading.Thread(target=self._hello, args=(conn,), name="bunshin-local-hello", daemon=True).start()
            except BaseException:
                self._slots.release()
                conn.close()
                raise

    def _hello(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)  # each read and write has its own deadline (local_wire)
            try:
                kind, raw = read_message(conn, MAX_HELLO, HELLO_TIMEOUT)
                hello = json.loads(bytes(raw)) if kind == LOCAL_JSON else None
            except (OSError, EOFError, MessageError, ValueError) as e:
                log.info("local channel: a bad hello (%s): closed", e)
                return
            if not isinstance(hello, dict) or not isinstance(hello.get("token"), str) \
                    or not isinstance(hello.get("env"), str):
                send_error(conn, ServeError('a hello must be {"token": ..., "env": ...}', 400))
                return
            who = self.tokens.authenticate(hello["token"])
            if who is None:
                send_error(conn, ServeError("missing or unknown API key", 401))
                return
            try:
                lease = self.registry.get(hello["env"], who, kind=EnvLease)
            except ServeError as e:
                send_error(conn, e)
                return
            send_message(conn, LOCAL_OK)
            sock, conn = conn, None  # the env's thread owns it now, also if attach fails
            try:
                lease.runner.attach(sock, _Requests(self.registry, hello["env"], who), lease.idle_timeout or None)
            except RuntimeError:  # the env was closed meanwhile: its next request would say so
                pass
        except OSError as e:
            log.info("local channel: the hello's answer could not be sent: %s", e)
        finally:
            if conn is not None:
                conn.close()
            self._slots.release()


def router(service) -> APIRouter:
    r = APIRouter()
    auth = Depends(service.principal)

    @r.get("/channel/local")
    async def local(who: Principal = auth) -> JSONResponse:
        listener = getattr(service, "local_channel", None)
        if listener is None:
            raise NotFound("this server has no local channel")
        return JSONResponse({"abstract_socket": listener.name})

    return r
