"""The in-workspace agent: executes commands and file operations inside a workspace.

It runs inside a workspace only, as ``/.bunshin/agent.py``, started by the workspace's
PID 1 with the image's own ``python3`` (standard library only, no bunshin_gym import). Its
framing is ``/.bunshin/protocol.py`` (:mod:`bunshin_gym.workspace.protocol`, shipped next to
it in the runtime layer), the same module the controller's
:mod:`bunshin_gym.workspace.client` uses, so both sides speak one protocol.

Protocol, over the unix socket ``/run/bunshin/agent.sock``: a message is a 4-byte
big-endian header length, a JSON header, then the binary blobs whose lengths the header
lists under ``"_blobs"``. Every request gets exactly one reply; a reply with ``"error"``
reports a failure of the request, never of the agent. The controller may drop its
connection at any time (it must, before a CRIU dump) and connect again later.

Replies are bounded: a command's output streams are cut to ``max_output`` bytes each (head
and tail, with a ``[... output cut: N bytes not shown ...]`` marker), and files are read or
written only when regular (a FIFO, device or socket is refused) and read up to ``max_bytes``.
"""

from __future__ import annotations

import errno
import os
import pwd
import queue
import selectors
import signal
import socketserver
import stat
import struct
import subprocess
import sys
import threading
import time

# inside a workspace this file is /.bunshin/agent.py and protocol.py lies next to it
from protocol import AGENT_SOCKET, ProtocolError, recv_msg, send_msg

SOCKET_PATH = AGENT_SOCKET
#: the controller is the only peer and is trusted: its requests (file writes) may be large
MAX_REQUEST = 1 << 30
#: defaults when a request names no cap (the controller always does)
DEFAULT_MAX_OUTPUT = 1 << 20
DEFAULT_MAX_READ = 64 << 20
CHUNK = 1 << 16


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


#: the workspace's init, whose ``runas`` mode starts a command as a user (native/bunshin-init.c)
INIT = "/.bunshin/init"


def _start(req: dict, **streams) -> subprocess.Popen:
    """Start a request's command (``argv``, else ``cmd`` under ``/bin/sh -c``) in a session
    of its own, as its ``user`` (default root), in its ``cwd`` (default that user's home).

    A user's command is started through ``/.bunshin/init runas``: Popen(user=) cannot use
    vfork, so it would fork this whole interpreter (about 0.9 ms, most of a short command's
    cost), while this way Popen vforks and the small static helper sets the ids and execs the
    command in the same process. The command sees what Popen(user=, group=) gives it: the
    same pid, session, ids and supplementary groups; a failure to switch ids or to exec is
    raised here as the same OSError."""
    argv = req.get("argv")
    if argv is None:
        argv = ["/bin/sh", "-c", req["cmd"]]
    user = req.get("user")
    env, home = _user_env(user)
    env.update(req.get("env") or {})
    cwd = req.get("cwd") or home
    if user is None:
        return subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, **streams)
    pw = pwd.getpwnam(user)
    report_r, report_w = os.pipe()
    try:
        proc = subprocess.Popen([INIT, "runas", str(pw.pw_uid), str(pw.pw_gid), str(report_w), *argv],
                                cwd=cwd, env=env, start_new_session=True, pass_fds=(report_w,), **streams)
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    with os.fdopen(report_r, "rb") as f:
        report = f.read(8)  # EOF once the command runs: the helper's end is close-on-exec
    if report:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()
        code, stage = struct.unpack("=ii", report.ljust(8, b"\0"))
        raise OSError(code, os.strerror(code), *([argv[0]] if stage else []))
    return proc


class CappedStream:
    """One output stream kept within ``cap`` bytes: its head and its tail, and a count of what
    was cut between them (shown as a marker), so a command printing 800 MB costs ``cap``."""

    def __init__(self, cap: int):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.cut = 0

    def add(self, data: bytes) -> None:
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        over = len(self.tail) - self.tail_cap
        if over > 0:
            del self.tail[:over]
            self.cut += over

    def value(self) -> bytes:
        if not self.cut:
            return bytes(self.head + self.tail)
        return bytes(self.head) + f"\n[... output cut: {self.cut} bytes not shown ...]\n".encode() + bytes(self.tail)


def _collect(proc: subprocess.Popen, stdin: bytes | None, timeout: float | None,
             cap: int) -> tuple[bytes, bytes, bool]:
    """Feed stdin, read both streams into :class:`CappedStream` until they close; on the
    deadline kill the command's process group and drain for 2 s more."""
    streams = {proc.stdout: CappedStream(cap), proc.stderr: CappedStream(cap)}
    sel = selectors.DefaultSelector()
    for pipe in streams:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    pending = memoryview(stdin) if stdin else None
    if proc.stdin is not None:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    try:
        while sel.get_map():
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                if timed_out:
                    break  # a process that left the group still holds the pipes: give up on the rest
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + 2
                continue
            for key, _ in sel.select(wait):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        n = os.write(f.fileno(), pending[:CHUNK])
                        pending = pending[n:]
                    except BrokenPipeError:
                        pending = None
                    if not pending:
                        sel.unregister(f)
                        f.close()
                    continue
                data = os.read(f.fileno(), CHUNK)
                if data:
                    streams[f].add(data)
                else:
                    sel.unregister(f)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()
    proc.wait()
    out, err = streams.values()
    return out.value(), err.value(), timed_out


def op_exec(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    """Run a command to completion; a timeout kills that command's process group only. Each
    output stream is cut to ``max_output`` bytes (head and tail kept, a marker between)."""
    stdin = blobs[0] if blobs else None
    start = time.monotonic()
    proc = _start(req, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err, timed_out = _collect(proc, stdin, req.get("timeout"), int(req.get("max_output") or DEFAULT_MAX_OUTPUT))
    return {
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "duration": time.monotonic() - start,
    }, [out, err]


def op_spawn(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    """Start a long-running process (a service, an app) without waiting for it."""
    log = req.get("log") or "/dev/null"
    # O_NONBLOCK: opening a FIFO planted at the log's name must not block this thread
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):  # /dev/null is the default log
            raise OSError(errno.EINVAL, f"refused: the log {log} is not a regular file", log)
        os.set_blocking(fd, True)  # the flag is the open file's: the program must get blocking writes
        proc = _start(req, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd)
    finally:
        os.close(fd)
    _children.add(proc)
    return {"pid": proc.pid}, []


def _refuse_special(fd: int, path: str) -> os.stat_result:
    """Only regular files are read or written: a FIFO would block for ever, a device or a
    socket has no end (the descriptor was opened O_NONBLOCK, so opening did not block)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
        raise OSError(code, f"refused: {path} is {kind}, not a regular file", path)
    return st


def op_read_file(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    """A regular file's bytes, at most ``max_bytes`` (a larger file, sparse or not, is refused
    without reading; a file that grows while read is refused too)."""
    path = req["path"]
    cap = int(req.get("max_bytes") or DEFAULT_MAX_READ)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    st = _refuse_special(fd, path)
    try:
        if st.st_size > cap:
            raise OSError(errno.EFBIG, f"refused: {path} is {st.st_size} bytes, over the cap of {cap} bytes", path)
        # /proc files report size 0, and a file may grow while read: the read itself is bounded
        # (the first read asks for the whole file; procfs refuses one read of the whole cap)
        data = bytearray()
        step = max(st.st_size + 1, 4096)
        while chunk := os.read(fd, min(step, cap + 1 - len(data))):
            data += chunk
            step = CHUNK
            if len(data) > cap:
                raise OSError(errno.EFBIG, f"refused: {path} is over the cap of {cap} bytes", path)
    finally:
        os.close(fd)
    return {}, [bytes(data)]


def op_write_file(req: dict, blobs: list[bytes]) -> tuple[dict, list[bytes]]:
    path = req["path"]
    if req.get("mkdirs"):
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, req.get("mode", 0o644))
    _refuse_special(fd, path)
    try:
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        if req.get("owner"):  # the file written, not whatever the name points to by then
            pw = pwd.getpwnam(req["owner"])
            os.fchown(fd, pw.pw_uid, pw.pw_gid)
        view = memoryview(blobs[0])
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
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


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            try:
                req, blobs = recv_msg(self.request, max_blobs=MAX_REQUEST)
            except (ProtocolError, OSError, ValueError):
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


class Server(socketserver.UnixStreamServer):
    """Serves each connection on a thread, keeping the threads for later connections.

    A thread is a task of the workspace and takes a pid there. A thread per connection (as
    ``socketserver.ThreadingMixIn`` makes) showed every reconnect of the controller in the pids
    the workspace's programs get next: the controller drops its connection before each
    snapshot and connects again after, so a snapshot made the next process's pid one higher
    than without it. A connection now takes an idle thread, and a new one (daemon: a
    connection left open never holds the agent's exit) only when none is idle.
    """

    def __init__(self, address: str, handler):
        super().__init__(address, handler)
        self._lock = threading.Lock()
        self._idle = 0
        self._connections: queue.SimpleQueue = queue.SimpleQueue()

    def process_request(self, request, client_address) -> None:
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        if not reuse:
            threading.Thread(target=self._serve_connections, daemon=True).start()
        self._connections.put((request, client_address))

    def _serve_connections(self) -> None:
        while True:
            request, client_address = self._connections.get()
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - as socketserver reports a handler's failure
                self.handle_error(request, client_address)
            finally:
                # idle before the close: the peer, once it sees the close, may connect again
                # at once (a snapshot's reconnect), and that connection must find this thread
                with self._lock:
                    self._idle += 1
                self.shutdown_request(request)


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
