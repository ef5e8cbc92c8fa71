"""envd, the agent inside an E2B sandbox, served by bunshin: the Connect-RPC services
``process.Process`` and ``filesystem.Filesystem`` (on the SDK's own generated server stubs
and messages, :mod:`e2b.envd.process.process_connect` and
:mod:`e2b.envd.filesystem.filesystem_connect`) and the HTTP routes ``/files`` and
``/health``.

Requests name their sandbox by the ``E2b-Sandbox-Id`` header the SDK sends to every envd
request and prove it with the sandbox's access token (``X-Access-Token``), which the API
gave the client when it created, connected or forked the sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from bunshin_gym.serve import ports, watch
from bunshin_gym.serve.registry import NotFound, Registry, ServeError
from bunshin_gym.serve.sandbox import DEFAULT_USER, Command, Paused, Sandbox, resolve
from bunshin_gym.workspace import WorkspaceError

log = logging.getLogger(__name__)

#: a stream with nothing to say sends a keepalive this often (the server notices a client
#: that went away only when it sends)
KEEPALIVE_S = 5.0
#: output polling: first interval, growth, cap (a short command answers in a few ms; a long
#: quiet one costs the agent ten reads a second)
POLL_FIRST, POLL_GROWTH, POLL_MAX = 0.002, 1.5, 0.1
#: a stream that ends this close to its deadline ended by it (connectrpc cancels it at the
#: deadline, the client closes it at its own, a little earlier)
DEADLINE_SLACK = 0.5

#: the largest upload (one request; a file is written in one agent request, held in memory)
MAX_UPLOAD = 256 << 20

_STATUS_CODES = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED,
                 404: Code.NOT_FOUND, 409: Code.ALREADY_EXISTS, 429: Code.RESOURCE_EXHAUSTED}


def sandbox_of(registry: Registry, headers) -> Sandbox:
    """The sandbox a request is for, checked against its access token (ServeError 401/404)."""
    sb_id = headers.get("e2b-sandbox-id")
    if not sb_id:
        raise ServeError("no E2b-Sandbox-Id header: which sandbox is this request for?", 400)
    sb = registry.get(sb_id, kind=Sandbox)
    token = headers.get("x-access-token") or ""
    if not hmac.compare_digest(token.encode(), sb.envd_token.encode()):
        raise ServeError(f"sandbox {sb_id}: missing or wrong X-Access-Token", 401)
    return sb


def signature_of(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL (the SDK's :func:`e2b.sandbox.signature.get_signature`
    given the expiration it computed): sha256 over path, operation, user ("" for the
    default), the envd access token and the expiration, base64 without padding."""
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def signed_sandbox(registry: Registry, request: Request, operation: str) -> Sandbox:
    """The sandbox a signed file URL (``upload_url``/``download_url``) is for, its signature
    and expiry checked (ServeError 400/401). The URL names no sandbox when the SDK's sandbox
    URL is this server, so the one whose token makes the signature is it."""
    q = request.query_params
    signature, path, user = q.get("signature") or "", q.get("path") or "", q.get("username") or ""
    expiration = q.get("signature_expiration")
    if expiration is not None:
        if not expiration.isdigit():
            raise ServeError("signature_expiration must be a Unix time in seconds", 400)
        if int(expiration) < time.time():
            raise ServeError("the signed URL has expired", 401)
    named = request.headers.get("e2b-sandbox-id")
    host = request.headers.get("host") or ""
    prefix = f"{ports.ENVD_PORT}-"
    if not named and host.startswith(prefix):
        named = host[len(prefix):].partition(".")[0]
    candidates = [registry.get(named, kind=Sandbox)] if named else registry.list(kind=Sandbox)
    for sb in candidates:
        expected = signature_of(path, operation, user, sb.envd_token, int(expiration) if expiration else None)
        if hmac.compare_digest(signature.encode(), expected.encode()):
            sb.touch()
            return sb
    raise ServeError(f"the signature does not match a {operation} of {path!r} by {user or 'the default user'}", 401)


def user_of(headers) -> str:
    """The user of an envd request: ``Authorization: Basic base64(user:)``, else the default."""
    auth = headers.get("authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "basic" or not value:
        return DEFAULT_USER
    try:
        user = base64.b64decode(value, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ServeError("Authorization: Basic with an undecodable user", 400) from None
    if not user or "/" in user or "\0" in user:
        raise ServeError(f"bad user name {user!r}", 400)
    return user


def _connect_error(e: Exception) -> ConnectError:
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, Paused):
        return ConnectError(Code.UNAVAILABLE, str(e))
    if isinstance(e, ServeError):
        return ConnectError(_STATUS_CODES.get(e.status, Code.INTERNAL), str(e))
    if isinstance(e, WorkspaceError):
        return ConnectError(Code.UNAVAILABLE, f"the sandbox failed: {e}")
    log.exception("envd request failed")
    return ConnectError(Code.INTERNAL, f"{type(e).__name__}: {e}")


async def _call(fn: Callable, *args, **kwargs):
    """Run a blocking workspace call off the event loop, as a Connect error if it fails."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the client as a status
        raise _connect_error(e) from None


class ProcessService:
    """``process.Process``: commands started, streamed, listed, signalled, fed."""

    def __init__(self, registry: Registry):
        self.registry = registry

    async def _sandbox(self, ctx) -> Sandbox:
        try:
            return sandbox_of(self.registry, ctx.request_headers)
        except Exception as e:  # noqa: BLE001
            raise _connect_error(e) from None

    def start(self, request: process_pb.StartRequest, ctx) -> AsyncIterator[process_pb.StartResponse]:
        return self._start(request, ctx)

    async def _start(self, request, ctx):
        sb = await self._sandbox(ctx)
        try:
            user = user_of(ctx.request_headers)
        except ServeError as e:
            raise _connect_error(e) from None
        pty = None
        if request.has_field("pty"):
            size = request.pty.size or process_pb.PTY.Size()
            pty = (size.rows, size.cols)
        proc = request.process or process_pb.ProcessConfig()
        if not proc.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        command = await _call(sb.start, proc.cmd, list(proc.args), dict(proc.envs),
                              proc.cwd if proc.has_field("cwd") else None, user,
                              request.tag if request.has_field("tag") else None,
                              request.stdin if request.has_field("stdin") else False, pty)
        async for event in self._events(sb, command, ctx, kill_at_deadline=True):
            yield process_pb.StartResponse(event=event)

    def connect(self, request: process_pb.ConnectRequest, ctx) -> AsyncIterator[process_pb.ConnectResponse]:
        return self._connect(request, ctx)

    async def _connect(self, request, ctx):
        sb = await self._sandbox(ctx)
        command = await _call(self._select, sb, request.process)
        async for event in self._events(sb, command, ctx, kill_at_deadline=False):
            yield process_pb.ConnectResponse(event=event)

    async def _events(self, sb: Sandbox, command: Command, ctx,
                      kill_at_deadline: bool) -> AsyncIterator[process_pb.ProcessEvent]:
        """Start, then output as it comes, then the end; keepalives while quiet. Past a
        Start request's deadline the command is killed (E2B's command timeout: ``timeout=0``
        for none); a client that goes away before leaves it running (a background command)."""
        ev = process_pb.ProcessEvent
        timeout_ms = ctx.timeout_ms  # what is left of the request's deadline
        deadline = None if not timeout_ms else time.monotonic() + timeout_ms / 1000
        try:
            yield ev(event=Oneof("start", ev.StartEvent(pid=command.pid)))
            async for event in self._poll(sb, command, deadline if kill_at_deadline else None, timeout_ms):
                yield event
        finally:
            # connectrpc cancels a stream at its deadline (and closes it when the client went):
            # a command past its timeout is killed even then, from a thread (we may be cancelled)
            if kill_at_deadline and deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK \
                    and command.exit_code is None:
                asyncio.get_running_loop().run_in_executor(None, _kill_quietly, sb, command)

    async def _poll(self, sb: Sandbox, command: Command, deadline: float | None,
                    timeout_ms: float | None) -> AsyncIterator[process_pb.ProcessEvent]:
        ev = process_pb.ProcessEvent
        out_at = err_at = 0
        delay, last_sent = POLL_FIRST, time.monotonic()
        while True:
            if command.pty:
                code, out, out_at = await _call(sb.poll_pty, command, out_at)
                err = b""
            else:
                code, out, err = await _call(sb.poll, command, out_at, err_at)
                out_at += len(out)
            sb.touch()
            if out:
                yield ev(event=Oneof("data", ev.DataEvent(output=Oneof("pty" if command.pty else "stdout", out))))
            if err:
                err_at += len(err)
                yield ev(event=Oneof("data", ev.DataEvent(output=Oneof("stderr", err))))
            if code is not None:
                end = ev.EndEvent(exit_code=code, exited=command.signalled is None,
                                  status=f"signal: {command.signalled}" if command.signalled else f"exit status {code}")
                if command.signalled:
                    end.error = f"signal: {command.signalled}"
                yield ev(event=Oneof("end", end))
                return
            now = time.monotonic()
            if out or err:
                delay, last_sent = POLL_FIRST, now
            elif now - last_sent >= KEEPALIVE_S:
                last_sent = now
                yield ev(event=Oneof("keepalive", ev.KeepAlive()))
            if deadline is not None and now >= deadline:
                await _call(sb.signal, command, "KILL")
                raise ConnectError(Code.DEADLINE_EXCEEDED, f"command timed out after {timeout_ms / 1000:g} s "
                                                           f"and was killed (pid {command.pid})")
            await asyncio.sleep(delay)
            delay = min(delay * POLL_GROWTH, POLL_MAX)

    @staticmethod
    def _select(sb: Sandbox, selector) -> Command:
        which = selector.selector if selector is not None else None
        match which:
            case Oneof(field="pid", value=pid):
                return sb.find(pid=pid)
            case Oneof(field="tag", value=tag):
                return sb.find(tag=tag)
        raise ServeError("a process selector (pid or tag) is required", 400)

    async def list(self, request, ctx) -> process_pb.ListResponse:
        sb = await self._sandbox(ctx)
        running = await _call(sb.running)
        return process_pb.ListResponse(processes=[
            process_pb.ProcessInfo(config=process_pb.ProcessConfig(cmd=c.cmd, args=c.args, envs=c.envs, cwd=c.cwd),
                                   pid=c.pid, tag=c.tag)
            for c in running])

    async def send_signal(self, request, ctx) -> process_pb.SendSignalResponse:
        sb = await self._sandbox(ctx)
        command = await _call(self._select, sb, request.process)
        sig = {process_pb.Signal.SIGKILL: "KILL", process_pb.Signal.SIGTERM: "TERM"}.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal}")
        if command.exit_code is not None:
            raise ConnectError(Code.NOT_FOUND, f"process {command.pid} has already ended")
        await _call(sb.signal, command, sig)
        return process_pb.SendSignalResponse()

    async def send_input(self, request, ctx) -> process_pb.SendInputResponse:
        sb = await self._sandbox(ctx)
        command = await _call(self._select, sb, request.process)
        await self._input(sb, command, request.input)
        return process_pb.SendInputResponse()

    @staticmethod
    async def _input(sb: Sandbox, command: Command, given) -> None:
        match given.input if given is not None else None:
            case Oneof(field="stdin", value=data) if not command.pty:
                await _call(sb.send_stdin, command, data)
            case Oneof(field="stdin" | "pty", value=data) if command.pty:
                await _call(sb.pty_input, command, data)
            case Oneof(field="pty"):
                raise ConnectError(Code.INVALID_ARGUMENT, f"process {command.pid} has no terminal: send it stdin")
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "no input given (stdin or pty)")

    async def close_stdin(self, request, ctx) -> process_pb.CloseStdinResponse:
        sb = await self._sandbox(ctx)
        command = await _call(self._select, sb, request.process)
        await _call(sb.close_stdin, command)
        return process_pb.CloseStdinResponse()

    async def update(self, request, ctx) -> process_pb.UpdateResponse:
        sb = await self._sandbox(ctx)
        command = await _call(self._select, sb, request.process)
        if not request.has_field("pty") or request.pty.size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "only a terminal's size can be updated: pty.size is missing")
        await _call(sb.resize, command, request.pty.size.rows, request.pty.size.cols)
        return process_pb.UpdateResponse()

    async def stream_input(self, requests: AsyncIterator[process_pb.StreamInputRequest],
                           ctx) -> process_pb.StreamInputResponse:
        """A start event naming the process, then its input, written in the order it comes."""
        sb = await self._sandbox(ctx)
        command = None
        async for request in requests:
            match request.event:
                case Oneof(field="start", value=start):
                    if command is not None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "a second start event in one input stream")
                    command = await _call(self._select, sb, start.process)
                case Oneof(field="data", value=data):
                    if command is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "input before the start event naming the process")
                    await self._input(sb, command, data.input)
                case Oneof(field="keepalive"):
                    pass
                case _:
                    raise ConnectError(Code.INVALID_ARGUMENT, "an input stream event of no known kind")
        return process_pb.StreamInputResponse()


def _kill_quietly(sb: Sandbox, command: Command) -> None:
    try:
        sb.signal(command, "KILL")
    except Exception as e:  # noqa: BLE001 - the sandbox may be gone by now
        log.warning("killing timed-out process %s in %s: %s", command.pid, sb.id, e)


def _entry(d: dict) -> filesystem_pb.EntryInfo:
    ft = filesystem_pb.FileType
    entry = filesystem_pb.EntryInfo(
        name=d["name"], path=d["path"], type=ft.DIRECTORY if d["type"] == "dir" else ft.FILE,
        size=d["size"], mode=d["mode"], permissions=d["perm"], owner=d["owner"], group=d["group"],
        modified_time=Timestamp.from_nanos(d["mtime_ns"]), is_symlink=bool(d["link"]))
    if d.get("target") is not None:
        entry.symlink_target = d["target"]
    return entry


class FilesystemService:
    """``filesystem.Filesystem``: stat, list, make, move, remove, and watchers by polling
    (:mod:`bunshin_gym.serve.watch`), kept in ``watcher_store`` when given (they then
    outlive a server restart)."""

    def __init__(self, registry: Registry, watcher_store: watch.WatcherStore | None = None):
        self.registry = registry
        self.watcher_store = watcher_store

    async def _keep(self, sb: Sandbox, watcher: watch.Watcher) -> None:
        if self.watcher_store is not None:
            await _call(self.watcher_store.save, sb.id, watcher)

    async def _run(self, ctx, op: str, path: str, **args):
        try:
            headers = ctx.request_headers
            sb = sandbox_of(self.registry, headers)
            user = user_of(headers)
            args = {k: resolve(v, user) if k == "dest" else v for k, v in args.items()}
            return await asyncio.to_thread(sb.fs, op, user, path=resolve(path, user), **args)
        except Exception as e:  # noqa: BLE001
            raise _connect_error(e) from None

    async def stat(self, request, ctx):
        return filesystem_pb.StatResponse(entry=_entry(await self._run(ctx, "stat", request.path)))

    async def list_dir(self, request, ctx):
        entries = await self._run(ctx, "list", request.path, depth=request.depth or 1)
        return filesystem_pb.ListDirResponse(entries=[_entry(d) for d in entries])

    async def make_dir(self, request, ctx):
        return filesystem_pb.MakeDirResponse(entry=_entry(await self._run(ctx, "mkdir", request.path)))

    async def move(self, request, ctx):
        return filesystem_pb.MoveResponse(
            entry=_entry(await self._run(ctx, "move", request.source, dest=request.destination)))

    async def remove(self, request, ctx):
        await self._run(ctx, "remove", request.path)
        return filesystem_pb.RemoveResponse()

    async def _watcher(self, ctx, request) -> tuple[Sandbox, watch.Watcher]:
        """A new watcher of the request's directory, with its first listing."""
        if request.include_entry:
            raise ConnectError(Code.UNIMPLEMENTED, "include_entry is not supported by bunshin serve")
        try:
            sb = sandbox_of(self.registry, ctx.request_headers)
            user = user_of(ctx.request_headers)
            watcher = watch.Watcher(resolve(request.path, user), request.recursive, user)
        except Exception as e:  # noqa: BLE001
            raise _connect_error(e) from None
        watcher.entries = await _call(watch.list_tree, sb, watcher)
        return sb, watcher

    async def _changes(self, sb: Sandbox, watcher: watch.Watcher,
                       keep: bool = False) -> list[filesystem_pb.FilesystemEvent]:
        """The events since the last listing; ``keep``: write the new listing to the store
        when it changed (a kept watcher)."""
        entries = await _call(watch.list_tree, sb, watcher)
        events = watch.diff(watcher.entries, entries)
        changed, watcher.entries = entries != watcher.entries, entries
        if keep and changed:
            await self._keep(sb, watcher)
        return [filesystem_pb.FilesystemEvent(name=name, type=kind) for name, kind in events]

    def watch_dir(self, request, ctx) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        return self._watch_dir(request, ctx)

    async def _watch_dir(self, request, ctx):
        """Start, then each change as a poll finds it, keepalives while quiet; until the
        request's deadline or the client goes."""
        sb, watcher = await self._watcher(ctx, request)
        res = filesystem_pb.WatchDirResponse
        yield res(event=Oneof("start", res.StartEvent()))
        delay, last_sent = watch.POLL_FIRST, time.monotonic()
        while True:
            await asyncio.sleep(delay)
            events = await self._changes(sb, watcher)
            sb.touch()
            for event in events:
                yield res(event=Oneof("filesystem", event))
            now = time.monotonic()
            if events:
                delay, last_sent = watch.POLL_FIRST, now
            else:
                delay = min(delay * watch.POLL_GROWTH, watch.POLL_MAX)
                if now - last_sent >= KEEPALIVE_S:
                    last_sent = now
                    yield res(event=Oneof("keepalive", res.KeepAlive()))

    async def create_watcher(self, request, ctx) -> filesystem_pb.CreateWatcherResponse:
        sb, watcher = await self._watcher(ctx, request)
        try:
            watch.add_watcher(sb.watchers, watcher)
        except ServeError as e:
            raise _connect_error(e) from None
        await self._keep(sb, watcher)
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher.id)

    async def _known(self, ctx, watcher_id: str) -> tuple[Sandbox, watch.Watcher]:
        try:
            sb = sandbox_of(self.registry, ctx.request_headers)
            watcher = sb.watchers.get(watcher_id)
            if watcher is None:
                raise NotFound(f"no watcher {watcher_id!r} in sandbox {sb.id}")
        except Exception as e:  # noqa: BLE001
            raise _connect_error(e) from None
        return sb, watcher

    async def get_watcher_events(self, request, ctx) -> filesystem_pb.GetWatcherEventsResponse:
        """What changed since the watcher's last listing (its creation or the last call)."""
        sb, watcher = await self._known(ctx, request.watcher_id)
        return filesystem_pb.GetWatcherEventsResponse(events=await self._changes(sb, watcher, keep=True))

    async def remove_watcher(self, request, ctx) -> filesystem_pb.RemoveWatcherResponse:
        sb, watcher = await self._known(ctx, request.watcher_id)
        sb.watchers.pop(watcher.id, None)
        if self.watcher_store is not None:
            await _call(self.watcher_store.remove, sb.id, watcher.id)
        return filesystem_pb.RemoveWatcherResponse()


def rpc_apps(registry: Registry, watcher_store: watch.WatcherStore | None = None) -> dict[str, object]:
    """The Connect-RPC ASGI apps, by the path prefix they serve."""
    process = ProcessASGIApplication(ProcessService(registry))
    filesystem = FilesystemASGIApplication(FilesystemService(registry, watcher_store))
    return {process.path + "/": process, filesystem.path + "/": filesystem}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _failure(e: Exception) -> JSONResponse:
    """The answer to a files request that failed: a paused sandbox or a failed workspace is
    the upstream's fault (502), a bad request says its own status."""
    if isinstance(e, ServeError) and not isinstance(e, Paused):
        return _error(e.status, str(e))
    return _error(502, str(e) if isinstance(e, Paused) else f"the sandbox failed: {e}")


def files_router(registry: Registry) -> APIRouter:
    """envd's HTTP API: ``GET /files`` (download), ``POST /files`` (upload, multipart or
    octet-stream), ``GET /health``."""
    router = APIRouter()

    def _target(request: Request) -> tuple[Sandbox, str, str | None]:
        if "signature" in request.query_params and not request.headers.get("x-access-token"):
            sb = signed_sandbox(registry, request, "read" if request.method == "GET" else "write")
        else:
            sb = sandbox_of(registry, request.headers)
        user = request.query_params.get("username") or user_of(request.headers)
        path = request.query_params.get("path")
        return sb, user, resolve(path, user) if path else None

    @router.get("/health")
    async def health(request: Request) -> Response:
        if request.headers.get("e2b-sandbox-id"):
            try:
                sb = sandbox_of(registry, request.headers)
            except ServeError as e:
                return _error(502 if e.status == 404 else e.status, f"sandbox not found: {e}")
            if sb.ws is None:
                return _error(502, f"sandbox {sb.id} is paused")
        return Response(status_code=204)

    @router.get("/files")
    async def download(request: Request) -> Response:
        try:
            sb, user, path = _target(request)
            if path is None:
                raise ServeError("the path query parameter is required", 400)
            data = await asyncio.to_thread(sb.read_file, path)
        except (Paused, ServeError, WorkspaceError) as e:
            return _failure(e)
        return Response(content=data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{os.path.basename(path)}"'})

    @router.post("/files")
    async def upload(request: Request) -> Response:
        try:
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > MAX_UPLOAD:
                raise ServeError(f"the upload is {int(length)} bytes, over the limit of {MAX_UPLOAD}", 413)
            sb, user, path = _target(request)
            files: list[tuple[str, bytes]] = []
            ctype = request.headers.get("content-type", "")
            if ctype.startswith("multipart/form-data"):
                form = await request.form()
                try:
                    for _, part in form.multi_items():
                        if isinstance(part, str):
                            continue
                        name = path if path and len(form) == 1 else resolve(part.filename or "", user)
                        files.append((name, await part.read()))
                finally:
                    await form.close()
            else:
                if path is None:
                    raise ServeError("the path query parameter is required for an octet-stream upload", 400)
                body = await request.body()
                if request.headers.get("content-encoding", "").lower() == "gzip":
                    try:
                        body = gzip.decompress(body)
                    except (OSError, EOFError) as e:
                        raise ServeError(f"the gzip body does not decompress: {e}", 400) from None
                files.append((path, body))
            if not files:
                raise ServeError("no file in the upload", 400)
            for name, data in files:
                await asyncio.to_thread(sb.write_file, name, data, user)
        except (Paused, ServeError, WorkspaceError) as e:
            return _failure(e)
        return JSONResponse([{"name": os.path.basename(n), "type": "file", "path": n} for n, _ in files])

    return router
