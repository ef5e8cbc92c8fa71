"""Host settings workspaces need (bunshin_gym.workspace.hostlimits): pipe-max-size is raised
to CRIU's largest page pipe, so a dump hands a task's pages over in fewer, larger pipes."""

from __future__ import annotations

import re

import pytest

from bunshin_gym.workspace import Workspace, hostlimits


def test_pipe_max_size_is_raised_never_lowered(tmp_path):
    setting = tmp_path / "pipe-max-size"
    setting.write_text("1048576\n")
    assert hostlimits.raise_pipe_max_size(setting) and int(setting.read_text()) == hostlimits.CRIU_PIPE_BYTES
    setting.write_text(f"{64 << 20}\n")
    assert hostlimits.raise_pipe_max_size(setting) and int(setting.read_text()) == 64 << 20
    assert not hostlimits.raise_pipe_max_size(tmp_path / "missing")  # logged, not raised


def test_a_dump_hands_pages_over_in_pipes_past_one_mib(monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "4")  # the log says how each pipe grew
    ws = Workspace.create("base")
    try:
        assert int(hostlimits.PIPE_MAX_SIZE.read_text()) >= hostlimits.CRIU_PIPE_BYTES
        ws.exec("python3 -c \"import os, time; b = bytearray(os.urandom(48 << 20)); "
                "open('/tmp/ready', 'w').close(); time.sleep(600)\" >/dev/null 2>&1 &")
        ws.exec("for i in $(seq 200); do [ -e /tmp/ready ] && break; sleep 0.05; done; [ -e /tmp/ready ]", check=True)
        snap = ws.snapshot()
        try:
            log = (snap.criu_dir / "dump.log").read_text(errors="replace")
        finally:
            snap.delete()
    finally:
        ws.close()
    grown = [int(m, 16) for m in re.findall(r"Grow pipe \w+ -> (\w+)", log)]
    if not grown:
        pytest.fail("the dump log shows no pipe growing: " + log[-2000:])
    assert max(grown) * 4096 > 1 << 20, f"pipes stayed at {max(grown)} pages (1 MiB)"
