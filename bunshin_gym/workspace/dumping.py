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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from bunshin_gym.workspace import records

MARKER = ".in-progress"

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
