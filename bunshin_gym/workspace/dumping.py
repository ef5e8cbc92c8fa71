"""Guards around a snapshot's dump: the in-progress marker ``bunshin gc`` honours, and the
check that a frozen workspace can be seized by CRIU.

In-progress marker: ``snapshots/<id>/.in-progress`` (JSON: the workspace, the controller)
exists from just after the directory is made until ``meta.json`` is written, and is
``flock``-ed by the controller *and* by the ``criu dump`` it runs (the descriptor is passed
on). So while either lives the lock is held and ``gc`` leaves the directory (and the frozen
workspace) alone; once both are gone (the controller SIGKILLed, CRIU finished or killed),
``gc`` thaws the workspace the marker names and removes the half-made snapshot.

Seizability: CRIU seizes a frozen cgroup's tasks with ``PTRACE_SEIZE``/``PTRACE_INTERRUPT``,
thaws the cgroup and waits for each task to stop. A task frozen inside ``vfork()`` (the
parent waits, uninterruptibly, until its child execs or exits) never stops: its child is
stopped by CRIU before it can exec, so the parent stays in state D until CRIU's timeout
("Unseizable non-zombie ... state D"). Before dumping, :func:`unseizable` finds such tasks;
``take`` then thaws briefly so the child can exec, and freezes again.

Infectability: CRIU's compel writes its syscall blob with ``PTRACE_POKEDATA`` at the start of
each process's first executable mapping. In a share-mode clone that mapping can be anonymous
memory served through userfaultfd (chromium's 512 MB RWX code range is), and a page the program
dropped (``MADV_DONTNEED``: V8 discards freed code pages) and has not touched since is not
present. ptrace reaches it through ``get_user_pages_remote`` without ``FAULT_FLAG_ALLOW_RETRY``,
so the kernel cannot wait for the monitor: ``handle_userfault`` answers ``VM_FAULT_SIGBUS``, the
peek and poke fail with EIO and CRIU gives up ("Can't infect ... with parasite"; compel's peek
check compares with ``-1U`` and misses its own EIO). :func:`fault_in_parasite_pages` reads those
pages with ``process_vm_readv`` first, which may wait: the monitor maps the page (a zero page
for a dropped one, exactly what the program would read), and the poke then succeeds.

Network lock: a workspace with a TCP connection is dumped with ``--network-lock nftables``:
CRIU adds a table ``inet CRIU-<run id>`` to the workspace's network namespace whose chains
drop every packet but its own, and deletes it at the end. A CRIU killed in between leaves the
table, and the source's connections stay blocked after it is thawed.
:func:`remove_network_locks` deletes such tables once no CRIU runs on the workspace (the
snapshot's failure path, and ``gc`` thawing a source an abandoned dump left).

Gate: a CRIU built with criu/patches/0029 is started before the freeze (:class:`GatedDump`):
its start-up (exec, kernel-feature cache, cpu and cgroup set-up) runs while the workspace
does, and it waits at the gate until told the network lock method chosen frozen. (Snapshotting
the files while CRIU worked, through a second gate before its thaw, was tried and dropped:
CRIU's own work got slower by about what it saved, both writing to the same btrfs.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bunshin_gym.config import Paths, criu_carries
from bunshin_gym.workspace import records

log = logging.getLogger(__name__)

MARKER = ".in-progress"
#: the switch of background dumps (``config.background_dump``), for benchmarks that set it
BACKGROUND_DUMP_ENV = "BUNSHIN_BACKGROUND_DUMP"

#: kernel functions a task sleeps in uninterruptibly while waiting for another task, in which
#: CRIU cannot stop it (wchan names, /proc/PID/wchan)
_WAITS_FOR_OTHERS = ("wait_for_vfork_done", "do_fork", "kernel_clone", "copy_process")


@contextlib.contextmanager
def in_progress(path: Path, ws_id: str) -> Iterator[int]:
    """Mark ``path`` as a snapshot being made of ``ws_id``; yields the locked descriptor (pass
    it to ``criu dump``). The marker appears already locked (written aside, then renamed)."""
    tmp = path / f"{MARKER}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        me = os.getpid()
        os.write(fd, json.dumps({"workspace": ws_id, "pid": me, "start": records.proc_start_time(me)}).encode())
        os.rename(tmp, path / MARKER)
        yield fd
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)


def done(path: Path) -> None:
    """The snapshot is complete (``meta.json`` written): drop the marker."""
    (path / MARKER).unlink(missing_ok=True)


def state(path: Path) -> tuple[str, str | None]:
    """``("none", None)``: no marker; ``("running", ws)``: a dump of workspace ``ws`` is
    still being made (the lock is held); ``("abandoned", ws)``: its maker and CRIU are gone."""
    try:
        fd = os.open(path / MARKER, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "none", None
    try:
        try:
            ws = json.loads(os.read(fd, 4096) or b"{}").get("workspace")
        except ValueError:
            ws = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "running", ws
        return "abandoned", ws
    finally:
        os.close(fd)


def unseizable(pids: list[int]) -> list[tuple[int, str]]:
    """Tasks (pid, what they wait in) that a frozen-cgroup seize cannot stop: in
    uninterruptible sleep waiting for another task of the tree (a ``vfork`` parent)."""
    out = []
    for pid in pids:
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        except OSError:
            continue
        if wchan in _WAITS_FOR_OTHERS:
            out.append((pid, wchan))
    return out


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_readv.restype = ctypes.c_ssize_t

#: bytes compel overwrites at a task's first executable address: the syscall blob (8) and,
#: after it, the memfd name "CRIUMFD" (compel/include/infect-priv.h); all in its first page
PARASITE_SPAN = 16
#: CRIU's get_exec_start skips mappings at or above the task size (the vsyscall page)
_TASK_SIZE = 1 << 47


def exec_start(pid: int) -> int | None:
    """Where CRIU puts its syscall blob in ``pid``: the start of its first executable mapping
    below the task size (criu/parasite-syscall.c ``get_exec_start``); None if it has none."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                span, perms = line.split(b" ", 2)[:2]
                start = int(span.split(b"-", 1)[0], 16)
                if perms[2:3] == b"x" and start < _TASK_SIZE:
                    return start
    except (OSError, ValueError):
        return None
    return None


def fault_in_parasite_pages(pids: list[int]) -> list[tuple[int, int, int]]:
    """Make the page CRIU's parasite is written to present in every process of ``pids`` (see
    the module's notes): ``process_vm_readv`` of its first bytes, which, unlike ptrace, may
    wait for a userfaultfd monitor to serve the fault. Threads share their leader's memory, so
    one read per process is enough; reading a present page changes nothing. Returns the
    (pid, address, errno) of reads that failed (a process that exited meanwhile is not one)."""
    failed = []
    buf = ctypes.create_string_buffer(PARASITE_SPAN)
    for pid in pids:
        start = exec_start(pid)
        if start is None:
            continue
        local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), PARASITE_SPAN)
        remote = _IoVec(start, PARASITE_SPAN)
        if _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) < 0:
            err = ctypes.get_errno()
            if err != errno.ESRCH:
                failed.append((pid, start, err))
    if failed:
        log.warning("could not read the parasite's page of %s: CRIU may fail to infect them", failed)
    return failed


#: the table of CRIU's nftables network lock is named ``CRIU-<run id>`` (criu/netfilter.c)
LOCK_TABLE_PREFIX = "CRIU-"


def _nft(pid: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "nft", *args], capture_output=True, text=True,
                          timeout=30)


def remove_network_locks(pid1: int | None) -> list[str]:
    """Delete the nftables tables of CRIU's network lock left in the network namespace of the
    workspace whose PID 1 is ``pid1`` (see the module's notes). Call it only when no CRIU runs
    on that workspace. Returns the tables deleted; problems are logged, never raised (this runs
    on failure paths, before the source is thawed)."""
    if pid1 is None or not os.path.exists(f"/proc/{pid1}/ns/net"):
        return []
    try:
        listing = _nft(pid1, "-j", "list", "tables")
        if listing.returncode != 0:
            log.warning("listing the nftables tables of pid %d failed: %s", pid1, listing.stderr.strip())
            return []
        tables = [item["table"] for item in json.loads(listing.stdout or "{}").get("nftables", ())
                  if "table" in item]
        removed = []
        for t in tables:
            if not t["name"].startswith(LOCK_TABLE_PREFIX):
                continue
            proc = _nft(pid1, "delete", "table", t["family"], t["name"])
            if proc.returncode == 0:
                removed.append(f"{t['family']} {t['name']}")
            else:
                log.warning("deleting CRIU's network lock %s %s (pid %d) failed: %s", t["family"], t["name"], pid1,
                            proc.stderr.strip())
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("removing CRIU's network locks of pid %d failed: %s", pid1, e)
        return []
    if removed:
        log.warning("removed CRIU's network lock %s left by an interrupted dump (pid %d)", removed, pid1)
    return removed


#: the criu binary can dump in the background if it contains this string (criu/patches/0020-*)
BACKGROUND_MARKER = b"bg-dump: tasks thawed"


def background_available(p: Paths | None = None) -> bool:
    """The built CRIU carries the background dump (criu/patches/0020-*)."""
    return criu_carries(BACKGROUND_MARKER, p)


def run_dump(cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> subprocess.CompletedProcess:
    """Run ``criu dump`` to its end, in a session of its own (see :func:`start_criu`)."""
    proc = start_criu(cmd, env, pass_fds)
    out, err = wait_for_criu(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_criu(cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """Start a ``criu dump`` in a session of its own: a terminal's Ctrl-C (SIGINT to the
    controller's process group) is not for it. Killed mid-dump, CRIU fails the snapshot (and
    where criu/patches/0035 cannot guard a task, a compat one, it leaves it to die on an int3);
    undisturbed, it ends in a second or so. Its log goes to a file (-o): stdout and stderr stay
    far below a pipe's buffer."""
    return subprocess.Popen(cmd, env=env, pass_fds=pass_fds, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_criu(proc: subprocess.Popen) -> tuple[str, str]:
    """``proc.communicate()``; interrupted (Ctrl-C), it first waits for CRIU to end (a second
    Ctrl-C stops that wait), then raises: a dump is not left running under a thawed source."""
    try:
        return proc.communicate()
    except KeyboardInterrupt:
        log.warning("interrupted: waiting for criu (pid %d) to finish the dump it began", proc.pid)
        proc.communicate()
        raise


def run_in_background(cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...]
                      ) -> tuple[subprocess.CompletedProcess, float | None]:
    """Run ``criu dump`` as a background dump (criu/patches/0020: ``CRIU_BG_DUMP=1``): CRIU
    thaws the tasks once it holds their metadata and their pages by reference, copy-on-write,
    and writes the pages afterwards. Returns the finished process and the ``perf_counter()``
    time at which CRIU let the tasks run (None when it never said so: it failed first, or a
    CRIU without the patch wrote everything while frozen)."""
    r, w = os.pipe()
    try:
        # CRIU writes "1" to this fd and closes it when the tasks run again (mem.c bg_dump_*)
        proc = start_criu(cmd, dict(env, CRIU_BG_DUMP="1", CRIU_BG_DUMP_FD=str(w)), (*pass_fds, w))
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        thawed = _read_thawed(r)
    finally:
        out, err = wait_for_criu(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), thawed


def _read_thawed(fd: int) -> float | None:
    """Wait on a background dump's ``CRIU_BG_DUMP_FD`` pipe (and close it): the
    ``perf_counter()`` time at which CRIU said the tasks run again, None if it never did."""
    try:
        return time.perf_counter() if os.read(fd, 1) == b"1" else None
    finally:
        os.close(fd)


#: the criu binary can wait at a dump gate if it contains this string (criu/patches/0029-*)
GATE_MARKER = b"dump gate: closed before the"


def gate_available(p: Paths | None = None) -> bool:
    """The built CRIU carries the dump gate (criu/patches/0029-*)."""
    return criu_carries(GATE_MARKER, p)


class GatedDump:
    """A ``criu dump`` started before its workspace is frozen (criu/patches/0029): it says
    :meth:`ready` once its start-up is done and waits at the gate until :meth:`go`. Whatever
    happens, :meth:`finish` reaps it; a gate closed before :meth:`go` fails the dump before
    it touches any task. ``background``: a background dump (0020).

    >>> d = GatedDump(cmd, env, (lock_fd,), background=True)   # CRIU starts up meanwhile
    >>> d.ready(); freeze(); d.go("skip")
    >>> proc, thawed = d.finish()
    """

    def __init__(self, cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...], *, background: bool):
        self.cmd = cmd
        self._gate, criu_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds, extra = [criu_end.fileno()], {"CRIU_DUMP_GATE_FD": str(criu_end.fileno())}
        self._thawed_r = bg_w = None
        try:
            if background:  # CRIU writes "1" to this fd and closes it when the tasks run again
                self._thawed_r, bg_w = os.pipe()
                fds.append(bg_w)
                extra.update(CRIU_BG_DUMP="1", CRIU_BG_DUMP_FD=str(bg_w))
            self.proc = start_criu(cmd, dict(env, **extra), (*pass_fds, *fds))
        except BaseException:
            self._close_gate()
            if self._thawed_r is not None:
                os.close(self._thawed_r)
            raise
        finally:
            criu_end.close()
            if bg_w is not None:
                os.close(bg_w)

    def ready(self, timeout: float = 30.0) -> bool:
        """Wait until CRIU has started up and waits at the gate. False: it failed first (or
        took longer than ``timeout``, and is killed); :meth:`finish` then tells how."""
        self._gate.settimeout(timeout)
        got = b""
        try:
            while not got.endswith(b"\n"):
                chunk = self._gate.recv(16)
                if not chunk:
                    return False
                got += chunk
        except TimeoutError:
            log.warning("criu dump did not reach its gate in %.0f s: killed", timeout)
            self.proc.kill()
            return False
        except OSError:
            return False
        return got == b"ready\n"

    def go(self, network_lock: str) -> None:
        """The workspace is frozen: CRIU may seize it, locking the network with ``network_lock``."""
        if self._gate is None:
            raise RuntimeError("the dump gate is closed")
        try:
            self._gate.sendall(f"{network_lock}\n".encode())  # a few bytes into an empty socket
        except OSError:  # CRIU failed before reading it: finish() reports how
            pass
        self._close_gate()

    def finish(self) -> tuple[subprocess.CompletedProcess, float | None]:
        """Wait for CRIU: the finished process, and the ``perf_counter()`` time at which it let a
        background dump's tasks run (None: not a background dump, or it failed first)."""
        self._close_gate()  # a caller that never reached go: CRIU fails at the gate
        thawed = None
        if self._thawed_r is not None:
            fd, self._thawed_r = self._thawed_r, None
            thawed = _read_thawed(fd)
        out, err = wait_for_criu(self.proc)
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err), thawed

    def _close_gate(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None
