"""The shell family served by OpenEnv's own server (create_fastapi_app, run by uvicorn) and driven
by OpenEnv's own clients (EnvClient subclass and GenericEnvClient) over WebSocket sessions."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn
from openenv.core import GenericEnvClient

from bunshin_gym.integrations.openenv import BunshinAction, BunshinEnvClient, create_app, environment_for


@pytest.fixture(scope="module")
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    srv = uvicorn.Server(uvicorn.Config(create_app("Bunshin-Shell-v0", max_concurrent_envs=4), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    environment_for("Bunshin-Shell-v0").member_class.close_all()


def test_an_episode_through_openenvs_client(server):
    with BunshinEnvClient(base_url=server) as env:
        result = env.reset(task="shell/hello-file")
        assert not result.done and "Create /home/user/hello.txt" in result.observation.text
        assert env.state().task_id == "shell/hello-file" and env.state().step_count == 0
        result = env.step(BunshinAction(action="echo hello world > /home/user/hello.txt"))
        assert result.observation.text.startswith("[exit code 0]") and result.reward == 0.0
        result = env.step(BunshinAction(action="DONE"))
        assert result.done and result.reward == 1.0
        assert env.state().step_count == 2
        workspaces = [m.env.unwrapped.workspace for m in environment_for("Bunshin-Shell-v0").member_class._instances
                      if m.env is not None]
        assert len(workspaces) == 1
    # the session ended: the server closed its environment, and with it the workspace
    deadline = time.monotonic() + 10
    while not workspaces[0].closed and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workspaces[0].closed


def test_concurrent_sessions_are_separate_episodes(server):
    """Two sessions at once (OpenEnv's GenericEnvClient): the same task, different actions, own rewards."""

    def episode(command: str) -> tuple[float, str]:
        with GenericEnvClient(base_url=server) as env:
            env.reset(task="shell/make-dir")
            env.step({"action": command})
            seen = env.step({"action": "ls -d /home/user/projects/* 2>&1"}).observation["text"]
            final = env.step({"action": "DONE"})
            return final.reward, seen

    with ThreadPoolExecutor(2) as pool:
        good, bad = pool.map(episode, ["mkdir -p /home/user/projects/alpha", "mkdir -p /home/user/projects/beta"])
    assert good[0] == 1.0 and "alpha" in good[1] and "beta" not in good[1]
    assert bad[0] == 0.0 and "beta" in bad[1] and "alpha" not in bad[1]


def test_bad_requests_are_clear_errors(server):
    with BunshinEnvClient(base_url=server) as env:
        with pytest.raises(RuntimeError, match="needs a task"):
            env.reset()
        env.reset(task="shell/hello-file")
        result = env.step(BunshinAction(action="\x00"))
        assert result.observation.error and not result.done  # the episode goes on
