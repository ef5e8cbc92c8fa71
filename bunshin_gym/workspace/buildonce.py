"""Files the controller makes for itself on first use (the uffd monitor and the workspace init,
compiled; the kmod action script, written), made once however many threads and processes ask.

Each was built into a temporary name of the process's own (``.NAME.<pid>``) and renamed into
place. Two threads of one process share that name: the first fork of four copy clones on a
fresh ``BUNSHIN_HOME`` compiled the monitor four times into one file, and a thread that had
renamed it executed a file another thread's linker still held open for writing (``OSError:
[Errno 26] Text file busy``: the fork failed; found by the slow suite's kmod VM, whose home
is new). Here a caller takes an exclusive ``flock`` on a lock file beside the result (threads
included: each opens its own file description), looks again, and builds into a directory of
its own before renaming.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the lock of ``path`` (a ``.NAME.lock`` file beside it; its directory must exist)."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(out: Path, make: Callable[[Path], None]) -> Path:
    """``out``, made by ``make(target)`` unless it exists: ``make`` writes a file or directory at
    ``target`` (a path in a fresh directory beside ``out``), which is then renamed to ``out``.
    Concurrent callers wait for the first and get its result; one whose ``make`` raises leaves
    nothing behind."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        if out.exists():  # made by another thread or process while this one waited
            return out
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            target = scratch / out.name
            make(target)
            os.rename(target, out)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def write_text(path: Path, text: str, mode: int = 0o644) -> Path:
    """``path`` with exactly ``text`` (and ``mode``), replaced whole when it differs: a reader or
    an ``exec`` sees the old file or the new one, never one being written."""
    if path.exists() and path.read_text() == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path):
        if path.exists() and path.read_text() == text:
            return path
        replace_text(path, text, mode)
    return path


def replace_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``path`` whole, atomically, through a temporary file of this call's own (one
    name shared by concurrent writers lets one rename another's half-written file): readers
    see the old file or the new one; a failed write leaves the old one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp's files are 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
