"""BunshinFork, unix sockets: descriptors in flight (SCM_RIGHTS) on a socketpair split over two
processes reach their receiver, intact, in a clone and after a rollback. Real CRIU.

This is chromium's IPC at any instant; CRIU set the descriptors up in the wrong task, so a
clone read other files, or the restore failed (a webarena rollback in CI; patch 0013).
"""

from __future__ import annotations

import pytest
from fork_programs import host
from fork_programs.host import DIR, sh

from bunshin_gym.workspace import Workspace

WANT = {"parent": "message-from-child | file-of-child | pipe-of-child",
        "child": "message-from-parent | file-of-parent | pipe-of-parent"}


def _received(ws: Workspace) -> dict[str, str]:
    sh(ws, "touch /tmp/scm/go")
    return {side: host.wait_file(ws, f"/tmp/scm/{side}.out", timeout=30).strip() for side in WANT}


@pytest.mark.parametrize("mode", ["copy", "share"])
def test_descriptors_in_flight_reach_their_receiver_in_clone_and_after_rollback(mode):
    ws = Workspace.create("base", memory_mode=mode)
    clones, snap = [], None
    try:
        host.install(ws, "scm_pair.py")
        ws.spawn(["python3", f"{DIR}/scm_pair.py", "/tmp/scm"], log="/tmp/scm.log")
        for side in WANT:
            host.wait_file(ws, f"/tmp/scm/{side}.ready")
        snap = ws.snapshot()
        clones = snap.fork(1)
        assert _received(clones[0]) == WANT
        assert _received(ws) == WANT  # the source, too, after its snapshot
        ws.rollback(snap)
        assert sh(ws, "ls /tmp/scm/*.out 2>/dev/null || true") == ""
        assert _received(ws) == WANT
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
