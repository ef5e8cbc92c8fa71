"""Kernel accounts kept per host user, which every workspace shares (their root is one host
uid): what one workspace holds must not change what another observes.

Written as the attack: a workspace fills the per-user pipe budget with enlarged pipes; a
sibling's new pipe must still be a normal pipe that can be enlarged (else its programs see
one-page pipes, and a fork of a workspace with an enlarged pipe fails in CRIU).
"""

from __future__ import annotations

from bunshin_gym.workspace import Workspace, hostlimits

HOG = r"""
import fcntl, os, sys, time
F_SETPIPE_SZ, held = 1031, []
while len(held) < int(sys.argv[1]):
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)  # 256 pages each
    held.append((r, w))
open("/tmp/hog-ready", "w").close()
time.sleep(3600)
"""

PROBE = r"""
import fcntl, os
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
r, w = os.pipe()
print(fcntl.fcntl(w, F_GETPIPE_SZ), fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20))
"""


def test_a_workspace_holding_big_pipes_leaves_a_siblings_pipes_as_they_are():
    hog, probe = Workspace.create("base"), Workspace.create("base")  # the controller prepares the host
    try:
        hog.write_file("/opt/hog.py", HOG)
        # 80 MiB of pipe buffers: past the kernel's default per-user soft limit (64 MiB)
        hog.spawn(["python3", "/opt/hog.py", "80"])
        for _ in range(200):
            if hog.exec("test -e /tmp/hog-ready").ok:
                break
            hog.exec("sleep 0.1")
        assert hog.exec("test -e /tmp/hog-ready").ok, hog.exec("cat /proc/1/status").text
        probe.write_file("/opt/probe.py", PROBE)
        out = probe.exec(["python3", "/opt/probe.py"])
        assert out.ok and out.text.split() == ["65536", "1048576"], out.text + out.stderr.decode()
        # and a fork of the sibling, whose restored pipe keeps its enlarged size, works
        probe.spawn(["python3", "-c", "import fcntl,os,time; r,w=os.pipe(); fcntl.fcntl(w,1031,1<<20); "
                                      "open('/tmp/pipe-ready','w').close(); time.sleep(3600)"])
        for _ in range(100):
            if probe.exec("test -e /tmp/pipe-ready").ok:
                break
            probe.exec("sleep 0.1")
        snap = probe.snapshot()
        try:
            (clone,) = snap.fork(1)
            assert clone.exec("test -e /tmp/pipe-ready").ok
            clone.close()
        finally:
            snap.delete()
        assert int(hostlimits.PIPE_USER_PAGES_SOFT.read_text()) == 0
    finally:
        hog.close()
        probe.close()
