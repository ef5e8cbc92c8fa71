"""The env channel: one WebSocket per env handle for its hot calls (``reset``, ``step``,
``rollback``), on the server's own port, with the HTTP API's auth.

An HTTP request through FastAPI costs ~1.7-2.5 ms on this host (routing, middleware, the
request and response objects) where a WebSocket message costs ~0.25 ms: a desktop step is
~4 ms, so that difference is most of what the server adds to it. Everything else (making,
cloning, snapshots, closing, keepalives) stays HTTP, and so does every hot call of a client
that does not open a channel.

``GET /envs/{env_id}/channel`` upgrades with the same bearer token as the HTTP API; a bad
token is refused with 401, an env the token does not own (or none) with 404, both as JSON
like the HTTP errors. Then, on the open channel:

- a request is a text message, a JSON object: the HTTP body of the same call plus its name,
  ``{"op": "step", "action": ..., "frames": {...}}``;
- an answer is a binary message: ``>dd`` (the seconds the server spent on the request, from
  its receipt to its answer, and the seconds encoding took: what a client profiles), then the
  answer's frame (:mod:`bunshin_gym.serve.codec`, the HTTP answer's bytes);
- an error is a text message ``{"status": N, "message": ..., "error": name?}`` (the HTTP
  status and message of the same error); the channel stays open.

Requests are served one at a time, in order. A channel does not hold its env: closing it
leaves the env as it is, and the env's idle timeout still counts (each request touches it).
A channel without a request for the env's idle timeout is closed (a client gone without a
word leaves no connection behind; the server sends no pings).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from bunshin_gym.errors import BunshinError, ResetNeeded, TaskError
from bunshin_gym.serve import codec
from bunshin_gym.serve.auth import token_from_headers
from bunshin_gym.serve.codec import CHANNEL_TIMING
from bunshin_gym.serve.envs_api import HOT_CALLS, EnvLease, run_hot
from bunshin_gym.serve.registry import ServeError
from bunshin_gym.workspace import WorkspaceError

log = logging.getLogger(__name__)


def error_of(e: BaseException) -> dict:
    """The status and message the HTTP API answers the same error with (see ``app.py``)."""
    if isinstance(e, ServeError):
        return {"status": e.status, "message": str(e)}
    if isinstance(e, ResetNeeded):
        return {"status": 409, "message": str(e), "error": "ResetNeeded"}
    if isinstance(e, TaskError):
        return {"status": 400, "message": f"bad task: {e}"}
    if isinstance(e, (WorkspaceError, BunshinError)):
        return {"status": 500, "message": f"{type(e).__name__}: {e}"}
    log.error("env channel: a request failed", exc_info=e)
    return {"status": 500, "message": f"{type(e).__name__}: {e}"}


def router(service) -> APIRouter:
    r = APIRouter()
    registry = service.registry

    @r.websocket("/envs/{env_id}/channel")
    async def channel(websocket: WebSocket, env_id: str) -> None:
        who = service.tokens.authenticate(token_from_headers(websocket.headers))
        if who is None:
            await websocket.send_denial_response(JSONResponse(
                {"code": 401, "message": "missing or unknown API key (send X-API-KEY or Authorization: Bearer)"},
                status_code=401))
            return
        try:
            lease = registry.get(env_id, who, kind=EnvLease)
        except ServeError as e:
            await websocket.send_denial_response(JSONResponse({"code": e.status, "message": str(e)},
                                                              status_code=e.status))
            return
        await websocket.accept()
        idle = lease.idle_timeout or None
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):
                        message = await websocket.receive()
                except TimeoutError:
                    log.info("env channel of %s: no request for %.0f s, closed", env_id, idle)
                    await websocket.close(1001)
                    return
                if message["type"] == "websocket.disconnect":
                    return
                t0 = time.perf_counter()
                try:
                    data, encode_s = await _serve(registry, env_id, who, message)
                except Exception as e:  # noqa: BLE001 - answered; the channel goes on
                    await websocket.send_text(json.dumps(error_of(e)))
                    continue
                await websocket.send_bytes(CHANNEL_TIMING.pack(time.perf_counter() - t0, encode_s) + data)
        except WebSocketDisconnect:
            return

    return r


async def _serve(registry, env_id: str, who, message: dict) -> tuple[bytes, float]:
    raw = message.get("text")
    if raw is None:
        raw = message.get("bytes") or b""
    lease, work = parse_request(registry, env_id, who, raw)
    return await run_hot(lease, work)


def parse_request(registry, env_id: str, who, raw: str | bytes | bytearray
                  ) -> tuple[EnvLease, Callable[[], tuple[bytes, float]]]:
    """A channel's request (a JSON object naming its ``op``): the env's lease (touched; 404
    once closed) and the work that answers it, to run on the env's thread. Shared with the
    local channel (:mod:`bunshin_gym.serve.local_channel`)."""
    try:
        body = codec.loads(raw)
    except ValueError as e:
        raise ServeError(f"a request must be a JSON object: {e}", 400) from None
    if not isinstance(body, dict):
        raise ServeError("a request must be a JSON object", 400)
    op = body.pop("op", None)
    make = HOT_CALLS.get(op) if isinstance(op, str) else None
    if make is None:
        raise ServeError(f"op must be one of {sorted(HOT_CALLS)}, got {op!r}", 400)
    lease = registry.get(env_id, who, kind=EnvLease)  # touches it; 404 once closed
    return lease, make(lease, body)
