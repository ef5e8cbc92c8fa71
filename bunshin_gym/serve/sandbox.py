"""E2B sandboxes as bunshin workspaces: the lease, commands run through the workspace's
agent with streamed output, and the file operations behind envd's filesystem service.

Commands: the agent runs a command to completion or spawns it detached; E2B streams a
command's output while it runs and lets a client leave it running in the background. A
command is therefore spawned under a small POSIX-shell wrapper (:data:`WRAPPER`) that runs
it in its own session with its stdout and stderr in files under ``/tmp`` of the workspace
and writes its exit status last; the server reads those files through the agent while a
client streams (reading again from where it stopped) and signals the command's process
group to kill it. The files are in the workspace, so snapshots, pauses and forks carry a
running command along with its output so far.

Every request into one workspace holds the sandbox's lock: the agent connection serves one
request at a time, and a snapshot needs no connection open.
"""

from __future__ import annotations

import errno
import json
import logging
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from bunshin_gym.serve import terminal
from bunshin_gym.serve.registry import Conflict, Lease, NotFound, Registry, ServeError
from bunshin_gym.workspace import AgentError, Workspace

log = logging.getLogger(__name__)

#: the envd version the server reports: >= 0.4.0 (the sandbox picks the default user),
#: >= 0.5.2 (close stdin), >= 0.5.7 (octet-stream uploads), < 0.6.2 (no file metadata)
ENVD_VERSION = "0.5.7"
#: the user commands and file operations run as when the client names none (E2B's default)
DEFAULT_USER = "user"

#: a command's output is read whole (one agent request) until a client has read this much of
#: it; past it, a range at a time (the agent reads whole files only); a poll returns at most
#: OUTPUT_CHUNK bytes of each stream
INLINE_OUTPUT = 1 << 20
OUTPUT_CHUNK = 1 << 20

#: where commands keep their output (one hidden directory in the sandbox's /tmp, mode 1777)
RUN_DIR = "/tmp/.bunshin-e2b"
#: runs one command: ``sh -c WRAPPER run DIR STDIN CMD ARGS...``. The command runs in its own
#: session (its pid is its process group: a kill reaches its children) with its output in
#: DIR/out and DIR/err; DIR/pid appears once it runs and DIR/exit once it ended (written
#: through a rename: a reader never sees half of either). With STDIN=1 its standard input
#: is the FIFO DIR/in, held open by a sleeping writer until close_stdin kills that writer.
WRAPPER = r"""
d=$1; stdin=$2; shift 2
base=${d%/*}
if [ ! -d "$base" ]; then mkdir -p "$base" && chmod 1777 "$base"; fi
mkdir "$d" || exit 111
# output of commands that ended more than 10 minutes ago goes
find "$base" -mindepth 2 -maxdepth 2 -name exit -mmin +10 2>/dev/null | while read -r f; do rm -rf "${f%/exit}"; done
if [ "$stdin" = 1 ]; then
  mkfifo "$d/in" || exit 111
  (exec sleep 2147483647) > "$d/in" &
  echo $! > "$d/holder"
  setsid "$@" < "$d/in" > "$d/out" 2> "$d/err" &
else
  setsid "$@" < /dev/null > "$d/out" 2> "$d/err" &
fi
child=$!
echo $child > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid"
wait $child
code=$?
[ -f "$d/holder" ] && kill "$(cat "$d/holder")" 2>/dev/null
echo $code > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
"""

#: file operations of envd's filesystem service, run by the image's python3 as the user
FS_HELPER = r"""
import grp, json, os, pwd, shutil, stat, sys
op, args = sys.argv[1], json.loads(sys.argv[2])
def name_of(get, i):
    try:
        return get(i)[0]
    except KeyError:
        return str(i)
def info(path):
    st = os.lstat(path)
    link = stat.S_ISLNK(st.st_mode)
    target = None
    if link:
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError:
            pass
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
    return {"name": os.path.basename(path.rstrip("/")) or "/", "path": path, "type": kind,
            "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "perm": stat.filemode(st.st_mode),
            "owner": name_of(pwd.getpwuid, st.st_uid), "group": name_of(grp.getgrgid, st.st_gid),
            "mtime_ns": st.st_mtime_ns, "link": link, "target": target}
def walk(path, depth, out):
    for e in sorted(os.scandir(path), key=lambda e: e.name):
        out.append(info(e.path))
        if depth > 1 and e.is_dir(follow_symlinks=False):
            walk(e.path, depth - 1, out)
try:
    p = args["path"]
    if op == "stat":
        res = info(p)
    elif op == "list":
        if not os.path.isdir(p):
            raise NotADirectoryError(20, "not a directory", p)
        res = []
        walk(p, max(1, args.get("depth") or 1), res)
    elif op == "mkdir":
        if os.path.lexists(p):
            raise FileExistsError(17, "already exists", p)
        os.makedirs(p)
        res = info(p)
    elif op == "move":
        os.makedirs(os.path.dirname(args["dest"]) or "/", exist_ok=True)
        os.rename(p, args["dest"])
        res = info(args["dest"])
    elif op == "remove":
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        res = None
    else:
        raise ValueError("unknown operation " + op)
    print(json.dumps({"ok": res}))
except OSError as e:
    print(json.dumps({"error": e.strerror or str(e), "errno": e.errno, "path": getattr(e, "filename", None)}))
"""


class Paused(Conflict):
    """The sandbox is paused (409 on the REST API; envd answers UNAVAILABLE, as E2B's proxy does
    for a sandbox that is not running)."""


class FsError(ServeError):
    """A file operation failed inside the sandbox; ``errno`` says how."""

    def __init__(self, message: str, err: int | None):
        super().__init__(message, 404 if err == errno.ENOENT else 409 if err == errno.EEXIST
                         else 403 if err in (errno.EACCES, errno.EPERM) else 400)
        self.errno = err


@dataclass
class Command:
    """A command started in a sandbox (E2B: a process, by pid)."""

    pid: int
    dir: str
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    stdin: bool
    exit_code: int | None = None
    #: set when the server signalled it (the exit code is then 128 + the signal)
    signalled: str | None = None
    #: the user it runs as (its FIFOs are written as this user)
    user: str = DEFAULT_USER
    #: a PTY session (:mod:`bunshin_gym.serve.terminal`): output in segments, input by FIFO
    pty: bool = False


@dataclass
class Sandbox(Lease):
    """An E2B sandbox: a workspace (or, paused, the snapshot it resumes from)."""

    template: str = "base"
    ws: Workspace | None = None
    paused_snapshot: Any = None
    metadata: dict = field(default_factory=dict)
    env_vars: dict = field(default_factory=dict)
    envd_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    #: what a request to one of its ports must carry (:mod:`bunshin_gym.serve.ports`)
    traffic_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    auto_pause: bool = False
    timeout: float = 300.0
    commands: dict[int, Command] = field(default_factory=dict)
    #: directory watchers by id (:mod:`bunshin_gym.serve.watch`; kept across a server restart)
    watchers: dict = field(default_factory=dict)
    #: the per-workspace memory limit, counted against the quota while it runs
    memory_limit: int = 0

    @property
    def state(self) -> str:
        return "paused" if self.ws is None else "running"

    def workspace(self) -> Workspace:
        if self.ws is None:
            raise Paused(f"sandbox {self.id} is paused: connect to resume it first")
        return self.ws

    def reclaim(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.close()
        snap, self.paused_snapshot = self.paused_snapshot, None
        if snap is not None:
            snap.release()

    def expiry(self, now_wall: float, now_mono: float) -> str | None:
        if self.ws is None:
            return None  # paused: it holds no workspace, only its snapshot, until resumed or killed
        return super().expiry(now_wall, now_mono)

    def on_expiry(self, registry: Registry, why: str) -> None:
        if self.auto_pause and self.ws is not None and self.end_at is not None and time.time() >= self.end_at:
            pause(self, registry)
            return
        registry.close(self.id, why=why)

    # commands --------------------------------------------------------------------------
    def start(self, cmd: str, args: list[str], envs: dict[str, str], cwd: str | None, user: str,
              tag: str | None, stdin: bool, pty: tuple[int, int] | None = None) -> Command:
        """Spawn a command (on a new terminal of ``pty`` = (rows, cols) when given); returns
        once it runs (its pid known, a terminal's FIFOs made)."""
        d = f"{RUN_DIR}/{secrets.token_hex(6)}"
        env = {**self.env_vars, **envs}
        argv = [cmd, *args]
        if pty is not None:
            terminal.check_size(*pty)
            argv, stdin = terminal.helper_argv(d, pty[0], pty[1], cmd, list(args)), False
        with self.lock:
            ws = self.workspace()
            try:
                ws.spawn(["/bin/sh", "-c", WRAPPER, "bunshin-run", d, "1" if stdin else "0", *argv],
                         env=env, cwd=cwd, user=user)
            except AgentError as e:
                raise ServeError(f"cannot start {cmd!r}: {e}", 400) from None
        # a terminal is ready once its helper made its FIFOs; the wrapper's pid file comes before
        ready = f"{d}/ready" if pty is not None else f"{d}/pid"
        deadline = time.monotonic() + 30
        while True:
            with self.lock:
                pid = read_optional(self.workspace(), ready) is not None and read_optional(self.workspace(),
                                                                                              f"{d}/pid")
                failed = None if pid else read_optional(self.workspace(), f"{d}/exit")
            if pid:
                break
            if failed is not None or time.monotonic() > deadline:
                raise ServeError(f"cannot start {cmd!r} as {user} (cwd {cwd or '~'}): the sandbox refused it", 400)
            time.sleep(0.002)
        command = Command(int(pid), d, cmd, list(args), dict(envs), cwd, tag, stdin, user=user, pty=pty is not None)
        self.commands[command.pid] = command
        return command

    def find(self, pid: int | None = None, tag: str | None = None) -> Command:
        for c in self.commands.values():
            if (pid is not None and c.pid == pid) or (tag is not None and c.tag == tag):
                return c
        raise NotFound(f"no process {pid if pid is not None else tag!r} in sandbox {self.id}")

    def poll(self, command: Command, out_from: int, err_from: int) -> tuple[int | None, bytes, bytes]:
        """(exit code or None while it runs, stdout and stderr from the given offsets, at most
        :data:`OUTPUT_CHUNK` bytes of each). The exit code comes only with the last output."""
        with self.lock:
            ws = self.workspace()
            code = read_optional(ws, f"{command.dir}/exit")
            out, more_out = _read_output(ws, f"{command.dir}/out", out_from, command.user)
            err, more_err = _read_output(ws, f"{command.dir}/err", err_from, command.user)
        # the code read before the output: the output read after it is complete (another
        # request may have learnt the code since, before this output was read)
        exit_code = -1 if code is None and command.exit_code == -1 else None  # -1: its directory went
        if code is not None:
            exit_code = command.exit_code = int(code.strip() or b"-1")
        return None if more_out or more_err else exit_code, out, err

    def poll_pty(self, command: Command, offset: int) -> tuple[int | None, bytes, int]:
        """(exit code or None, terminal output from ``offset``, the offset after it). The exit
        code comes only with the last of the output; a client more than the kept segments
        behind skips to the oldest kept one."""
        seg_size = terminal.SEGMENT
        with self.lock:
            ws = self.workspace()
            code = read_optional(ws, f"{command.dir}/exit")
            seg, pos = divmod(offset, seg_size)
            chunks: list[bytes] = []
            at_end = True
            for i in range(terminal.SEGMENTS_PER_POLL + 1):
                data = read_optional(ws, f"{command.dir}/pty.{seg}")
                if data is None:
                    oldest = None if chunks else self._oldest_segment(command)
                    if oldest is None or oldest <= seg:
                        break
                    log.info("sandbox %s: pty %s output from %d to %d was dropped (the client fell behind)",
                             self.id, command.pid, offset, oldest * seg_size)
                    seg, pos = oldest, 0
                    continue
                if i == terminal.SEGMENTS_PER_POLL:
                    at_end = False  # more to read: the next poll goes on from here
                    break
                chunks.append(data[pos:])
                if len(data) < seg_size:
                    pos = len(data)
                    break
                seg, pos = seg + 1, 0
        exit_code = None if code is None else int(code.strip() or b"-1")
        if exit_code is not None:
            command.exit_code = exit_code
        return exit_code if at_end else None, b"".join(chunks), seg * seg_size + pos

    def _ended(self, command: Command) -> bool:
        with self.lock:
            code = read_optional(self.workspace(), f"{command.dir}/exit")
        if code is not None:
            command.exit_code = int(code.strip() or b"-1")
        return code is not None

    def _oldest_segment(self, command: Command) -> int | None:
        res = self.workspace().exec(["/bin/sh", "-c", 'cd "$1" && ls', "sh", command.dir], user=command.user,
                                    timeout=10)
        numbers = [int(n[4:]) for n in res.stdout.decode(errors="replace").split()
                   if n.startswith("pty.") and n[4:].isdigit()]
        return min(numbers) if numbers else None

    def pty_input(self, command: Command, data: bytes) -> None:
        """Bytes typed on a PTY session's terminal."""
        self._to_fifo(command, "pin", data)

    def resize(self, command: Command, rows: int, cols: int) -> None:
        terminal.check_size(rows, cols)
        self._to_fifo(command, "ctl", f"{rows} {cols}\n".encode())

    def _to_fifo(self, command: Command, fifo: str, data: bytes) -> None:
        if not command.pty:
            raise ServeError(f"process {command.pid} has no terminal (start it with pty.create)", 400)
        if len(data) > terminal.MAX_INPUT:
            raise ServeError(f"{len(data)} bytes of input, over the limit of {terminal.MAX_INPUT}", 400)
        if self._ended(command):
            raise NotFound(f"process {command.pid} has already ended")
        # opened read-write: the open never blocks, even if the helper is gone; run as the
        # session's user, whose FIFO it is (root would follow whatever the user put there)
        with self.lock:
            res = self.workspace().exec(["/bin/sh", "-c", 'exec 3<>"$1" && cat >&3', "sh", f"{command.dir}/{fifo}"],
                                        stdin=data, user=command.user, timeout=30)
        if not res.ok:
            raise ServeError(f"process {command.pid}: writing to its terminal failed: "
                             f"{res.stderr.decode(errors='replace')[-500:]}", 400)

    def running(self) -> list[Command]:
        out = []
        for c in list(self.commands.values()):
            if c.exit_code is None and not self._ended(c):
                with self.lock:
                    gone = read_optional(self.workspace(), f"{c.dir}/pid") is None
                if gone:  # its directory was removed (from inside): it is not ours to list
                    c.exit_code = -1
                else:
                    out.append(c)
        return out

    def signal(self, command: Command, sig: str) -> None:
        """Signal the command's process group (its children too)."""
        with self.lock:
            # its group, and itself: the wrapper writes the pid before the command's setsid
            # may have run (on a loaded host), and then there is no such group yet
            targets = [f"-{command.pid}", str(command.pid)]
            if command.pty:  # the terminal's shell leads a session of its own
                child = read_optional(self.workspace(), f"{command.dir}/child")
                if child and child.strip().isdigit():
                    targets.append(f"-{child.strip().decode()}")
            # bash's kill: procps' and dash's do not take a negative pid (a group) after --
            res = self.workspace().exec(["/bin/bash", "-c", 'sig=$1; shift; kill -s "$sig" -- "$@"', "bash",
                                         sig, *targets], timeout=10)
        if not res.ok and b"No such process" not in res.stderr:
            raise ServeError(f"cannot signal process {command.pid}: {res.stderr.decode(errors='replace')}", 500)
        command.signalled = sig

    def send_stdin(self, command: Command, data: bytes) -> None:
        if not command.stdin:
            raise ServeError(f"process {command.pid} was started without stdin (run it with stdin=True)", 400)
        with self.lock:
            res = self.workspace().exec(["/bin/sh", "-c", 'cat > "$1"', "sh", f"{command.dir}/in"],
                                        stdin=data, timeout=30)
        if not res.ok:
            raise ServeError(f"process {command.pid}: writing its stdin failed: {res.stderr.decode()[-500:]}", 400)

    def close_stdin(self, command: Command) -> None:
        if not command.stdin:
            raise ServeError(f"process {command.pid} was started without stdin", 400)
        with self.lock:
            self.workspace().exec(["/bin/sh", "-c", 'kill "$(cat "$1")"', "sh", f"{command.dir}/holder"], timeout=10)

    # files -----------------------------------------------------------------------------
    def fs(self, op: str, user: str, **args: Any) -> Any:
        with self.lock:
            res = self.workspace().exec(["python3", "-c", FS_HELPER, op, json.dumps(args)], user=user, timeout=60)
        try:
            reply = json.loads(res.stdout)
        except ValueError:
            raise ServeError(f"{op} {args.get('path')!r} failed: {res.stderr.decode(errors='replace')[-500:]}",
                             500) from None
        if "error" in reply:
            raise FsError(f"{op} {reply.get('path') or args.get('path')!r}: {reply['error']}", reply.get("errno"))
        return reply["ok"]

    def read_file(self, path: str) -> bytes:
        with self.lock:
            try:
                return self.workspace().read_file(path)
            except AgentError as e:
                raise FsError(f"read {path!r}: {e}", e.errno) from None

    def write_file(self, path: str, data: bytes, user: str) -> None:
        with self.lock:
            try:
                self.workspace().write_file(path, data, owner=None if user == "root" else user)
            except AgentError as e:
                raise FsError(f"write {path!r}: {e}", e.errno) from None


def _read_output(ws: Workspace, path: str, offset: int, user: str) -> tuple[bytes, bool]:
    """At most :data:`OUTPUT_CHUNK` bytes of a command's output file from ``offset``, and
    whether more follows. Small outputs are read whole in one agent request; past
    :data:`INLINE_OUTPUT` (or past the agent's cap on a read) only the range is read."""
    if offset < INLINE_OUTPUT:
        try:
            data = read_optional(ws, path) or b""
        except AgentError as e:
            if e.errno != errno.EFBIG:
                raise
        else:
            return data[offset:offset + OUTPUT_CHUNK], len(data) > offset + OUTPUT_CHUNK
    res = ws.exec(["/bin/sh", "-c", 'tail -c +"$2" "$1" 2>/dev/null | head -c "$3"', "sh", path, str(offset + 1),
                   str(OUTPUT_CHUNK + 1)], user=user, timeout=60, max_output=OUTPUT_CHUNK + 1)
    return res.stdout[:OUTPUT_CHUNK], len(res.stdout) > OUTPUT_CHUNK


def read_optional(ws: Workspace, path: str) -> bytes | None:
    """A file of the workspace, or None when it does not exist."""
    try:
        return ws.read_file(path)
    except AgentError as e:
        if e.errno == errno.ENOENT:
            return None
        raise


def home_of(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def resolve(path: str, user: str) -> str:
    """E2B paths: absolute, or relative to the user's home (``~`` too)."""
    if not path:
        raise ServeError("a path is required", 400)
    if "\0" in path:
        raise ServeError("a path cannot contain NUL", 400)
    if path == "~" or path.startswith("~/"):
        path = home_of(user) + path[1:]
    if not path.startswith("/"):
        path = f"{home_of(user)}/{path}"
    return path


def pause(sb: Sandbox, registry: Registry) -> None:
    """Snapshot the sandbox (memory and files) and release its workspace; its commands stay
    where they were and go on after resume."""
    with sb.lock:
        ws = sb.workspace()
        snap = ws.snapshot(tags={"e2b_sandbox": sb.id, "pause": True})
        sb.paused_snapshot = snap
        sb.ws = None
        ws.close()
        registry.unreserve(sb.owner, sb.workspaces, sb.memory)
        sb.workspaces, sb.memory = 0, 0
        sb.end_at = None  # a paused sandbox has no timeout (E2B: it stays until resumed or killed)
    registry.on_change()


def resume(sb: Sandbox, registry: Registry, timeout: float) -> None:
    with sb.lock:
        if sb.ws is not None:
            return
        registry.reserve(sb.owner, 1, sb.memory_limit)
        try:
            ws = sb.paused_snapshot.fork(1, detached=True)[0]
        except BaseException:
            registry.unreserve(sb.owner, 1, sb.memory_limit)
            raise
        sb.ws, sb.workspaces, sb.memory = ws, 1, sb.memory_limit
        snap, sb.paused_snapshot = sb.paused_snapshot, None
        snap.release()  # deleted once the resumed workspace no longer needs it
        sb.end_at = time.time() + timeout
    registry.on_change()


def quote(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
