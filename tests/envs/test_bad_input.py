"""``step()`` never raises for an action of the right type: NUL bytes, lone surrogates,
actions over 1 MiB, a TYPING text over the input server's frame, pyautogui code that kills
the input server (``os._exit``) or hangs it (ignores SIGALRM). Each gives an error (in
``info["error"]`` and the observation where it has a place for one), the observation is in
the observation space, and the env keeps working: the next good action runs as usual (the
desktop's input server restarted if it died). A killed action is never run a second time
by a retry."""

from __future__ import annotations

import re
import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core.env import ActionError, check_text, printable

MiB = 1 << 20
#: text actions of the right type (str) that cannot be run as they are, and what the error says
BAD_TEXT = [
    ("echo a\0b", "NUL byte"),
    ("echo \ud800", "lone surrogate U+D800"),
    ("echo " + "x" * (MiB + 10), "over the limit"),
    ("echo " + "\udfff" * 3, "lone surrogate U+DFFF"),
]


# the shared checks, no workspace ---------------------------------------------------------------
def test_check_text_names_what_is_wrong():
    assert check_text("ok ✓", what="x", max_bytes=10) == "ok ✓"
    for text, why in [("a\0", "NUL byte (at character 1)"), ("ab\ud83d", "lone surrogate U+D83D (at character 2)"),
                      ("é" * 6, "12 bytes of UTF-8, over the limit of 10"), (b"ls", "must be a string, not bytes")]:
        with pytest.raises(ActionError, match=re.escape(why)):
            check_text(text, what="x", max_bytes=10)


def test_printable_keeps_error_messages_inside_a_text_space():
    assert printable("bad \0 \ud800 \x1b[1m ✓\nnext\tcol") == "bad ? ? ?[1m ✓\nnext\tcol"
    assert printable("\ufffd\U0001F600") == "??"  # the envs' charsets stop below the surrogates
    assert len(printable("x" * 10_000, 100)) == 100


# Bunshin-Shell-v0 -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shell():
    env = gym.make("Bunshin-Shell-v0", task="shell/count-files", max_steps=10**6)
    env.reset()
    yield env
    env.close()


def _still_works(env) -> None:
    obs, _, _, _, info = env.step("echo still-here")
    assert "error" not in info and obs["output"].strip() == "still-here" and obs["exit_code"] == 0


@pytest.mark.parametrize("action,why", BAD_TEXT, ids=["nul", "surrogate", "over-1MiB", "surrogates"])
def test_shell_bad_text_is_an_error_observation(shell, action, why):
    obs, reward, terminated, truncated, info = shell.step(action)
    assert why in info["error"] and reward == 0.0 and not terminated
    assert obs["exit_code"] == -1 and why in obs["output"]
    assert shell.observation_space.contains(obs)
    _still_works(shell)


def test_shell_command_over_the_action_space_and_of_the_wrong_type(shell):
    for action, why in [("echo " + "y" * 8200, "over the limit of 8192"), (b"ls", "must be a string, not bytes"),
                        (None, "must be a string, not NoneType")]:
        obs, _, _, _, info = shell.step(action)
        assert why in info["error"] and why in obs["output"] and shell.observation_space.contains(obs)
    _still_works(shell)


def test_shell_output_with_control_bytes_and_invalid_utf8_stays_in_the_space(shell):
    obs, _, _, _, info = shell.step(r"printf 'a\001b\303\050c\355\240\200d\n'")
    assert "error" not in info and shell.observation_space.contains(obs), repr(obs["output"])
    _still_works(shell)


# Bunshin-OSWorld-v0 ------------------------------------------------------------------------------
RAN = "/tmp/bunshin-test-ran"


@pytest.fixture(scope="module")
def desktop():
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False, action_timeout=3.0,
                   max_steps=10**6, task="osworld/terminal-mkdir-projects")
    env.reset()
    yield env
    env.close()


def _desktop_works(env) -> None:
    obs, _, terminated, _, info = env.step("pyautogui.moveTo(300, 300); print(pyautogui.position())")
    assert "error" not in info and not terminated, info
    assert "300" in info["output"] and env.observation_space.contains(obs)


def _runs(env) -> int:
    """How many times the actions below ran (each appends a line to RAN in the workspace)."""
    res = env.unwrapped.workspace.exec(["sh", "-c", f"cat {RAN} 2>/dev/null | wc -l"])
    return int(res.text.strip())


def _server_pid(env) -> int:
    return env.unwrapped._client().request({"op": "ping"}, timeout=10)["pid"]


@pytest.mark.parametrize("code,why", [
    ("pyautogui.write('a\0b')", "NUL byte"),
    ("pyautogui.write('\ud800')", "lone surrogate U+D800"),
    ("#" * (MiB + 1), "over the limit"),
    ("x = 1\n" * 11000, "over the limit of 65536"),
], ids=["nul", "surrogate", "over-1MiB", "over-code-limit"])
def test_desktop_bad_code_is_an_error(desktop, code, why):
    obs, reward, terminated, _, info = desktop.step(code)
    assert why in info["error"] and not terminated and reward == 0.0
    assert desktop.observation_space.contains(obs)
    _desktop_works(desktop)


def test_desktop_code_calling_os_exit_restarts_the_input_server_and_runs_once(desktop):
    before, pid = _runs(desktop), _server_pid(desktop)
    _desktop_works(desktop)  # a live connection, so a retry on a "stale" one would be possible
    obs, _, terminated, _, info = desktop.step(f"import os\nopen({RAN!r}, 'a').write('x\\n')\nos._exit(3)")
    assert "input server" in info["error"] and "restarted" in info["error"] and not terminated
    assert "the server is gone" in info["error"], info  # the post-mortem says what happened to it
    assert desktop.observation_space.contains(obs)
    assert _runs(desktop) == before + 1  # run once, not again by a retry
    assert _server_pid(desktop) != pid
    _desktop_works(desktop)


def test_desktop_code_ignoring_sigalrm_is_stopped_and_the_server_replaced(desktop):
    before, pid = _runs(desktop), _server_pid(desktop)
    _desktop_works(desktop)
    t0 = time.monotonic()
    obs, _, terminated, _, info = desktop.step(
        f"import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nopen({RAN!r}, 'a').write('x\\n')\n"
        "time.sleep(3600)")
    took = time.monotonic() - t0
    assert "restarted" in info["error"] and not terminated, info
    assert "server pid" in info["error"] and "still runs" in info["error"], info  # hung, not dead
    assert took < desktop.unwrapped.action_timeout + 10 + 20  # the host's deadline, plus the restart
    assert _runs(desktop) == before + 1
    assert _server_pid(desktop) != pid
    _desktop_works(desktop)


def test_desktop_typing_text_over_the_frame_is_refused_before_sending():
    env = gym.make("Bunshin-OSWorld-v0", action_space="computer_13", require_a11y_tree=False,
                   max_steps=10**6, task="osworld/terminal-mkdir-projects")
    try:
        env.reset()
        for action, why in [({"action_type": "TYPING", "text": "é" * 200_000}, "over the input server's frame"),
                            ({"action_type": "TYPING", "text": "a" * (MiB + 1)}, "over the input server's frame"),
                            ({"action_type": "TYPING", "text": "a\0b"}, "NUL byte"),
                            ({"action_type": "TYPING", "text": "\udc80"}, "lone surrogate"),
                            ({"action_type": "PRESS", "key": "\ud800"}, "lone surrogate"),
                            ({"action_type": "HOTKEY", "keys": ["ctrl", "a\0"]}, "NUL byte")]:
            obs, _, terminated, _, info = env.step(action)
            assert why in info["error"] and not terminated, (action["action_type"], info)
            assert env.observation_space.contains(obs)
        obs, _, _, _, info = env.step({"action_type": "TYPING", "text": "ok"})
        assert "error" not in info
    finally:
        env.close()


# retries: never a second run of an action -------------------------------------------------------
#: a server that answers ping and, for any other request, notes it on stdout and drops the
#: connection without a reply while it keeps listening: what the client sees when a server
#: ran an action and died, and another took its socket (the case a blind retry runs twice)
DROPPING_SERVER = r"""
import os, socket, sys, threading
sys.path.insert(0, sys.argv[1])
from bunshin_gym.workspace.protocol import recv_msg, send_msg

def listen(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    return srv

def serve(srv):
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                try:
                    req, _ = recv_msg(conn)
                except Exception:
                    break
                if req.get("op") == "ping":
                    send_msg(conn, {"pid": os.getpid()})
                    continue
                print(req.get("op"), flush=True)
                break

# every socket listens before "ready": a client may connect the moment it reads it
for srv in [listen(path) for path in sys.argv[2:]]:
    threading.Thread(target=serve, args=(srv,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture
def dropping_server():
    """The server above in a mount namespace of its own (tmpfs on /tmp and /run), reached by
    the real clients through its /proc/PID/root as they reach a workspace's servers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bunshin_gym.envs.osworld import desktop
    from bunshin_gym.workspace.protocol import AGENT_SOCKET

    repo = str(Path(__file__).resolve().parents[2])
    # the program goes on the command line: tmpfs covers /tmp (and tmp_path) in its namespace
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs none /run && mount -t tmpfs none /tmp && exec "$0" "$@"',
         sys.executable, "-c", DROPPING_SERVER, repo, AGENT_SOCKET, desktop.DESKTOP_SOCKET],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, 9)
        proc.wait()


def _seen(proc) -> list[str]:
    import os

    os.kill(proc.pid, 9)
    proc.wait()
    return proc.stdout.read().split()


def test_a_dropped_action_is_never_sent_again_by_the_desktop_client(dropping_server):
    from types import SimpleNamespace

    from bunshin_gym.envs.osworld.desktop import DesktopClient
    from bunshin_gym.workspace.errors import ChannelError

    client = DesktopClient(SimpleNamespace(pid=dropping_server.pid, id="fake"))
    for op in ("pyautogui", "computer_13"):
        assert client.ping()  # an open connection: the next failure looks like a stale one
        with pytest.raises(ChannelError):
            client.request({"op": op, "code": "x", "action": {}}, timeout=5)
    client.close()
    assert _seen(dropping_server) == ["pyautogui", "computer_13"]


def test_the_agent_client_retries_only_idempotent_requests(dropping_server):
    from bunshin_gym.workspace.client import IDEMPOTENT, AgentClient
    from bunshin_gym.workspace.errors import ChannelError

    assert "exec" not in IDEMPOTENT and "write_file" not in IDEMPOTENT and "read_file" in IDEMPOTENT
    client = AgentClient(dropping_server.pid, "fake")
    for op in ("exec", "write_file", "spawn", "read_file"):
        client.request({"op": "ping"})
        with pytest.raises(ChannelError):
            client.request({"op": op, "argv": ["true"], "path": "/x"}, [b"data"] if op == "write_file" else [],
                           timeout=5)
    client.disconnect()
    # read_file may run twice (it changes nothing); the others ran once
    assert _seen(dropping_server) == ["exec", "write_file", "spawn", "read_file", "read_file"]


# Bunshin-WebArena-v0 ---------------------------------------------------------------------------
def test_webarena_bad_text_is_an_error_observation():
    env = gym.make("Bunshin-WebArena-v0", task="webarena/1001", max_steps=10**6)
    try:
        env.reset()
        for action, why in [*BAD_TEXT, ("type [1] [" + "z" * 8200 + "]", "over the limit of 8192"),
                            (b"scroll [down]", "must be a string, not bytes")]:
            obs, _, terminated, _, info = env.step(action)
            assert why in info["error"] and why in obs["last_action_error"] and not terminated
            assert env.observation_space.contains(obs)
        obs, _, _, _, info = env.step("scroll [down]")
        assert "error" not in info and obs["last_action_error"] == "" and obs["accessibility_tree"]
    finally:
        env.close()


# any family: an unexpected exception in an action ----------------------------------------------
def test_an_unexpected_exception_in_execute_is_reported_and_the_env_goes_on(monkeypatch):
    from bunshin_gym.testing import fake_factory

    env = gym.make("Bunshin-Shell-v0", task="shell/count-files", workspace_factory=fake_factory)
    try:
        env.reset()
        real = env.unwrapped.execute
        monkeypatch.setattr(env.unwrapped, "execute", lambda a: {}["no such key"])
        obs, _, terminated, truncated, info = env.step("ls")
        assert "KeyError" in info["error"] and not (terminated or truncated)
        monkeypatch.setattr(env.unwrapped, "execute", real)
        obs, _, _, _, info = env.step("echo fine")
        assert "error" not in info and "echo fine" in obs["output"]
    finally:
        env.close()


def test_desktop_input_server_killed_between_steps_is_restarted_and_the_action_runs(desktop):
    """A server found dead before the action reached it: restarted, and the action sent to
    the new one (it never ran, so nothing is lost and nothing runs twice)."""
    _desktop_works(desktop)  # the env holds a connection to the current server
    pid = _server_pid(desktop)
    ws = desktop.unwrapped.workspace
    assert ws.exec(["kill", "-9", str(pid)]).ok
    before = _runs(desktop)
    _, _, _, _, info = desktop.step(f"open({RAN!r}, 'a').write('x\\n'); print('ran')")
    assert "error" not in info and info["output"].strip() == "ran", info
    assert _runs(desktop) == before + 1 and _server_pid(desktop) != pid
    # and when no connection was open either (a fresh client finds no server)
    desktop.unwrapped.release_connections()
    assert ws.exec(["kill", "-9", str(_server_pid(desktop))]).ok
    desktop.unwrapped.release_connections()
    _desktop_works(desktop)
