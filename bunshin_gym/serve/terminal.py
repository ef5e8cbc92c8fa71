"""PTY sessions (E2B's ``sandbox.pty``): a real pseudo-terminal inside the workspace.

A PTY session is started like any command (under :data:`~bunshin_gym.serve.sandbox.WRAPPER`,
so it has a pid, an exit file, and is carried by snapshots, pauses and forks), but the
command it runs is :data:`PTY_HELPER`, run by the image's ``python3`` as the session's user:
it opens a pseudo-terminal pair, runs the shell in its own session with the terminal as its
controlling terminal, and relays between the terminal's master side and files in the
command's directory:

- output goes into numbered segment files ``pty.0``, ``pty.1``, ... of :data:`SEGMENT` bytes
  each; only the last :data:`SEGMENTS_KEPT` are kept, so a terminal that prints forever holds
  at most ``SEGMENT * SEGMENTS_KEPT`` bytes in the workspace (a client that falls further
  behind loses the oldest output, as a terminal's scrollback would);
- input comes from the FIFO ``pin`` and size changes ("ROWS COLS" lines) from the FIFO
  ``ctl``. The helper holds both open for reading and writing, so the server's writer never
  blocks on open and never sees an end of file.

The helper exits with the shell's status (128 + the signal when it was killed), which the
wrapper writes as the command's exit status.
"""

from __future__ import annotations

from bunshin_gym.serve.registry import ServeError

#: bytes per output segment file, and how many segments the helper keeps
SEGMENT = 64 << 10
SEGMENTS_KEPT = 16
#: segments one poll reads at most (a reply of at most 256 KiB; the rest comes next poll)
SEGMENTS_PER_POLL = 4
#: the largest input one request may send to a terminal (the SDK sends keystrokes)
MAX_INPUT = 1 << 20
#: the largest terminal, in rows and in columns
MAX_DIMENSION = 1000

PTY_HELPER = r"""
import fcntl, os, select, signal, struct, sys, termios
d, rows, cols, seg_size, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
argv = sys.argv[6:]
for name in ("pin", "ctl"):
    os.mkfifo(d + "/" + name, 0o600)
pin = os.open(d + "/pin", os.O_RDWR | os.O_NONBLOCK)
ctl = os.open(d + "/ctl", os.O_RDWR | os.O_NONBLOCK)
master, slave = os.openpty()
def winsize(r, c):
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))
winsize(rows, cols)
child = os.fork()
if child == 0:
    try:
        os.setsid()
        # the wrapper starts us in the background, where sh ignores SIGINT and SIGQUIT: a
        # terminal's ^C and ^\ must reach its jobs
        for sig in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(slave, fd)
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, ("bunshin pty: cannot run %s: %s\r\n" % (argv[0], e.strerror)).encode())
    os._exit(127)
os.close(slave)
with open(d + "/child.tmp", "w") as f:
    f.write(str(child))
os.rename(d + "/child.tmp", d + "/child")
seg, pos = 0, 0
out = open(d + "/pty.0", "ab", buffering=0)
open(d + "/ready", "w").close()
def emit(data):
    global seg, pos, out
    while data:
        n = min(len(data), seg_size - pos)
        out.write(data[:n])
        pos += n
        data = data[n:]
        if pos == seg_size:
            out.close()
            seg, pos = seg + 1, 0
            out = open(d + "/pty.%d" % seg, "ab", buffering=0)
            try:
                os.unlink(d + "/pty.%d" % (seg - keep))
            except FileNotFoundError:
                pass
pending, ctl_buf, status = b"", b"", None
while True:
    readers = [master, ctl] + ([pin] if len(pending) < 65536 else [])
    r, w, _ = select.select(readers, [master] if pending else [], [], 0.2)
    if master in r:
        try:
            data = os.read(master, 65536)
        except OSError:
            data = b""
        if not data:
            break
        emit(data)
    if pin in r:
        try:
            pending += os.read(pin, 65536)
        except BlockingIOError:
            pass
    if ctl in r:
        try:
            ctl_buf += os.read(ctl, 4096)
        except BlockingIOError:
            pass
        while b"\n" in ctl_buf:
            line, _, ctl_buf = ctl_buf.partition(b"\n")
            try:
                winsize(*[int(x) for x in line.split()])
            except (TypeError, ValueError, OSError):
                pass
    if pending and master in w:
        pending = pending[os.write(master, pending[:4096]):]
    if status is None:
        pid, st = os.waitpid(child, os.WNOHANG)
        if pid:
            status = st
    elif not r:
        break
if status is None:
    status = os.waitpid(child, 0)[1]
code = os.waitstatus_to_exitcode(status)
sys.exit(128 - code if code < 0 else code)
"""


def helper_argv(run_dir: str, rows: int, cols: int, cmd: str, args: list[str]) -> list[str]:
    """The argv that runs ``cmd args`` on a new ``rows`` x ``cols`` terminal."""
    return ["python3", "-c", PTY_HELPER, run_dir, str(rows), str(cols), str(SEGMENT), str(SEGMENTS_KEPT),
            cmd, *args]


def check_size(rows: int, cols: int) -> None:
    """ServeError 400 unless the terminal size is one a client may ask for."""
    if not (1 <= rows <= MAX_DIMENSION and 1 <= cols <= MAX_DIMENSION):
        raise ServeError(f"a terminal is 1 to {MAX_DIMENSION} rows and columns, not {rows}x{cols}", 400)
