"""Reading a process's state from /proc while it exits: ``open("/proc/PID/stat")`` of a process
being reaped fails with ESRCH, not ENOENT. CI saw it closing a copy clone (its write tracker's
worker exiting under ``uffd.stop``'s wait): the close raised a bare ProcessLookupError."""

from __future__ import annotations

import os
import subprocess

import pytest

from bunshin_gym.workspace import records


def test_a_live_process_reads_as_alive_and_a_reaped_one_as_gone():
    proc = subprocess.Popen(["sleep", "30"])
    start = records.proc_start_time(proc.pid)
    assert start is not None and records.process_alive(proc.pid, start)
    proc.kill()
    proc.wait()
    assert records.proc_start_time(proc.pid) is None and not records.process_alive(proc.pid, start)


@pytest.mark.parametrize("at", ["open", "read"])
def test_a_process_exiting_while_read_is_gone_not_an_error(monkeypatch, at):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        start = records.proc_start_time(proc.pid)
        real = getattr(os, at)

        def exiting(*args, **kwargs):  # what the kernel answers for a task being reaped
            path = os.readlink(f"/proc/self/fd/{args[0]}") if at == "read" else str(args[0])
            if path.startswith(f"/proc/{proc.pid}/"):
                raise ProcessLookupError(3, "No such process")
            return real(*args, **kwargs)

        monkeypatch.setattr(records.os, at, exiting)
        assert records.proc_start_time(proc.pid) is None
        assert not records.process_alive(proc.pid, start)
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()
