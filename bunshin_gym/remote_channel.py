"""The client end of an env channel (:mod:`bunshin_gym.serve.channel`): one WebSocket to one
env on a ``bunshin serve`` server, for :class:`~bunshin_gym.remote.RemoteEnv`'s hot calls;
or, for a client on the server's host, a Unix socket served on the env's own thread
(:class:`LocalChannel`, :mod:`bunshin_gym.serve.local_channel`), with the same calls.

It speaks WebSocket through the ``websockets`` package's sans-I/O protocol on a blocking
socket of its own: no thread, no event loop, and a request's answer is read by the thread
that asked. That thread has the server's whole step to wait, and does the work that the
answer will need meanwhile (``call(..., meanwhile=)``: a copy of the screenshot a delta is
applied to, the digest of one not checked yet).

A channel found closed before a request (the server restarted, or closed it after its
env's idle timeout) is opened again. A channel that breaks while a request is out raises
:class:`ChannelBroken`: the request may have run, and it is not sent again (a step must not
run twice); the next request opens a new channel.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidStatus, WebSocketException
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from bunshin_gym.errors import BunshinError
from bunshin_gym.serve import local_wire
from bunshin_gym.serve.codec import CHANNEL_TIMING as TIMING
from bunshin_gym.serve.codec import LOCAL_ANSWER, LOCAL_ERROR, LOCAL_JSON, LOCAL_OK

#: the largest answer accepted (a whole 4K RGB frame is 25 MB before compression)
MAX_MESSAGE = 256 << 20
#: bytes read from the socket at a time
READ = 1 << 20


class ChannelError(BunshinError, RuntimeError):
    """The channel could not be opened, or broke; ``status`` is the HTTP status of a refused
    upgrade (401, 404, ...), else None."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ChannelBroken(ChannelError):
    """The channel broke while a request was out: the request may or may not have run."""


class Channel:
    """One WebSocket to env ``env_id`` on ``server``; :meth:`call` sends a request and gives
    its answer. Thread-safe (requests are served one at a time)."""

    def __init__(self, server: str, env_id: str, token: str, timeout: float):
        url = urlsplit(server.rstrip("/"))
        scheme = {"http": "ws", "https": "wss"}.get(url.scheme)
        if scheme is None or not url.hostname:
            raise ChannelError(f"server must be an http:// or https:// URL, not {server!r}")
        self._uri = parse_uri(f"{scheme}://{url.netloc}{url.path}/envs/{env_id}/channel")
        self._token, self._timeout = token, timeout
        self._sock: socket.socket | None = None
        self._proto: ClientProtocol | None = None
        self._lock = threading.Lock()

    # connection ---------------------------------------------------------------------------
    def _open(self) -> None:
        u = self._uri
        deadline = time.monotonic() + self._timeout
        try:
            sock = socket.create_connection((u.host, u.port), timeout=self._timeout)
        except OSError as e:
            raise ChannelError(f"the server could not be reached: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one small write
            if u.secure:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=u.host)
            proto = ClientProtocol(u, max_size=MAX_MESSAGE)
            request = proto.connect()
            request.headers["Authorization"] = f"Bearer {self._token}"
            proto.send_request(request)
            self._flush(sock, proto)
            while proto.state is State.CONNECTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelError("the server did not answer the upgrade in time")
                sock.settimeout(left)
                data = sock.recv(READ)
                if not data:  # a refusal ends with the connection: its response is read by now
                    proto.receive_eof()
                    break
                proto.receive_data(data)
            if proto.handshake_exc is not None:
                raise _refused(proto.handshake_exc)
            for event in proto.events_received():
                if isinstance(event, Response) and event.status_code != 101:
                    raise _refused(InvalidStatus(event))
        except BaseException:
            sock.close()
            raise
        self._sock, self._proto = sock, proto

    def close(self) -> None:
        """Close the channel (the env stays)."""
        with self._lock:
            self._drop(polite=True)

    def _drop(self, polite: bool = False) -> None:
        sock, proto, self._sock, self._proto = self._sock, self._proto, None, None
        if sock is None:
            return
        if polite and proto is not None and proto.state is State.OPEN:
            try:
                proto.send_close(1000)
                self._flush(sock, proto)
            except (OSError, WebSocketException):
                pass
        sock.close()

    def _alive(self) -> bool:
        """Whether the open channel is still usable: anything the server sent unasked (its
        close, or the end of the connection) is read first, without waiting."""
        sock, proto = self._sock, self._proto
        if sock is None or proto is None:
            return False
        try:
            while select.select([sock], [], [], 0)[0]:
                data = sock.recv(READ)
                if not data:
                    return False
                proto.receive_data(data)
                self._flush(sock, proto)
                proto.events_received()  # nothing is asked: a close or a stray frame, dropped
        except (OSError, WebSocketException):
            return False
        return proto.state is State.OPEN

    # requests -----------------------------------------------------------------------------
    def call(self, op: str, body: dict, meanwhile: Callable[[], Any] | None = None) -> tuple[bytes, float, float]:
        """Send request ``op`` with ``body``; run ``meanwhile`` while the server works; return
        the answer's frame, the server's seconds on it and its encoding's seconds. A refused
        request raises :class:`ChannelRefusal` with the server's status and message."""
        # ASCII JSON: a lone surrogate in an action travels escaped and is the env's to refuse
        text = json.dumps({"op": op, **body}, separators=(",", ":"), allow_nan=False)
        with self._lock:
            if not self._alive():
                self._drop()
                self._open()
            sock, proto = self._sock, self._proto
            deadline = time.monotonic() + self._timeout
            try:
                proto.send_text(text.encode())
                self._flush(sock, proto)
                if meanwhile is not None:
                    meanwhile()
                frame = self._answer(sock, proto, deadline)
            except (OSError, WebSocketException, ChannelBroken) as e:
                self._drop()
                raise ChannelBroken(f"the channel broke while the request was out ({e}); "
                                    "it may have run") from None
            except BaseException:
                # interrupted (Ctrl-C, an error in meanwhile) with the request out: its answer
                # must not be read as the next request's
                self._drop()
                raise
        if frame.opcode is Opcode.TEXT:
            raise ChannelRefusal(json.loads(frame.data))
        server_s, encode_s = TIMING.unpack_from(frame.data)
        return memoryview(frame.data)[TIMING.size:], server_s, encode_s

    def _answer(self, sock: socket.socket, proto: ClientProtocol, deadline: float) -> Frame:
        parts: list[Frame] = []
        while True:
            for event in proto.events_received():
                if not isinstance(event, Frame):
                    continue
                if event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                    parts.append(event)
                    if event.fin:
                        if len(parts) == 1:
                            return parts[0]
                        return Frame(parts[0].opcode, b"".join(p.data for p in parts))
            if proto.state is not State.OPEN:
                raise ChannelBroken(f"the server closed the channel ({proto.close_code} {proto.close_reason})")
            self._read(sock, proto, deadline)

    @staticmethod
    def _read(sock: socket.socket, proto: ClientProtocol, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelBroken("no answer in time")
        sock.settimeout(left)
        data = sock.recv(READ)
        if data:
            proto.receive_data(data)
        else:
            proto.receive_eof()
        Channel._flush(sock, proto)  # pongs, the answer to a close
        if not data:
            raise ChannelBroken("the server closed the connection")

    @staticmethod
    def _flush(sock: socket.socket, proto: ClientProtocol) -> None:
        for data in proto.data_to_send():
            if data:
                sock.sendall(data)


class ChannelUnavailable(ChannelError):
    """A local channel could not be connected to (another host, another network namespace,
    a server gone): nothing was sent; the WebSocket channel is the way."""


class LocalChannel:
    """An env's local channel (:mod:`bunshin_gym.serve.local_channel`): a Unix socket in the
    abstract namespace named by the server, for a client on its host; :meth:`call` as
    :class:`Channel`'s. Blocking I/O on the asking thread, as :class:`Channel`. Thread-safe."""

    def __init__(self, abstract_socket: str, env_id: str, token: str, timeout: float):
        self._address = "\0" + abstract_socket
        self._env_id, self._token, self._timeout = env_id, token, timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self._timeout)
            try:
                sock.connect(self._address)
            except OSError as e:
                raise ChannelUnavailable(f"the server's local channel could not be reached: {e}") from None
            sock.setblocking(False)  # each read and write has its own deadline (local_wire)
            hello = json.dumps({"token": self._token, "env": self._env_id}).encode()
            try:
                local_wire.write(sock, LOCAL_JSON, hello, timeout=self._timeout)
                kind, data = _receive(sock, 1 << 16, self._timeout)
            except (OSError, EOFError, ChannelError) as e:
                raise ChannelError(f"the local channel could not be opened: {e}") from None
            if kind == LOCAL_ERROR:
                error = json.loads(bytes(data))
                raise ChannelError(error.get("message") or "the local channel was refused", error.get("status"))
            if kind != LOCAL_OK:
                raise ChannelError(f"the local channel answered its hello with a message of kind {kind}")
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def close(self) -> None:
        """Close the channel (the env stays)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def call(self, op: str, body: dict, meanwhile: Callable[[], Any] | None = None) -> tuple[memoryview, float, float]:
        """As :meth:`Channel.call`: the answer's frame, the server's seconds on it, its
        encoding's seconds; :class:`ChannelRefusal` for an error answer, :class:`ChannelBroken`
        when the channel broke while the request was out (not sent again)."""
        text = json.dumps({"op": op, **body}, separators=(",", ":"), allow_nan=False).encode()
        with self._lock:
            if self._sock is None:
                self._open()
            try:
                local_wire.write(self._sock, LOCAL_JSON, text, timeout=self._timeout)
            except (BrokenPipeError, ConnectionResetError):
                # the server closed the channel before this request (its env's idle timeout, a
                # restart): a Unix socket refuses a write to a closed peer, so nothing was sent
                self._drop()
                self._open()
                try:
                    local_wire.write(self._sock, LOCAL_JSON, text, timeout=self._timeout)
                except OSError as e:
                    self._drop()
                    raise ChannelError(f"the local channel broke before the request was sent ({e})") from None
            except OSError as e:
                self._drop()
                raise ChannelBroken(f"the request could not be sent whole ({e}); it may have run") from None
            except BaseException:
                self._drop()  # interrupted (Ctrl-C) with part of the request out: never finish it
                raise
            sock = self._sock
            try:
                if meanwhile is not None:
                    meanwhile()
                kind, data = _receive(sock, MAX_MESSAGE, self._timeout, wait_first=True)
            except (OSError, EOFError, ChannelError) as e:
                self._drop()
                raise ChannelBroken(f"the channel broke while the request was out ({e or type(e).__name__}); "
                                    "it may have run") from None
            except BaseException:
                # interrupted (Ctrl-C, an error in meanwhile) with the request out: its answer
                # must not be read as the next request's
                self._drop()
                raise
        if kind == LOCAL_ERROR:
            raise ChannelRefusal(json.loads(bytes(data)))
        if kind != LOCAL_ANSWER or len(data) < TIMING.size:
            with self._lock:
                self._drop()
            raise ChannelBroken(f"the server answered with a message of kind {kind}; the channel is closed")
        server_s, encode_s = TIMING.unpack_from(data)
        return data[TIMING.size:], server_s, encode_s


def _receive(sock: socket.socket, limit: int, timeout: float, wait_first: bool = False) -> tuple[int, memoryview]:
    """One message of a local channel (at most ``limit`` bytes, else ChannelError)."""
    try:
        return local_wire.read(sock, limit, timeout, wait_first=wait_first)
    except local_wire.TooLong as e:
        raise ChannelError(f"an answer of {e.length} bytes (at most {limit} are taken)") from None


class ChannelRefusal(BunshinError, RuntimeError):
    """The server answered a request with an error: its ``status``, message and error name
    (the HTTP API's for the same request)."""

    def __init__(self, error: Any):
        error = error if isinstance(error, dict) else {}
        self.status = error.get("status")
        self.error = error.get("error")
        super().__init__(error.get("message") or "the server refused the request")


def _refused(e: Exception) -> ChannelError:
    """A refused upgrade as a ChannelError with the server's status and message."""
    response = getattr(e, "response", None)
    if response is None:
        return ChannelError(f"the channel could not be opened: {e}")
    try:
        message = json.loads(response.body).get("message")
    except (ValueError, AttributeError, TypeError):
        message = None
    status = response.status_code
    return ChannelError(message or f"the channel was refused: {status} {response.reason_phrase}", status)
