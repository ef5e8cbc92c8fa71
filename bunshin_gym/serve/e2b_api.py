"""E2B's sandbox REST API (the control plane the ``e2b`` SDK calls), answered with the SDK's
own response models (:mod:`e2b.api.client.models`).

Templates are bunshin image names (``base``, ``osworld``, ``webarena``) or the names of
snapshots made with ``create_snapshot`` (a sandbox created from one is a fork of it).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from typing import Any
from urllib.parse import unquote

from e2b.api.client.models import (
    Error,
    ListedSandbox,
    SandboxDetail,
    SandboxForkResult,
    SandboxMetric,
    SandboxState,
    SnapshotInfo,
)
from e2b.api.client.models import Sandbox as SandboxModel
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from bunshin_gym.config import Limits
from bunshin_gym.serve.auth import Principal
from bunshin_gym.serve.registry import NotFound, ServeError, json_object
from bunshin_gym.serve.sandbox import ENVD_VERSION, Sandbox, pause, resume
from bunshin_gym.workspace import UnknownImage, Workspace, WorkspaceError

log = logging.getLogger(__name__)

#: E2B's default sandbox timeout (seconds) and the SDK's cap on one fork request
DEFAULT_TIMEOUT = 300
MAX_FORK = 100


def _utc(epoch: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)


def created_model(sb: Sandbox, domain: str | None = None) -> dict:
    """What create, connect and each fork answer: the id, the envd and traffic access tokens
    and, when the server has one, the domain of the sandbox's hosts (``get_host``)."""
    model = SandboxModel(template_id=sb.template, sandbox_id=sb.id, client_id="bunshin", envd_version=ENVD_VERSION,
                         alias=sb.template, envd_access_token=sb.envd_token, traffic_access_token=sb.traffic_token)
    if domain:
        model.domain = domain
    return model.to_dict()


def _common(sb: Sandbox) -> dict[str, Any]:
    limits = Limits.from_env()
    return dict(template_id=sb.template, sandbox_id=sb.id, client_id="bunshin", alias=sb.template,
                started_at=_utc(sb.created), end_at=_utc(sb.end_at or time.time() + 365 * 86400),
                cpu_count=1, memory_mb=(sb.memory_limit or limits.memory) >> 20, disk_size_mb=limits.disk >> 20,
                state=SandboxState.PAUSED if sb.ws is None else SandboxState.RUNNING,
                envd_version=ENVD_VERSION, metadata=dict(sb.metadata))


def _int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ServeError(f"{key} must be an integer from {lo} to {hi}, got {value!r}", 400)
    return value


def _str_map(body: dict, key: str) -> dict[str, str]:
    value = body.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ServeError(f"{key} must be an object of strings", 400)
    return dict(value)


def router(service) -> APIRouter:
    """The routes, for a :class:`~bunshin_gym.serve.app.Service`."""
    r = APIRouter()
    registry = service.registry
    auth = Depends(service.principal)

    def _get(sb_id: str, who: Principal) -> Sandbox:
        return registry.get(sb_id, who, kind=Sandbox)

    def _new_sandbox(who: Principal, template: str, timeout: int, metadata: dict, env_vars: dict,
                     auto_pause: bool, ws: Workspace, memory: int) -> Sandbox:
        sb = Sandbox(id=f"i{secrets.token_hex(10)}", owner=who, end_at=time.time() + timeout,
                     idle_timeout=service.config.idle_timeout, workspaces=1, memory=memory,
                     template=template, ws=ws, metadata=metadata, env_vars=env_vars, auto_pause=auto_pause,
                     timeout=timeout, memory_limit=memory)
        return registry.add(sb)

    def _create(who: Principal, body: dict) -> Sandbox:
        template = body.get("templateID") or "base"
        if not isinstance(template, str):
            raise ServeError("templateID must be a string", 400)
        timeout = _int(body, "timeout", DEFAULT_TIMEOUT, 1, service.config.max_timeout)
        metadata, env_vars = _str_map(body, "metadata"), _str_map(body, "envVars")
        snapshot = service.named_snapshot(template, who)
        limits = Limits.parse(service.config.limits)
        registry.reserve(who, 1, limits.memory)
        try:
            if snapshot is not None:
                ws = snapshot.fork(1, detached=True)[0]
            else:
                ws = Workspace.create(template, detached=True, limits=limits, memory_mode=service.config.memory_mode)
        except UnknownImage as e:
            registry.unreserve(who, 1, limits.memory)
            raise NotFound(f"unknown template {template!r}: {e}") from None
        except BaseException:
            registry.unreserve(who, 1, limits.memory)
            raise
        try:
            return _new_sandbox(who, template, timeout, metadata, env_vars, bool(body.get("autoPause")), ws,
                                limits.memory)
        except BaseException:
            ws.close()
            registry.unreserve(who, 1, limits.memory)
            raise

    @r.post("/sandboxes", status_code=201)
    @r.post("/v2/sandboxes", status_code=201)
    async def create(request: Request, who: Principal = auth) -> JSONResponse:
        body = await json_object(request)
        sb = await asyncio.to_thread(_create, who, body)
        log.info("sandbox %s (%s) created for %s: workspace %s", sb.id, sb.template, who.name, sb.ws.id)
        return JSONResponse(created_model(sb, service.config.domain), status_code=201)

    def _listed(who: Principal, request: Request) -> list[dict]:
        states = {s for s in (request.query_params.get("state") or "").split(",") if s}
        wanted_meta = {}
        for pair in filter(None, (request.query_params.get("metadata") or "").split("&")):
            k, _, v = pair.partition("=")
            wanted_meta[unquote(k)] = unquote(v)
        out = []
        for sb in sorted(registry.list(who, kind=Sandbox), key=lambda s: s.created):
            if states and sb.state not in states:
                continue
            if any(sb.metadata.get(k) != v for k, v in wanted_meta.items()):
                continue
            template = request.query_params.get("template")
            if template and sb.template != template:
                continue
            out.append(ListedSandbox(**_common(sb)).to_dict())
        if request.query_params.get("order") == "desc":
            out.reverse()
        return out

    @r.get("/sandboxes")
    @r.get("/v2/sandboxes")
    async def list_sandboxes(request: Request, who: Principal = auth) -> JSONResponse:
        return JSONResponse(_listed(who, request))

    @r.get("/sandboxes/{sb_id}")
    async def detail(sb_id: str, who: Principal = auth) -> JSONResponse:
        sb = _get(sb_id, who)
        return JSONResponse(SandboxDetail(**_common(sb), envd_access_token=sb.envd_token).to_dict())

    @r.delete("/sandboxes/{sb_id}", status_code=204)
    async def kill(sb_id: str, who: Principal = auth) -> Response:
        _get(sb_id, who)
        await asyncio.to_thread(registry.close, sb_id, why="killed by its owner")
        return Response(status_code=204)

    @r.post("/sandboxes/{sb_id}/timeout", status_code=204)
    async def set_timeout(sb_id: str, request: Request, who: Principal = auth) -> Response:
        sb = _get(sb_id, who)
        timeout = _int(await json_object(request), "timeout", None, 0, service.config.max_timeout)
        if timeout is None:
            raise ServeError("timeout is required", 400)
        sb.timeout = timeout
        if sb.ws is not None:
            sb.end_at = time.time() + timeout
        service.save()
        return Response(status_code=204)

    @r.post("/sandboxes/{sb_id}/refreshes", status_code=204)
    async def refresh(sb_id: str, request: Request, who: Principal = auth) -> Response:
        sb = _get(sb_id, who)
        duration = _int(await json_object(request), "duration", None, 0, service.config.max_timeout)
        if sb.ws is not None and sb.end_at is not None:
            sb.end_at = max(sb.end_at, time.time() + (duration or sb.timeout))
        return Response(status_code=204)

    @r.post("/sandboxes/{sb_id}/pause", status_code=204)
    async def pause_route(sb_id: str, who: Principal = auth) -> Response:
        sb = _get(sb_id, who)
        if sb.ws is None:
            return JSONResponse(Error(code=409, message=f"sandbox {sb_id} is already paused").to_dict(),
                                status_code=409)
        await asyncio.to_thread(pause, sb, registry)
        log.info("sandbox %s paused", sb_id)
        return Response(status_code=204)

    async def _resume(sb_id: str, request: Request, who: Principal) -> JSONResponse:
        sb = _get(sb_id, who)
        body = await json_object(request)
        if body.get("memory") is False:
            raise ServeError("resume without memory (on_resume='reboot') is not supported: "
                             "bunshin resumes from the memory snapshot", 400)
        timeout = _int(body, "timeout", sb.timeout, 1, service.config.max_timeout)
        was_paused = sb.ws is None
        if was_paused:
            await asyncio.to_thread(resume, sb, registry, timeout)
            log.info("sandbox %s resumed: workspace %s", sb_id, sb.ws.id)
        elif sb.end_at is not None:
            sb.end_at = max(sb.end_at, time.time() + timeout)  # E2B: only ever extended
        return JSONResponse(created_model(sb, service.config.domain), status_code=201 if was_paused else 200)

    @r.post("/sandboxes/{sb_id}/resume", status_code=201)
    async def resume_route(sb_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        return await _resume(sb_id, request, who)

    @r.post("/sandboxes/{sb_id}/connect")
    @r.post("/v2/sandboxes/{sb_id}/connect")
    async def connect(sb_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        return await _resume(sb_id, request, who)

    def _fork(sb: Sandbox, count: int, timeout: int) -> list[dict]:
        who = sb.owner
        memory = sb.memory_limit
        registry.reserve(who, count, count * memory)
        results: list[dict] = []
        made = 0
        try:
            with sb.lock:
                ws = sb.workspace()
                snap = ws.snapshot(tags={"e2b_sandbox": sb.id, "fork": count})  # one freeze for all copies
            try:
                try:
                    clones = snap.fork(count, detached=True)
                    outcomes: list[Any] = list(clones)
                except WorkspaceError:
                    # all at once failed: one at a time, so each copy gets its own result
                    outcomes = []
                    for _ in range(count):
                        try:
                            outcomes.append(snap.fork(1, detached=True)[0])
                        except WorkspaceError as e:
                            outcomes.append(e)
            finally:
                snap.release()  # deleted once the last clone is closed
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    error = Error(code=500, message=f"fork failed: {outcome}")
                    results.append(SandboxForkResult(error=error).to_dict())
                    continue
                made += 1
                clone = _new_sandbox(who, sb.template, timeout, dict(sb.metadata), dict(sb.env_vars),
                                     sb.auto_pause, outcome, memory)
                clone.commands = {pid: type(c)(**vars(c)) for pid, c in sb.commands.items()}
                results.append({"sandbox": created_model(clone, service.config.domain)})
        finally:
            registry.unreserve(who, count - made, (count - made) * memory)
        return results

    @r.post("/sandboxes/{sb_id}/fork", status_code=201)
    async def fork(sb_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        sb = _get(sb_id, who)
        body = await json_object(request)
        count = _int(body, "count", 1, 1, MAX_FORK)
        timeout = _int(body, "timeout", sb.timeout, 1, service.config.max_timeout)
        results = await asyncio.to_thread(_fork, sb, count, timeout)
        log.info("sandbox %s forked into %d (%d failed)", sb_id, count, sum("error" in x for x in results))
        return JSONResponse(results, status_code=201)

    @r.post("/sandboxes/{sb_id}/snapshots", status_code=201)
    async def create_snapshot(sb_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        sb = _get(sb_id, who)
        body = await json_object(request)
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or not name or "/" in name or len(name) > 128):
            raise ServeError("name must be a non-empty string without '/', at most 128 characters", 400)

        def take():
            with sb.lock:
                return sb.workspace().snapshot(tags={"e2b_sandbox": sb.id, "name": name})

        snap = await asyncio.to_thread(take)
        snapshot_id = service.add_snapshot(name or snap.id, snap.id, who)
        return JSONResponse(SnapshotInfo(snapshot_id=snapshot_id, names=[snapshot_id]).to_dict(), status_code=201)

    @r.get("/snapshots")
    async def list_snapshots(who: Principal = auth) -> JSONResponse:
        return JSONResponse([SnapshotInfo(snapshot_id=n, names=[n]).to_dict()
                             for n in service.snapshot_names(who)])

    @r.delete("/templates/{name:path}", status_code=204)
    async def delete_snapshot(name: str, who: Principal = auth) -> Response:
        await asyncio.to_thread(service.delete_snapshot, name, who)
        return Response(status_code=204)

    @r.get("/sandboxes/{sb_id}/metrics")
    async def metrics(sb_id: str, who: Principal = auth) -> JSONResponse:
        sb = _get(sb_id, who)
        if sb.ws is None:
            return JSONResponse([])

        def read() -> dict:
            with sb.lock:
                used = sb.workspace().memory().cgroup
            now = time.time()
            limits = Limits.from_env()
            return SandboxMetric(timestamp=_utc(now), timestamp_unix=int(now), cpu_count=1, cpu_used_pct=0.0,
                                 mem_used=int(used), mem_total=sb.memory_limit or limits.memory, mem_cache=0,
                                 disk_used=0, disk_total=limits.disk).to_dict()

        return JSONResponse([await asyncio.to_thread(read)])

    return r

