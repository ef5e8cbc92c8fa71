"""Ports inside a sandbox, reached through the server (E2B's ``sandbox.get_host(port)``).

E2B addresses a sandbox's port by host name: ``PORT-SANDBOXID.DOMAIN``. The server answers
any request whose ``Host`` has that form (whatever the domain: a wildcard DNS record, a
browser's ``*.localhost``, or a client that sends the ``Host`` header to the server's own
address) by forwarding it to ``127.0.0.1:PORT`` inside that sandbox.

Every such request must carry the sandbox's traffic access token
(``e2b-traffic-access-token``, :attr:`e2b.Sandbox.traffic_access_token`) or its envd access
token (``X-Access-Token``): bunshin never serves a sandbox's ports to the public.

How it is forwarded: by a small ``bash`` client (``/dev/tcp``) started inside the workspace
for each request, detached (the agent serves one request at a time: a slow port must not
hold up the sandbox's other requests), which sends the request with ``Connection: close``
and keeps the answer in a file that the server reads once the client is done and parses
with ``h11``. Bodies are bounded both ways (:data:`MAX_BODY`) and a request takes at most
:data:`TIMEOUT` seconds. The agent has no socket relay (it serves one request and answers
with all of it), so streaming responses and WebSockets are not forwarded.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from dataclasses import dataclass

import h11
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bunshin_gym.serve.registry import Registry, ServeError
from bunshin_gym.serve.sandbox import DEFAULT_USER, Sandbox, read_optional
from bunshin_gym.workspace import WorkspaceError

log = logging.getLogger(__name__)

#: ``PORT-SANDBOXID.`` at the start of a Host header
HOST_RE = re.compile(r"^(\d{1,5})-([A-Za-z0-9]{1,64})\.")
#: envd's own port: a host naming it is the sandbox's envd, served by the routes as usual
ENVD_PORT = 49983
#: the largest request or response body forwarded, and the longest a request may take
MAX_BODY = 16 << 20
TIMEOUT = 60.0
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"

#: headers that belong to one connection (RFC 9110 7.6.1) or to our authentication
_DROPPED = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
            "host", "content-length", "x-access-token", TRAFFIC_TOKEN_HEADER, "e2b-sandbox-id"}

#: connects to the port inside the workspace (bash's /dev/tcp: a bash starts in a few ms, a
#: python3 in tens), sends stdin, copies at most LIMIT bytes of the answer; exit 3: nothing listens
FORWARDER = r"""
{ exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || { exec 3<>"/dev/tcp/::1/$1"; } 2>/dev/null || {
  echo "connection refused" >&2; exit 3; }
cat >&3
head -c "$2" <&3
"""
#: what the forwarder copies at most: the body limit and room for the status line and headers
_ANSWER_LIMIT = MAX_BODY + (1 << 20)

#: runs the forwarder detached, from BASE.req to BASE.ans and BASE.err, bounded by `timeout`,
#: and writes its status to BASE.st last (through a rename: never seen half written)
RUNNER = r"""
b=$1
timeout -s KILL "$4" bash -c "$5" forward "$2" "$3" < "$b.req" > "$b.ans" 2> "$b.err"
echo $? > "$b.st.tmp" && mv "$b.st.tmp" "$b.st"
"""
#: polling of a forwarded request's status: first interval, growth, cap (seconds)
POLL_FIRST, POLL_GROWTH, POLL_MAX = 0.002, 1.5, 0.1


@dataclass
class Exchange:
    """What the forwarder left: its exit status, the answer, its errors."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False


def target_of(host: str | None) -> tuple[int, str] | None:
    """(port, sandbox id) when ``host`` names a sandbox's port other than envd's."""
    m = HOST_RE.match(host or "")
    if m is None or int(m.group(1)) == ENVD_PORT:
        return None
    return int(m.group(1)), m.group(2)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


async def proxy(registry: Registry, scope: dict, receive, send, port: int, sb_id: str) -> None:
    """Answer one request for ``port`` of sandbox ``sb_id`` (an ASGI call)."""
    request = Request(scope, receive)
    try:
        response = await _forward(registry, request, port, sb_id)
    except ServeError as e:
        response = _error(e.status, str(e))
    except WorkspaceError as e:
        response = _error(502, f"the sandbox failed: {e}")
    await response(scope, receive, send)


async def _forward(registry: Registry, request: Request, port: int, sb_id: str) -> Response:
    if not 1 <= port <= 65535:
        raise ServeError(f"port {port} is not a TCP port", 400)
    sb = registry.get(sb_id, kind=Sandbox)
    traffic = request.headers.get(TRAFFIC_TOKEN_HEADER) or ""
    envd = request.headers.get("x-access-token") or ""
    if not (hmac.compare_digest(traffic.encode(), sb.traffic_token.encode())
            or hmac.compare_digest(envd.encode(), sb.envd_token.encode())):
        raise ServeError(f"sandbox {sb_id}: a port needs the sandbox's {TRAFFIC_TOKEN_HEADER} "
                         "(or its X-Access-Token)", 401)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise ServeError(f"the request body is {length} bytes, over the limit of {MAX_BODY}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ServeError(f"the request body is over the limit of {MAX_BODY} bytes", 413)
    raw = _request_bytes(request, port, bytes(body))
    res = await asyncio.to_thread(_exchange, sb, port, raw)
    sb.touch()
    return _response(res, request.method, port, sb_id)


def _request_bytes(request: Request, port: int, body: bytes) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [("Host", f"localhost:{port}"), ("Connection", "close"), ("Content-Length", str(len(body)))]
    headers += [(k, v) for k, v in request.headers.items() if k.lower() not in _DROPPED]
    try:
        head = conn.send(h11.Request(method=request.method, target=target, headers=headers))
    except h11.LocalProtocolError as e:
        raise ServeError(f"the request cannot be forwarded: {e}", 400) from None
    return head + (conn.send(h11.Data(data=body)) if body else b"") + conn.send(h11.EndOfMessage())


def _exchange(sb: Sandbox, port: int, raw: bytes) -> Exchange:
    """Send ``raw`` to the port and get its answer. The forwarder runs detached and the
    server polls for its status: the workspace's agent serves one request at a time, and a
    port that answers slowly must not hold up the sandbox's commands and files meanwhile."""
    base = f"/tmp/.bunshin-port-{secrets.token_hex(8)}"
    with sb.lock:
        ws = sb.workspace()
        ws.write_file(f"{base}.req", raw, owner=DEFAULT_USER, mkdirs=False)
        ws.spawn(["/bin/bash", "-c", RUNNER, "bunshin-port", base, str(port), str(_ANSWER_LIMIT + 1),
                  str(int(TIMEOUT)), FORWARDER], user=DEFAULT_USER)
    try:
        deadline, delay = time.monotonic() + TIMEOUT + 10, POLL_FIRST
        while True:
            with sb.lock:
                status = read_optional(sb.workspace(), f"{base}.st")
            if status is not None:
                break
            if time.monotonic() > deadline:  # `timeout` should have ended it already
                return Exchange(-1, timed_out=True)
            time.sleep(delay)
            delay = min(delay * POLL_GROWTH, POLL_MAX)
        code = int(status.strip() or b"-1")
        with sb.lock:
            ws = sb.workspace()
            return Exchange(code, ws.read_file(f"{base}.ans"), ws.read_file(f"{base}.err"), timed_out=code == 137)
    finally:
        try:
            with sb.lock:
                sb.workspace().exec(["/bin/sh", "-c", 'rm -f "$1.req" "$1.ans" "$1.err" "$1.st"', "sh", base],
                                    user=DEFAULT_USER, timeout=10)
        except Exception as e:  # noqa: BLE001 - the sandbox may be gone; its files went with it
            log.debug("cleaning up a forwarded request in %s: %s", sb.id, e)


def _response(res: Exchange, method: str, port: int, sb_id: str) -> Response:
    if res.timed_out:
        raise ServeError(f"port {port} of sandbox {sb_id} did not answer within {TIMEOUT:g} s", 504)
    if res.exit_code == 3:
        raise ServeError(f"nothing listens on port {port} in sandbox {sb_id}: "
                         f"{res.stderr.decode(errors='replace')[-300:]}", 502)
    if len(res.stdout) > _ANSWER_LIMIT:
        raise ServeError(f"the answer of port {port} is over the limit of {MAX_BODY} bytes", 502)
    if res.exit_code != 0:
        raise ServeError(f"forwarding to port {port} failed: {res.stderr.decode(errors='replace')[-500:]}", 502)
    conn = h11.Connection(h11.CLIENT)
    # h11 parses a response only after the request it answers
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(res.stdout)
    conn.receive_data(b"")
    head, body = None, bytearray()
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed) or event is h11.NEED_DATA:
                break
    except h11.RemoteProtocolError as e:
        raise ServeError(f"port {port} did not answer in HTTP/1: {e}", 502) from None
    if head is None:
        raise ServeError(f"port {port} closed the connection without an answer", 502)
    if len(body) > MAX_BODY:
        raise ServeError(f"the answer of port {port} is over the limit of {MAX_BODY} bytes", 502)
    response = Response(content=bytes(body), status_code=head.status_code)
    # as they came, repeated ones (Set-Cookie) too; Starlette set the length
    response.raw_headers += [(k.lower(), v) for k, v in head.headers if k.decode().lower() not in _DROPPED]
    return response
