"""``step()`` turns a workspace-side server that misbehaves into an error observation.

A policy with root in its workspace can replace the desktop input server, the X server or
the browser driver by its own. Here they are stand-ins (``hostile_servers.py``) in a
workspace of the ``base`` image, behind the real env classes (only ``boot`` differs): a
desktop server that never answers an action, an X server announcing a 512 MiB reply, a
browser driver that never answers an action. Each step returns, in bounded time, an
observation of the env's space with the error in ``info``; nothing is raised.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bunshin_gym.envs.osworld import desktop
from bunshin_gym.envs.osworld.env import OSWorldEnv
from bunshin_gym.envs.webarena.browser import BrowserClient
from bunshin_gym.envs.webarena.env import WebArenaEnv

HOSTILE = Path(__file__).with_name("hostile_servers.py")
MiB = 1 << 20


def _start(ws, *argv: str) -> None:
    ws.write_file("/opt/hostile_servers.py", HOSTILE.read_bytes())
    ws.exec(f"mkdir -p {desktop.STATE}", check=True)
    ws.spawn(["python3", "/opt/hostile_servers.py", *argv])


# a stand-in's start-up in a fresh workspace (a python3 start, a socket bound): not what these
# tests bound; it once took over 20 s in the full suite on a loaded 2-core host
STARTUP_S = 60.0


def _until(pred, what: str, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} did not come up"
        time.sleep(0.05)


class HostileDesktopEnv(OSWorldEnv):
    """The OSWorld env on a workspace whose X server and input server are the stand-ins."""

    def boot(self, ws) -> None:
        _start(ws, "x", desktop.X_SOCKET)
        _start(ws, "silent-desktop")
        _until(lambda: desktop._x_answers(desktop.sock_path(ws, desktop.X_SOCKET)), "the stand-in X server")
        _until(lambda: desktop.DesktopClient(ws).ping(), "the stand-in input server")

    def restart_input_server(self) -> None:
        """The env replaces a broken input server by its own program; here, by the stand-in again."""
        self.release_connections()
        self.workspace.exec(["pkill", "-KILL", "-f", "hostile_servers.py silent-desktop"], timeout=10)
        _start(self.workspace, "silent-desktop")
        _until(lambda: desktop.DesktopClient(self.workspace).ping(), "the restarted stand-in input server")


OSWORLD_TASK = {"id": "security/silent-desktop", "instruction": "click", "evaluator": {"func": "infeasible"}}


@pytest.fixture
def desktop_env():
    env = HostileDesktopEnv(image="base", screen_size=(64, 48), require_a11y_tree=False, reset_snapshot=False,
                            action_timeout=0.5, wait_seconds=0.0)
    yield env
    env.close()


def _peak_rss() -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_desktop_server_that_never_answers_gives_an_error_observation(desktop_env):
    env = desktop_env
    obs, _ = env.reset(options={"task": OSWORLD_TASK})
    assert obs["screenshot"].shape == (48, 64, 3)
    t0 = time.monotonic()
    obs, reward, _, _, info = env.step({"action_type": "CLICK", "x": 10, "y": 10})
    assert time.monotonic() - t0 < 30  # the request's deadline: action_timeout + 10 s
    assert "no reply within" in info["error"] and "desktop input server" in info["error"]
    assert env.observation_space.contains(obs) and reward == 0.0


def test_x_reply_with_a_huge_length_gives_an_error_observation(desktop_env):
    env = desktop_env
    env.reset(options={"task": OSWORLD_TASK})
    env.workspace.write_file("/tmp/x-huge", str(512 * MiB // 4))
    Path("/proc/self/clear_refs").write_text("5")
    base = _peak_rss()
    t0 = time.monotonic()
    obs, reward, _, _, info = env.step("WAIT")
    assert time.monotonic() - t0 < 10
    assert "X reply refused" in info["error"]
    assert _peak_rss() - base < 64 * MiB, "the controller allocated what the X server announced"
    assert env.observation_space.contains(obs) and reward == 0.0


class HostileWebEnv(WebArenaEnv):
    """The WebArena env on a workspace whose browser driver is the stand-in (no sites)."""

    def boot(self, ws) -> None:
        _start(ws, "silent-web")
        self.browser.wait_ready(STARTUP_S)

    @property
    def browser(self) -> BrowserClient:
        if self._client is None:  # the env's own floor is 60 s a request: too long for a test
            self._client = BrowserClient(self.workspace.pid, timeout=2.0)
        return self._client


WEB_TASK = {"task_id": "security-silent-driver", "sites": [], "start_url": "about:blank", "intent": "scroll",
            "eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": ["x"]}}}


def test_browser_driver_that_never_answers_gives_an_error_observation():
    env = HostileWebEnv(sites={}, image="base", reset_snapshot=False)
    try:
        env.reset(options={"task": WEB_TASK})
        t0 = time.monotonic()
        obs, reward, _, _, info = env.step("scroll [down]")
        assert time.monotonic() - t0 < 15
        assert "no reply within" in info["error"] and "browser driver" in info["error"]
        assert "no reply within" in obs["last_action_error"]
        assert env.observation_space.contains(obs) and reward == 0.0
    finally:
        env.close()
