"""A workspace's pid namespace goes on handing out the pids its source would (criu/patches/0025).

A program sees the pid each fork gets (``$$``, ``mktemp``-style names, pid files, log lines).
CRIU restores every task with its own pid (clone3 ``set_tid``), which leaves the restored
namespace's cursor at its start: before the patch a clone's next fork got the first free pid
after the restored tasks (16 in a small workspace) where its source's got the pid after the
last one it had handed out (37). And a background dump's copy-on-write children took pids in the
source's namespace, one per task dumped in the background. Each test is the observation a
program in the workspace makes: the pid of the next shell it starts. And the controller's
reconnect after each snapshot took one more (the agent served each connection on a new thread).
"""

from __future__ import annotations

import pytest

from bunshin_gym.workspace import Workspace, dumping
from bunshin_gym.workspace.dumping import BACKGROUND_DUMP_ENV

#: a background dump needs processes with private memory that its copy-on-write fork covers
HEAP = "import time; b = bytearray(32 << 20); b[::4096] = b'x' * (len(b) // 4096); time.sleep(3600)"


def _next_pid(ws: Workspace) -> int:
    """The pid a shell started now gets in the workspace (what ``$$`` prints)."""
    return int(ws.exec("sh -c 'echo $$'").text.strip())


@pytest.fixture
def busy_workspace():
    """A workspace whose pid cursor is well past its live tasks (short-lived commands came and
    went), with processes a background dump covers."""
    ws = Workspace.create("base")
    try:
        for _ in range(2):
            ws.spawn(["python3", "-c", HEAP])
        for _ in range(20):
            ws.exec("true")
        yield ws
    finally:
        ws.close()


@pytest.mark.parametrize("background", [False, True], ids=["stop-the-world", "background"])
def test_clones_and_rollbacks_fork_the_pid_their_source_forks(busy_workspace, background, monkeypatch):
    """Restored plainly or from a spare (restored ahead, frozen, thawed when taken), a clone's
    and a rolled-back workspace's next shell gets the pid the source's got after the snapshot."""
    if background and not dumping.background_available():
        pytest.skip("CRIU without criu/patches/0020-background-dump")
    monkeypatch.setenv(BACKGROUND_DUMP_ENV, "1" if background else "0")
    ws = busy_workspace
    snap = ws.snapshot()
    try:
        assert ("background_ms" in snap.metadata.timings) == background  # the mode asked for ran
        source = _next_pid(ws)
        live = [int(p) for p in ws.exec("ls /proc | grep -E '^[0-9]+$'").text.split()]
        assert source > max(live) - 5, "the cursor should be past the live tasks (short-lived ones came and went)"
        snap.prepare_spares(1)
        clones = snap.fork(2)  # the first from the spare, the second restored
        try:
            assert [_next_pid(c) for c in clones] == [source, source]
        finally:
            for c in clones:
                c.close()
        ws.rollback(snap)
        assert _next_pid(ws) == source
        ws.prepare_rollback(snap)
        ws.rollback(snap)
        assert _next_pid(ws) == source
    finally:
        ws.close()
        snap.delete()


@pytest.mark.parametrize("background", [False, True], ids=["stop-the-world", "background"])
def test_a_snapshot_takes_no_pid_from_its_source(busy_workspace, background, monkeypatch):
    """Across a snapshot the source's next shells get the pids they would without it. Before:
    one more per snapshot (the controller's reconnect after it, served on a new thread of the
    agent) and, in the background, one more per process dumped (its copy-on-write child)."""
    if background and not dumping.background_available():
        pytest.skip("CRIU without criu/patches/0020-background-dump")
    monkeypatch.setenv(BACKGROUND_DUMP_ENV, "1" if background else "0")
    ws = busy_workspace
    first, second = _next_pid(ws), _next_pid(ws)
    snap = ws.snapshot()
    try:
        assert ("background_ms" in snap.metadata.timings) == background
        assert _next_pid(ws) - second == second - first
    finally:
        snap.delete()
