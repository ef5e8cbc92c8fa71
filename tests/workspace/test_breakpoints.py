"""A task leaving CRIU's code is stopped at its sigreturn by stepping its system calls, not by a
hardware breakpoint (criu/patches/0034).

A breakpoint CRIU sets with ptrace is a perf event the task keeps until it exits; the first one
on a host with none enables perf's context-switch hooks and waits for an RCU grace period
(10-18 ms with both CPUs idle), inside a dump's frozen window or a restore. What shows which way
CRIU went is the task's first debug address register: CRIU's breakpoint leaves the sigreturn's
address there (it clears only the control register), stepping leaves it as it was (0).
"""

from __future__ import annotations

import ctypes
import os

import pytest
from fork_programs import host

from bunshin_gym.workspace import Workspace

PTRACE_PEEKUSER, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 3, 17, 0x4206, 0x4207
#: offsetof(struct user, u_debugreg) on x86_64 (sys/user.h): DR0 is the first of eight
U_DEBUGREG = 848
__WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def debug_address_0(pid: int) -> int:
    """DR0 of task ``pid``: seized, stopped, read and let go (it runs on as before)."""
    if _libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), f"PTRACE_SEIZE {pid}")
    try:
        if _libc.ptrace(PTRACE_INTERRUPT, pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"PTRACE_INTERRUPT {pid}")
        os.waitpid(pid, __WALL)
        ctypes.set_errno(0)
        value = _libc.ptrace(PTRACE_PEEKUSER, pid, ctypes.c_void_p(U_DEBUGREG), None)
        if value == -1 and ctypes.get_errno():
            raise OSError(ctypes.get_errno(), f"PTRACE_PEEKUSER {pid}")
        return value & 0xFFFFFFFFFFFFFFFF
    finally:
        _libc.ptrace(PTRACE_DETACH, pid, None, None)


@pytest.mark.parametrize("breakpoints", [False, True], ids=["stepping", "criu-breakpoints"])
def test_dump_and_restore_leave_no_hardware_breakpoint(monkeypatch, breakpoints):
    if breakpoints:  # CRIU's own way: the test shows it would see a breakpoint
        monkeypatch.setenv("CRIU_BREAKPOINTS", "1")
    else:
        monkeypatch.delenv("CRIU_BREAKPOINTS", raising=False)
    ws = Workspace.create("base")
    snap = clone = None
    try:
        sleeper = ws.spawn(["sleep", "3600"])  # its pid in the workspace, the same in its clones
        assert debug_address_0(host.host_pid_of(ws, sleeper)) == 0  # never dumped: nothing set
        snap = ws.snapshot()
        (clone,) = snap.fork(1, mode="share")
        dumped = debug_address_0(host.host_pid_of(ws, sleeper))
        restored = debug_address_0(host.host_pid_of(clone, sleeper))
        if breakpoints:
            assert dumped != 0 and restored != 0
        else:
            assert dumped == 0 and restored == 0
        # the task stopped and let go by the test and by CRIU runs on: it answers signals
        for w in (ws, clone):
            assert w.exec(f"kill -0 {sleeper} && echo alive").text.strip() == "alive"
    finally:
        if clone is not None:
            clone.close()
        if snap is not None:
            snap.delete()
        ws.close()
