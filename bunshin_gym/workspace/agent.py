"""The in-workspace agent: executes commands and file operations inside a workspace.

This file runs in two places. Inside a workspace it is ``/.bunshin/agent.py``, started by
the workspace's PID 1 with the image's own ``python3`` (standard library only, no
bunshin_gym import). On the host, :mod:`bunshin_gym.workspace.client` imports its framing
functions, so both sides speak one protocol.

Protocol, over the unix socket ``/run/bunshin/agent.sock``: a message is a 4-byte
big-endian header length, a JSON header, then the binary blobs whose lengths the header
lists under ``"_blobs"``. Every request gets exactly one reply; a reply with ``"error"``
reports a failure of the request, never of the agent. The controller may drop its
connection at any time (it must, before a CRIU dump) and connect again later.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

SOCKET_PATH = "/run/bunshin/agent.sock"
MAX_HEADER = 1 << 20
_LEN = struct.Struct("!I")


class ProtocolError(Exception):
    """The peer sent something that is not a message, or closed mid-message."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("connection closed")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, header: dict, blobs: list[bytes] = ()) -> None:
    header = dict(header, _blobs=[len(b) for b in blobs])
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for blob in blobs:
        sock.sendall(blob)


def recv_msg(sock: socket.socket) -> tuple[dict, list[bytes]]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ProtocolError(f"header of {n} bytes")
    header = json.loads(_recv_exact(sock, n))
    blobs = [_recv_exact(sock, size) for size in header.pop("_blobs", [])]
    return header, blobs


BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}


def _user_env(user: str | None) -> tuple[dict, str]:
    if user is None:
        return dict(BASE_ENV, HOME="/root", USER="root"), "/root"
    pw = pwd.getpwnam(user)
    return dict(BASE_ENV, HOME=pw.pw_dir, USER=user, LOGNAME=user), pw.pw_dir


def _popen_args(req: dict) -> dict:
    argv = req.get("argv")
    if argv is None:
        argv = ["/bin/sh", "-c", req["cmd"]]
    user = req.get("user")
    env, home = _user_env(user)
    env.update(req.get("env") or {})
    return dict(
        args=argv,
        cwd=req.get("cwd") or home,
        env=env,
        user=user,
        group=pwd.getpwnam(user).pw_gid if user else None,
        start_new_session=True,
    )


def op_exec(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    """Run a command to completion; a timeout kills that command's process group only."""
    stdin = blobs[0] if blobs else None
    start = time.monotonic()
    proc = subprocess.Popen(
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **_popen_args(req),
    )
    timed_out = False
    try:
        out, err = proc.communicate(stdin, timeout=req.get("timeout"))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            # a process that left the group still holds the pipes: give up on the rest
            proc.stdout.close()
            proc.stderr.close()
            out, err = b"", b""
            proc.wait()
    return {
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "duration": time.monotonic() - start,
    }, [out, err]


def op_spawn(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    """Start a long-running process (a service, an app) without waiting for it."""
    log = req.get("log") or "/dev/null"
    with open(log, "ab") as out:
        proc = subprocess.Popen(stdin=subprocess.DEVNULL, stdout=out, stderr=out, **_popen_args(req))
    _children.add(proc)
    return {"pid": proc.pid}, []


def op_read_file(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    with open(req["path"], "rb") as f:
        return {}, [f.read()]


def op_write_file(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    path = req["path"]
    if req.get("mkdirs"):
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req.get("mode", 0o644))
    with os.fdopen(fd, "wb") as f:
        f.write(blobs[0])
    if req.get("owner"):
        pw = pwd.getpwnam(req["owner"])
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return {}, []


def op_ping(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    return {"pid": os.getpid(), "time": time.time()}, []


OPS = {
    "exec": op_exec,
    "spawn": op_spawn,
    "read_file": op_read_file,
    "write_file": op_write_file,
    "ping": op_ping,
}

_children: set[subprocess.Popen] = set()


def _reap_spawned() -> None:
    """Spawned services are our children: reap them so they never linger as zombies."""
    while True:
        time.sleep(0.5)
        for proc in list(_children):
            if proc.poll() is not None:
                _children.discard(proc)


def serve_unix(path: str, handle, *, mode: int = 0o600, backlog: int = 4, name: str = "server") -> None:
    """Serve one connection at a time on a unix socket, each request answered by
    ``handle(req, blobs) -> (reply, blobs)``: the loop of the env daemons (the desktop server,
    the web driver) that import this file's framing from ``/.bunshin``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    srv.bind(path)  # bound at its final name: CRIU re-binds a restored socket at the name it was bound to
    os.chmod(path, mode)
    srv.listen(backlog)
    print(f"{name} {os.getpid()} on {path}", file=sys.stderr, flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                try:
                    req, blobs = recv_msg(conn)
                except (ProtocolError, OSError, ValueError):
                    break
                reply, out = handle(req, blobs)
                try:
                    send_msg(conn, reply, out)
                except OSError:
                    break


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            try:
                req, blobs = recv_msg(self.request)
            except (ProtocolError, ConnectionError, ValueError):
                return
            op = OPS.get(req.get("op"))
            try:
                if op is None:
                    raise ValueError(f"unknown operation {req.get('op')!r}")
                reply, out = op(req, blobs)
            except Exception as e:  # noqa: BLE001 - every failure is reported to the caller
                reply, out = {"error": f"{type(e).__name__}: {e}", "errno": getattr(e, "errno", None)}, []
            try:
                send_msg(self.request, reply, out)
            except OSError:
                return


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main() -> None:
    try:
        os.unlink(SOCKET_PATH)
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(SOCKET_PATH), exist_ok=True)
    server = Server(SOCKET_PATH, Handler)
    os.chmod(SOCKET_PATH, 0o600)
    threading.Thread(target=_reap_spawned, daemon=True).start()
    print(f"bunshin-agent {os.getpid()} listening on {SOCKET_PATH}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
