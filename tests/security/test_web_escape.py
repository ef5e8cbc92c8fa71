"""The web env, written as the attacks: a policy whose only actions are browser actions tries
to read the workspace's files (the snapshot store, /etc/passwd) or another local service
through the browser, by ``goto`` and by clicking a link a page offers. Every attempt ends in
an error observation, and no page outside the env's sites is ever observed. Chromium and its
driver run as an unprivileged user that cannot sudo."""

from __future__ import annotations

import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.envs.webarena.browser import DriverError
from bunshin_gym.envs.webarena.tasks import shipped_task_ids

LISTING = "Directory listing"  # python -m http.server's page title
OTHER_PORT = 7771


@pytest.fixture(scope="module")
def env():
    e = gym.make("Bunshin-WebArena-v0")
    e.reset(options={"task": shipped_task_ids()[0]})
    ws = e.unwrapped.workspace
    # another local service that lists the workspace's root: what a browser must not reach
    ws.spawn(["python3", "-m", "http.server", str(OTHER_PORT), "--bind", "127.0.0.1", "--directory", "/"])
    probe = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{OTHER_PORT}/').status)"
    for _ in range(100):
        if ws.exec(["python3", "-c", probe]).text.strip() == "200":
            break
        time.sleep(0.1)
    yield e
    e.close()


def shows_no_escape(obs: dict) -> None:
    tree = obs["accessibility_tree"]
    assert obs["url"].startswith("http://127.0.0.1:7770"), obs["url"]
    assert LISTING not in tree and "root:x:0:0" not in tree and "snap-" not in tree


@pytest.mark.parametrize("url", ["file:///etc/passwd", "file:///.snap/", "file:///", "view-source:file:///etc/passwd",
                                 "data:text/html,<a href=file:///>x</a>", "chrome://version",
                                 f"http://127.0.0.1:{OTHER_PORT}/", f"127.0.0.1:{OTHER_PORT}",
                                 f"http://127.0.0.1:7770@127.0.0.1:{OTHER_PORT}/"])
def test_goto_outside_the_sites_is_refused(env, url):
    obs, reward, terminated, truncated, info = env.step(f"goto [{url}]")
    assert "refused" in info["error"] and "refused" in obs["last_action_error"]
    assert not terminated
    shows_no_escape(obs)


def test_the_driver_refuses_too_when_asked_directly(env):
    """Defence in depth: the driver checks the URL itself, whoever asks."""
    for op in ({"op": "act", "kind": "goto", "url": "file:///.snap/"},
               {"op": "evaluate", "js": "document.body.innerText", "url": "file:///etc/passwd"},
               {"op": "setup", "storage_state": None, "urls": ["file:///etc/"]}):
        with pytest.raises(DriverError, match="may only open the env's sites"):
            env.unwrapped.browser.request(op)


@pytest.mark.parametrize("href", [f"http://127.0.0.1:{OTHER_PORT}/", "file:///etc/"])
def test_a_clicked_link_outside_the_sites_is_blocked(env, href):
    env.step("goto [http://127.0.0.1:7770/]")
    env.unwrapped.browser.request({"op": "evaluate", "js": (
        f"document.body.insertAdjacentHTML('afterbegin', '<a href=\"{href}\">Escape hatch</a>')")})
    obs, *_ = env.step("scroll [up]")  # a fresh observation that has the link
    assert "Escape hatch" in obs["accessibility_tree"]
    obs, _, _, _, info = env.step("click [link 'Escape hatch']")
    shows_no_escape(obs)
    if href.startswith("http"):  # chromium itself never lets a web page open file:// links
        assert "was blocked" in info["error"]


def test_browser_runs_unprivileged(env):
    ws = env.unwrapped.workspace
    rows = [line.split() for line in ws.exec("ps -eo uid=,comm=").text.splitlines()]
    browser = [(uid, comm) for uid, comm in rows if comm.startswith(("chrom", "node"))]
    assert browser and all(uid != "0" for uid, _ in browser), browser
    # and none of them can become root through the user's sudo (no_new_privs)
    pid = ws.exec("pgrep -o -x chromium").text.strip()
    assert "NoNewPrivs:\t1" in ws.exec(f"cat /proc/{pid}/status").text
