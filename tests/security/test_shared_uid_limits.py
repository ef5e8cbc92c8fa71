"""Kernel accounts kept per host user, which every workspace shares (their root is one host
uid): what one workspace holds must not change what another observes.

Written as the attacks:
- a workspace fills the per-user pipe budget with enlarged pipes; a sibling's new pipe must
  still be a normal pipe that can be enlarged (else its programs see one-page pipes, and a fork
  of a workspace with an enlarged pipe fails in CRIU);
- a workspace queues signals, or makes POSIX message queues, until its own limit refuses; a
  sibling (fresh, or a clone restored by CRIU) must still queue a signal and make a queue. The
  kernel charges both to the owner of the user namespace too, capped by the owner's limits;
  every workspace's namespace was owned by host root (bunshin-init.c namespace_owner, and
  criu/patches/0019 for clones, give each its own).
"""

from __future__ import annotations

import time

import pytest

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


#: fills one kernel account until the workspace's own limit refuses, then holds it
ACCOUNT_HOG = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]
def one(kind, i):
    if kind == "signals":
        return libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) == 0
    attr = MqAttr(0, 10, 8192, 0)
    return rt.mq_open(f"/{sys.argv[2]}{i}".encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr)) >= 0
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])  # queued, never delivered
kind, held = sys.argv[1], 0
while held < int(sys.argv[3]) and one(kind, held):
    held += 1
err = os.strerror(ctypes.get_errno())
if sys.argv[3] == "1":
    print(held, err)
else:
    open("/tmp/hog-ready", "w").write(f"{held} {err}")
    time.sleep(3600)
"""


#: prints PR_GET_SECUREBITS of a command the agent starts (inherited from PID 1 down)
SECUREBITS = "import ctypes; print(ctypes.CDLL(None).prctl(27, 0, 0, 0, 0))"


def _limits(text: str) -> list[str]:
    return [line for line in text.splitlines() if "pending signals" in line or "msgqueue" in line
            or "locked memory" in line]


def _hold_account(ws: Workspace, kind: str) -> str:
    ws.write_file("/opt/hog.py", ACCOUNT_HOG)
    ws.spawn(["python3", "/opt/hog.py", kind, "hog", "1000000"])
    for _ in range(600):
        if ws.exec("test -e /tmp/hog-ready").ok:
            return ws.exec("cat /tmp/hog-ready").text
        time.sleep(0.1)
    raise AssertionError(f"the {kind} hog never got ready")


def _take_one(ws: Workspace, kind: str) -> str:
    ws.write_file("/opt/probe.py", ACCOUNT_HOG)
    out = ws.exec(["python3", "/opt/probe.py", kind, "probe", "1"])
    assert out.ok, out.stderr.decode()
    return out.text.strip()


@pytest.mark.parametrize("kind, own_limit_error", [("signals", "Resource temporarily unavailable"),
                                                   ("mqueue", "Too many open files")])
@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "clones"])
def test_a_workspace_holding_its_signal_or_queue_allowance_leaves_a_siblings_as_it_is(kind, own_limit_error,
                                                                                     forked):
    if forked:
        src = Workspace.create("base")
        snap = src.snapshot()
        hog, probe = snap.fork(2)
        pair = [src, hog, probe]
    else:
        snap = None
        hog, probe = pair = [Workspace.create("base"), Workspace.create("base")]
    try:
        # the workspaces' own limits are the controller's, as before (only their namespace's
        # creator had them lifted)
        for ws in pair:
            assert _limits(ws.exec("cat /proc/self/limits").text) == _limits(open("/proc/self/limits").read())
            # made under another owner, with capabilities kept across its uid for that moment
            # only: a workspace's processes drop capabilities on setuid as before
            assert ws.exec(["python3", "-c", SECUREBITS]).text.split() == ["0"]
        held, _, why = _hold_account(hog, kind).partition(" ")
        # the hog's own limit stopped it: each workspace keeps its cap
        assert int(held) > 0 and why == own_limit_error, (held, why)
        assert _take_one(probe, kind).split()[0] == "1", f"a sibling could not take one {kind}"
    finally:
        for ws in pair:
            ws.close()
        if snap is not None:
            snap.delete()
