"""``bunshin serve``: the application (FastAPI for the REST routes, the SDK's Connect-RPC
stubs for envd), the service state it shares, and running it under uvicorn.

The server's state (sandboxes, their owners, timeouts, access tokens, paused and named
snapshots) is written to ``state.json`` in its state directory after every change, so a
restarted server reattaches the sandboxes whose workspaces still run, keeps the paused and
named snapshots, and reclaims what it cannot reattach (env workspaces: an env's Python
state dies with the process that held it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from bunshin_gym.config import paths
from bunshin_gym.errors import BunshinError, ResetNeeded, TaskError
from bunshin_gym.serve import channel, e2b_api, envd, envs_api, local_channel, ports, watch
from bunshin_gym.serve.auth import Principal, TokenStore, token_from_headers
from bunshin_gym.serve.registry import NotFound, Registry, ServeError
from bunshin_gym.serve.sandbox import Command, Sandbox
from bunshin_gym.workspace import Workspace, WorkspaceError, records
from bunshin_gym.workspace.errors import SnapshotError
from bunshin_gym.workspace.snapshot import SnapshotStore

log = logging.getLogger(__name__)

#: seconds the server keeps an idle client connection open
KEEP_ALIVE_S = 75


@dataclass
class ServeConfig:
    """How the server runs (``bunshin serve --help`` names the same settings)."""

    host: str = "127.0.0.1"
    port: int = 49982
    token_file: str | None = None
    #: where state.json (and a generated token) live; default $BUNSHIN_HOME/serve: paused and
    #: named snapshots are on the pool and outlive a reboot, so their names must too
    state_dir: str | None = None
    #: seconds without a request after which a sandbox or env is reclaimed (0: never)
    idle_timeout: float = 900.0
    #: longest sandbox timeout a client may ask for (E2B Pro's is a day)
    max_timeout: int = 86400
    #: an env's time to live (seconds; None: until closed or idle)
    env_ttl: float | None = 86400.0
    #: how often the reaper looks (seconds)
    reap_interval: float = 1.0
    #: per-sandbox limits (None: BUNSHIN_WS_* or the defaults) and memory mode of sandboxes
    limits: dict | None = None
    memory_mode: str = "share"
    #: threads for blocking workspace calls (each in-flight request holds one)
    threads: int = 128
    #: the domain of sandbox hosts (``get_host(port)`` is PORT-ID.DOMAIN); None: the SDK's own
    domain: str | None = None
    #: serve env channels on a Unix socket to clients on this host
    #: (:mod:`bunshin_gym.serve.local_channel`); off: the WebSocket channel only
    local_channel: bool = True

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else paths().home / "serve"


class Service:
    """What the routes share: config, tokens, the registry, named snapshots, persistence."""

    def __init__(self, config: ServeConfig):
        self.config = config
        config.state_path.mkdir(parents=True, exist_ok=True)
        self.tokens = (TokenStore.load(config.token_file) if config.token_file
                       else TokenStore.generated(config.state_path / "token.json"))
        self.registry = Registry(config.reap_interval)
        self.registry.on_change = self.save
        self._snapshots: dict[str, dict] = {}  # name -> {"id": snapshot id, "owner": name}
        self._save_lock = threading.Lock()
        self._loading = False
        #: the sandboxes' watchers, kept across restarts (:mod:`bunshin_gym.serve.watch`)
        self.watchers = watch.WatcherStore(config.state_path / "watchers")
        #: the local channels' socket while the server runs (None: none)
        self.local_channel: local_channel.Listener | None = None

    # auth ------------------------------------------------------------------------------
    async def principal(self, request: Request) -> Principal:
        """FastAPI dependency: the caller's principal, or 401 (async: FastAPI runs a plain
        function dependency in a thread, one more hop per request)."""
        who = self.tokens.authenticate(token_from_headers(request.headers))
        if who is None:
            raise ServeError("missing or unknown API key (send X-API-KEY or Authorization: Bearer)", 401)
        return who

    # named snapshots (E2B create_snapshot; a template for create) ---------------------------
    def add_snapshot(self, name: str, snap_id: str, who: Principal) -> str:
        with self._save_lock:
            old = self._snapshots.get(name)
            if old is not None and old["owner"] != who.name:
                raise ServeError(f"snapshot name {name!r} is taken", 409)
            self._snapshots[name] = {"id": snap_id, "owner": who.name}
        if old is not None and old["id"] != snap_id:
            _release_snapshot(old["id"])
        self.save()
        return name

    def named_snapshot(self, name: str, who: Principal):
        entry = self._snapshots.get(name)
        if entry is None or entry["owner"] != who.name:
            return None
        try:
            return SnapshotStore().get(entry["id"])
        except SnapshotError as e:
            raise ServeError(f"snapshot {name!r} cannot be used: {e}", 500) from None

    def snapshot_names(self, who: Principal) -> list[str]:
        return sorted(n for n, e in self._snapshots.items() if e["owner"] == who.name)

    def delete_snapshot(self, name: str, who: Principal) -> None:
        with self._save_lock:
            entry = self._snapshots.get(name)
            if entry is None or entry["owner"] != who.name:
                raise NotFound(f"no snapshot {name!r}")
            del self._snapshots[name]
        _release_snapshot(entry["id"])
        self.save()

    # persistence -----------------------------------------------------------------------
    def save(self) -> None:
        if self._loading:
            return
        sandboxes = {}
        for sb in self.registry.list(kind=Sandbox):
            sandboxes[sb.id] = {
                "owner": sb.owner.name, "template": sb.template, "end_at": sb.end_at, "created": sb.created,
                "timeout": sb.timeout, "idle_timeout": sb.idle_timeout, "envd_token": sb.envd_token,
                "traffic_token": sb.traffic_token,
                "metadata": sb.metadata, "env_vars": sb.env_vars, "auto_pause": sb.auto_pause,
                "memory_limit": sb.memory_limit, "workspace": sb.ws.id if sb.ws is not None else None,
                "paused_snapshot": sb.paused_snapshot.id if sb.paused_snapshot is not None else None,
                "commands": [vars(c) for c in sb.commands.values()],
            }
        state = {"pid": os.getpid(), "pid_start": records.proc_start_time(os.getpid()),
                 "sandboxes": sandboxes, "snapshots": self._snapshots}
        path = self.config.state_path / "state.json"
        with self._save_lock:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1))
            tmp.replace(path)
            self.watchers.keep_only(set(sandboxes))  # a closed sandbox's watchers go with it

    def load(self) -> dict[str, int]:
        """Reattach what a previous server left (see the module doc); returns counts."""
        path = self.config.state_path / "state.json"
        counts = {"reattached": 0, "paused": 0, "reaped": 0, "env_workspaces_reaped": 0}
        if not path.exists():
            return counts
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.error("cannot read %s (%s): starting empty", path, e)
            return counts
        by_name = {p.name: p for p in self.tokens.principals}
        self._loading = True
        try:
            self._snapshots = {n: e for n, e in (state.get("snapshots") or {}).items() if e.get("owner") in by_name}
            for sb_id, d in (state.get("sandboxes") or {}).items():
                who = by_name.get(d.get("owner"))
                outcome = self._reattach(sb_id, d, who)
                counts[outcome] += 1
            old_pid = state.get("pid")
            if old_pid and old_pid != os.getpid():
                counts["env_workspaces_reaped"] = _reap_owned_by(old_pid, state.get("pid_start"))
        finally:
            self._loading = False
        self.save()
        log.info("state of the previous server: %s", counts)
        return counts

    def _reattach(self, sb_id: str, d: dict, who: Principal | None) -> str:
        ws = snap = None
        try:
            if d.get("workspace"):
                ws = Workspace.attach(d["workspace"])
            elif d.get("paused_snapshot"):
                snap = SnapshotStore().get(d["paused_snapshot"])
        except (WorkspaceError, SnapshotError) as e:
            log.warning("sandbox %s cannot be reattached: %s", sb_id, e)
        if who is None or (ws is None and snap is None):
            if ws is not None:
                ws.close()
            if snap is not None:
                snap.release()
            return "reaped"
        memory = int(d.get("memory_limit") or 0)
        sb = Sandbox(id=sb_id, owner=who, end_at=d.get("end_at"), idle_timeout=d.get("idle_timeout") or 0,
                     workspaces=1 if ws is not None else 0, memory=memory if ws is not None else 0,
                     created=d.get("created") or time.time(), template=d.get("template") or "base", ws=ws,
                     paused_snapshot=snap, metadata=d.get("metadata") or {}, env_vars=d.get("env_vars") or {},
                     envd_token=d["envd_token"], auto_pause=bool(d.get("auto_pause")),
                     timeout=d.get("timeout") or 300, memory_limit=memory)
        if d.get("traffic_token"):
            sb.traffic_token = d["traffic_token"]
        sb.commands = {c["pid"]: Command(**c) for c in d.get("commands") or []}
        sb.watchers = self.watchers.load(sb_id)
        self.registry.reserve(who, sb.workspaces, sb.memory)  # may exceed a quota lowered meanwhile: kept
        self.registry.add(sb)
        return "reattached" if ws is not None else "paused"

    def shutdown(self, *, close_all: bool) -> None:
        self.registry.stop_reaper()
        if close_all:
            self.registry.close_all()
        else:
            # env workspaces cannot be reattached (their env objects die with us): close them
            for lease in self.registry.list(kind=envs_api.EnvLease):
                self.registry.close(lease.id, why="server shutdown")
        self.save()


def _release_snapshot(snap_id: str) -> None:
    try:
        SnapshotStore().get(snap_id).release()
    except SnapshotError:
        pass


def _reap_owned_by(pid: int, start: int | None) -> int:
    """Reclaim the workspaces a dead server owned (its env workspaces), then release the
    snapshots its envs held (their boot, reset and clone snapshots), as their close would have."""
    from bunshin_gym.workspace.workspace import reclaim

    if records.process_alive(pid, start):
        return 0
    n = 0
    for rec in records.all_records():
        if rec.owner == pid and rec.owner_start == start:
            try:
                reclaim(rec)
                n += 1
            except Exception:  # noqa: BLE001 - bunshin gc gets what is left
                log.exception("reclaiming %s of the previous server failed", rec.id)
    held = [s for s in SnapshotStore().list() if s.metadata.holder == [pid, start]]
    for snap in sorted(held, key=lambda s: -s.depth):  # children first, as the envs release them
        try:
            snap.release()
        except SnapshotError:  # in use, or gone meanwhile: bunshin gc gets what is left
            log.warning("releasing snapshot %s of the previous server failed", snap.id, exc_info=True)
    return n


def create_app(config: ServeConfig | None = None, *, close_on_shutdown: bool = False) -> FastAPI:
    """The ASGI application. ``close_on_shutdown``: close every sandbox when the server
    stops (tests); by default sandboxes outlive a restart and are reattached."""
    config = config or ServeConfig()
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        # blocking workspace calls run in threads: a forking or stepping client must not
        # hold up the others (the defaults are 40 and cpu+4 threads)
        anyio.to_thread.current_default_thread_limiter().total_tokens = config.threads
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(config.threads, "bunshin-serve"))
        await asyncio.to_thread(service.load)
        service.registry.start_reaper()
        if config.local_channel:
            service.local_channel = local_channel.Listener(service.tokens, service.registry)
        try:
            yield
        finally:
            if service.local_channel is not None:
                service.local_channel.stop()
                service.local_channel = None
            await asyncio.to_thread(service.shutdown, close_all=close_on_shutdown)

    api = FastAPI(title="bunshin serve", lifespan=lifespan)
    api.state.service = service

    @api.exception_handler(ServeError)
    async def serve_error(request: Request, e: ServeError) -> JSONResponse:
        # a quota does not free itself in seconds: the SDK must not retry its 429
        headers = {"Should-Retry": "false"} if e.status == 429 else None
        return JSONResponse({"code": e.status, "message": str(e)}, status_code=e.status, headers=headers)

    @api.exception_handler(WorkspaceError)
    async def workspace_error(request: Request, e: WorkspaceError) -> JSONResponse:
        return JSONResponse({"code": 500, "message": f"{type(e).__name__}: {e}"}, status_code=500)

    @api.exception_handler(ResetNeeded)
    async def reset_needed(request: Request, e: ResetNeeded) -> JSONResponse:
        # a step after the episode's end is the client's mistake, and the connection stays
        # usable (an unhandled error would make the server drop it); RemoteEnv raises it again
        return JSONResponse({"code": 409, "message": str(e), "error": "ResetNeeded"}, status_code=409)

    @api.exception_handler(TaskError)
    async def task_error(request: Request, e: TaskError) -> JSONResponse:
        return JSONResponse({"code": 400, "message": f"bad task: {e}"}, status_code=400)

    @api.exception_handler(BunshinError)
    async def bunshin_error(request: Request, e: BunshinError) -> JSONResponse:
        # a handled error: the response goes out and the connection is kept (the catch-all
        # below re-raises after responding, and the client then sees its connection reset)
        log.warning("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return JSONResponse({"code": 500, "message": f"{type(e).__name__}: {e}"}, status_code=500)

    @api.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse({"code": 400, "message": f"bad request: {e.errors()}"}, status_code=400)

    @api.exception_handler(Exception)
    async def any_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"code": 500, "message": f"{type(e).__name__}: {e}"}, status_code=500)

    api.include_router(e2b_api.router(service))
    api.include_router(envs_api.router(service))
    api.include_router(channel.router(service))
    api.include_router(local_channel.router(service))
    api.include_router(envd.files_router(service.registry))
    rpc = envd.rpc_apps(service.registry, service.watchers)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        # a host PORT-SANDBOX.DOMAIN is for a port inside that sandbox; Connect-RPC paths go
        # to the SDK's generated ASGI apps, everything else to FastAPI
        if scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
            target = ports.target_of(host)
            if target is not None:
                return await ports.proxy(service.registry, scope, receive, send, *target)
            path = scope["path"]
            for prefix, rpc_app in rpc.items():
                if path.startswith(prefix):
                    return await rpc_app(scope, receive, send)
        return await api(scope, receive, send)

    app.service = service  # type: ignore[attr-defined]
    app.fastapi = api  # type: ignore[attr-defined]
    return app


def run(config: ServeConfig, *, log_level: str = "info", close_on_exit: bool = False) -> None:
    """Serve until interrupted (``bunshin serve``)."""
    import uvicorn

    app = create_app(config, close_on_shutdown=close_on_exit)
    # keep-alive: longer than clients keep idle connections (httpx 5 s, RemoteEnv 30 s), so a
    # client never sends a request on a connection the server is closing at that moment
    # no WebSocket pings: an env channel's client reads only while it waits for an answer, and
    # a policy may think for minutes; a silent channel is closed after its env's idle timeout
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S, ws_ping_interval=None)
