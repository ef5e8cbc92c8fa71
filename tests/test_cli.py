"""The ``bunshin`` command, run as a subprocess: ws start/ls/exec/stop, errors, and gc.

Never ``bunshin gc --all`` or ``ws stop --all`` here: other sessions' workspaces may be running.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, leftovers

from bunshin_gym.workspace import records
from bunshin_gym.workspace.workspace import reclaim

BUNSHIN = str(Path(sys.executable).parent / "bunshin")


def bunshin(*args: str, timeout: float = 60, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([BUNSHIN, *args], capture_output=True, text=text, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def cli_ws():
    """A detached workspace started with ``bunshin ws start``."""
    res = bunshin("ws", "start")
    assert res.returncode == 0, res.stderr
    ws_id = res.stdout.strip()
    assert ws_id.startswith("ws-") and len(res.stdout.split()) == 1
    yield ws_id
    rec = records.load(ws_id)
    if rec is not None:
        reclaim(rec)


def test_entry_point_exists():
    assert Path(BUNSHIN).is_file()
    res = bunshin("--help")
    assert res.returncode == 0 and "ws" in res.stdout and "gc" in res.stdout


def test_start_records_a_detached_running_workspace(cli_ws):
    rec = records.load(cli_ws)
    assert rec is not None and rec.running() and rec.owner is None and rec.image == "base"


def test_ls_lists_it(cli_ws):
    res = bunshin("ws", "ls")
    assert res.returncode == 0
    row = next(line for line in res.stdout.splitlines() if line.startswith(cli_ws))
    assert row.split()[1:] == ["base", str(records.load(cli_ws).pid1), "running", "detached"]
    assert res.stdout.splitlines()[0].split()[:3] == ["ID", "IMAGE", "PID"]


def test_exec_shell_line(cli_ws):
    res = bunshin("ws", "exec", cli_ws, "echo hello; uname -n; echo err >&2")
    assert res.returncode == 0
    assert res.stdout == f"hello\n{cli_ws}\n" and res.stderr == "err\n"


@pytest.mark.parametrize("code", [0, 1, 7, 255])
def test_exec_propagates_the_exit_code(cli_ws, code):
    assert bunshin("ws", "exec", cli_ws, "--", "sh", "-c", f"exit {code}").returncode == code
    assert bunshin("ws", "exec", cli_ws, f"exit {code}").returncode == code


def test_exec_argv_after_double_dash(cli_ws):
    res = bunshin("ws", "exec", cli_ws, "--", "printf", "%s|", "a b", "$HOME")
    assert res.returncode == 0 and res.stdout == "a b|$HOME|"


def test_exec_binary_output(cli_ws):
    res = bunshin("ws", "exec", cli_ws, "--", "python3", "-c",
                  "import sys; sys.stdout.buffer.write(bytes(range(256)))", text=False)
    assert res.returncode == 0 and res.stdout == bytes(range(256))


def test_exec_as_user(cli_ws):
    res = bunshin("ws", "exec", "--user", "user", cli_ws, 'echo "$(id -un) $HOME"')
    assert res.returncode == 0 and res.stdout == "user /home/user\n"


def test_exec_timeout_is_124(cli_ws):
    res = bunshin("ws", "exec", "--timeout", "0.5", cli_ws, "sleep 30")
    assert res.returncode == 124 and "timed out" in res.stderr
    assert bunshin("ws", "exec", cli_ws, "true").returncode == 0  # the workspace lives on


def test_exec_without_a_command(cli_ws):
    res = bunshin("ws", "exec", cli_ws)
    assert res.returncode == 2 and "command" in res.stderr


def test_exec_on_unknown_id_names_it():
    res = bunshin("ws", "exec", "ws-nosuch00", "true")
    assert res.returncode == 1
    assert "ws-nosuch00" in res.stderr and "Traceback" not in res.stderr


def test_stop_unknown_id_names_it():
    res = bunshin("ws", "stop", "ws-nosuch01")
    assert res.returncode == 1 and "ws-nosuch01" in res.stderr and "Traceback" not in res.stderr


def test_start_unknown_image_names_it():
    res = bunshin("ws", "start", "--image", "no-such-image-xyz")
    assert res.returncode == 1
    assert "no-such-image-xyz" in res.stderr and "Traceback" not in res.stderr


def test_start_exec_stop_round_trip():
    res = bunshin("ws", "start")
    assert res.returncode == 0, res.stderr
    ws_id = res.stdout.strip()
    try:
        assert bunshin("ws", "exec", ws_id, "echo x > /root/f").returncode == 0
        assert bunshin("ws", "exec", ws_id, "cat /root/f").stdout == "x\n"  # state persists between calls
        stop = bunshin("ws", "stop", ws_id)
        assert stop.returncode == 0 and stop.stdout.strip() == f"stopped {ws_id}"
        assert leftovers([ws_id]) == {}
        assert ws_id not in bunshin("ws", "ls").stdout
        after = bunshin("ws", "exec", ws_id, "true")
        assert after.returncode == 1 and ws_id in after.stderr
    finally:
        rec = records.load(ws_id)
        if rec is not None:
            reclaim(rec)


def test_gc_reclaims_a_sigkilled_controllers_workspace(orphan):
    orphan.kill_controller()
    assert records.load(orphan.id).running()  # still running until gc
    res = bunshin("gc")
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("reclaimed") and "workspaces" in line]
    if not any(orphan.id in line for line in lines):
        # only acceptable when another session's gc reclaimed it while this one started up
        assert records.load(orphan.id) is None, res.stdout
    assert leftovers([orphan.id]) == {}
    again = bunshin("gc")
    assert again.returncode == 0 and orphan.id not in again.stdout
