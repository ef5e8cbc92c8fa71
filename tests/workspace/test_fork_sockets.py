"""BunshinFork, socket buffers: every socket's SO_SNDBUF, SO_RCVBUF and SO_BUF_LOCK read the
same in a clone, after a rollback and in the source, and bytes left unread in a unix socket
arrive whole. Real CRIU.

CRIU (patch 0026) sets a socket's buffers with plain SO_SNDBUF/SO_RCVBUF and reads them
back, and only when the kernel clamped them (above ``net.core.[wr]mem_max``) asks its user
namespace daemon to force them; a queue's buffers are raised only when it has packets. The
second test restores with the host's maxima lowered to Debian's default, so the forced path
runs for the sockets the program made larger than that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from fork_programs import host
from fork_programs.host import DIR, sh

from bunshin_gym.workspace import Workspace

OUT = "/tmp/sockbufs"
#: Debian 12's default net.core.wmem_max and rmem_max
DEBIAN_DEFAULT_MAX = 212992


def _report(ws: Workspace) -> str:
    sh(ws, f"touch {OUT}/go")
    return host.wait_file(ws, f"{OUT}/report", timeout=30)


def _source() -> tuple[Workspace, str]:
    ws = Workspace.create("base")
    host.install(ws, "sockbufs.py")
    ws.spawn(["python3", f"{DIR}/sockbufs.py", OUT], log="/tmp/sockbufs.log")
    host.wait_file(ws, f"{OUT}/ready")
    return ws, ws.read_file(f"{OUT}/before").decode()


@contextlib.contextmanager
def _socket_maxima(value: int) -> Iterator[None]:
    """The host's net.core.wmem_max and rmem_max set to ``value`` inside (global sysctls:
    the tests run one at a time), put back after."""
    files = [Path("/proc/sys/net/core/wmem_max"), Path("/proc/sys/net/core/rmem_max")]
    old = [f.read_text() for f in files]
    try:
        for f in files:
            f.write_text(str(value))
        yield
    finally:
        for f, v in zip(files, old, strict=True):
            f.write_text(v)


def _check(report: str, before: str) -> None:
    lines = report.splitlines()
    assert lines[:-1] == before.splitlines()
    assert lines[-1] == "queued 10240 bytes sha256=e96760a87768717b"


def test_socket_buffers_are_the_sources_in_a_clone_and_after_a_rollback():
    ws, before = _source()
    clones, snap = [], None
    try:
        snap = ws.snapshot()
        clones = snap.fork(2)
        for clone in clones:
            _check(_report(clone), before)
        _check(_report(ws), before)  # the source, too, after its snapshot
        ws.rollback(snap)
        assert sh(ws, f"ls {OUT}/report 2>/dev/null || true") == ""
        _check(_report(ws), before)
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()


def test_socket_buffers_above_the_hosts_maxima_are_forced_in_a_clone():
    ws, before = _source()
    big = [ln for ln in before.splitlines() if int(ln.split(" snd=")[1].split()[0]) > 2 * DEBIAN_DEFAULT_MAX]
    assert big, f"the program made no socket larger than {2 * DEBIAN_DEFAULT_MAX} bytes:\n{before}"
    clones, snap = [], None
    try:
        snap = ws.snapshot()
        with _socket_maxima(DEBIAN_DEFAULT_MAX):
            clones = snap.fork(1)
        _check(_report(clones[0]), before)
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
