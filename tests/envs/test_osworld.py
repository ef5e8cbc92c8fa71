"""Bunshin-OSWorld-v0 on real desktops (Xvfb, openbox, xterm, mousepad, chromium, Calc).

Default run: a fast subset of the shipped tasks (oracle scores 1.0, no action 0.0), both
action spaces, malformed actions, the accessibility tree, rollback (screen and files) and
a clone of a desktop with chromium open. ``-m slow``: every shipped task, and chromium in a
clone kept busy for two minutes in share mode.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.envs.osworld import tasks

FAST_TASKS = ["osworld/terminal-mkdir-projects", "osworld/files-rename-extension", "osworld/editor-append-item",
              "osworld/chrome-open-about", "osworld/calc-sum-expenses", "osworld/os-install-office-infeasible"]
ALL_TASKS = list(tasks.task_paths())


def make(**kw) -> gym.Env:
    kw.setdefault("action_space", "pyautogui")
    kw.setdefault("require_a11y_tree", False)
    return gym.make("Bunshin-OSWorld-v0", **kw)


@pytest.fixture(scope="module")
def env():
    e = make(require_terminal=True)
    yield e
    e.close()


def run_oracle(env, task_id: str) -> tuple[float, float]:
    """(score with the oracle, score with no action: DONE right after reset)."""
    env.reset(options={"task": task_id})
    reward = 0.0
    for action in env.unwrapped.oracle():
        _, reward, terminated, truncated, info = env.step(action)
        assert "error" not in info, (action, info["error"])
        if terminated or truncated:
            break
    env.rollback()
    _, noop, terminated, _, _ = env.step("DONE")
    assert terminated
    return reward, noop


@pytest.mark.parametrize("task_id", FAST_TASKS)
def test_fast_tasks_oracle_and_noop(env, task_id):
    assert run_oracle(env, task_id) == (1.0, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("task_id", ALL_TASKS)
def test_every_shipped_task(env, task_id):
    assert run_oracle(env, task_id) == (1.0, 0.0)


def test_observation_and_bad_actions_keep_the_env_working(env):
    obs, info = env.reset(options={"task": "osworld/terminal-mkdir-projects"})
    assert obs["screenshot"].shape == (1080, 1920, 3) and obs["screenshot"].dtype == np.uint8
    assert env.observation_space["screenshot"].contains(obs["screenshot"])
    assert obs["instruction"] == info["instruction"]
    for bad, why in [("1/0", "ZeroDivisionError"), ("pyautogui.press('nokey')", "nokey"),
                     ("def (:", "SyntaxError"), ({"action_type": "CLICK"}, "code string"),
                     ("import time; time.sleep(5)", "time limit")]:
        if "sleep" in bad:
            env.unwrapped.action_timeout = 1.0
        _, reward, terminated, _, info = env.step(bad)
        env.unwrapped.action_timeout = 60.0
        assert why in info["error"] and not terminated and reward == 0.0
    _, _, _, _, info = env.step("pyautogui.write('echo still-here\\n')")
    assert "error" not in info
    time.sleep(0.5)
    assert "still-here" in env.unwrapped.terminal_output()


def test_terminal_observation_waits_until_the_transcript_is_quiet(env):
    """A transcript still being written (as right after typed keys) is read once it settles:
    lines arriving 100 ms apart for 0.6 s are all in the observation taken at their start."""
    from bunshin_gym.envs.osworld import desktop

    env.reset(options={"task": "osworld/terminal-mkdir-projects"})
    env.unwrapped.workspace.spawn(
        ["sh", "-c", f"for i in 1 2 3 4 5 6; do echo quiet-$i >> {desktop.TERMINAL_LOG}; sleep 0.1; done"])
    assert "quiet-6" in env.unwrapped.terminal_output()


def test_every_font_directory_is_cached_by_the_image(env):
    """An app scanning fonts finds the image's system cache valid and writes no per-user cache:
    otherwise the first app to scan writes ~/.fontconfig at a timing-dependent moment, and two
    runs of one task end with different home directories."""
    out = env.unwrapped.workspace.exec(
        "d=$(mktemp -d) && HOME=$d XDG_CACHE_HOME=$d/.cache fc-list >/dev/null && find $d -type f; rm -rf $d",
        user="user")
    assert out.text.strip() == "", f"fontconfig wrote a per-user cache: {out.text}"


def test_computer_13_actions():
    e = make(action_space="computer_13", require_terminal=True)
    try:
        e.reset(options={"task": "osworld/terminal-mkdir-projects"})
        _, _, _, _, info = e.step({"action_type": "TYPING", "text": "mkdir ~/projects"})
        assert "error" not in info
        assert "error" in e.step({"action_type": "MOVE_TO", "x": 99999, "y": 1})[4]
        assert "error" in e.step({"action_type": "PRESS", "key": "no-such-key"})[4]
        assert "error" in e.step("pyautogui.press('enter')")[4]
        for a in ({"action_type": "PRESS", "key": "enter"}, {"action_type": "MOVE_TO", "x": 300, "y": 300},
                  {"action_type": "CLICK", "x": 300, "y": 300}, {"action_type": "SCROLL", "dy": -2},
                  {"action_type": "HOTKEY", "keys": ["ctrl", "l"]}, {"action_type": "WAIT"}):
            _, _, terminated, _, info = e.step(a)
            assert "error" not in info and not terminated, (a, info)
        _, reward, terminated, _, _ = e.step({"action_type": "DONE"})
        assert terminated and reward == 1.0
    finally:
        e.close()


def test_accessibility_tree_of_an_editor():
    e = make(require_a11y_tree=True)
    try:
        obs, _ = e.reset(options={"task": "osworld/editor-append-item"})
        tree = obs["accessibility_tree"]
        assert tree.startswith("<desktop-frame") and 'name="mousepad"' in tree.lower()
        assert "- eggs" in tree  # the text of the document
        obs, *_ = e.step("pyautogui.press('shift')")
        timing = e.unwrapped.last_step_timing  # the tree's part of the step, apart
        assert "- eggs" in obs["accessibility_tree"] and 0 < timing["tree_s"] < timing["step_s"]
    finally:
        e.close()


def test_rollback_returns_screen_and_files(env):
    env.reset(options={"task": "osworld/terminal-mkdir-projects"})
    before = env.unwrapped.screenshot()
    env.step("pyautogui.write('mkdir ~/projects; echo changed > ~/projects/f.txt\\n')")
    time.sleep(0.8)
    ws = env.unwrapped.workspace
    assert ws.exec("cat /home/user/projects/f.txt").text == "changed\n"
    assert not np.array_equal(env.unwrapped.screenshot(), before)
    obs = env.rollback()
    assert np.array_equal(obs["screenshot"], before)
    assert not ws.exec("test -e /home/user/projects").ok
    assert env.unwrapped.steps == 0


def test_clone_of_a_desktop_with_chromium(env):
    env.reset(options={"task": "osworld/chrome-open-about"})
    src = env.unwrapped
    time.sleep(1.0)
    shot = src.screenshot()
    [twin] = env.clone(1)
    try:
        assert np.array_equal(twin.unwrapped.screenshot(), shot)
        twin.step("pyautogui.hotkey('ctrl', 'l')")
        twin.step("pyautogui.write('http://localhost:8000/contact.html\\n')")
        deadline = time.monotonic() + 20
        while tasks.get_active_tab_info(twin.unwrapped, {})["url"].endswith("index.html"):
            assert time.monotonic() < deadline, "the clone's chromium did not navigate"
            time.sleep(0.3)
        assert not np.array_equal(twin.unwrapped.screenshot(), shot)
        assert np.array_equal(src.screenshot(), shot)
        assert tasks.get_active_tab_info(src, {})["url"] == "http://localhost:8000/index.html"
    finally:
        twin.close()


def test_chromium_runs_one_browser_process_without_zygotes_gpu_or_network_processes(env, check_chromium_processes):
    env.reset(options={"task": "osworld/chrome-open-about"})
    check_chromium_processes(env.unwrapped.workspace)


@pytest.mark.slow
def test_chromium_in_a_share_clone_survives_two_minutes(env):
    env.reset(options={"task": "osworld/chrome-open-about"})
    [twin] = env.clone(1, mode="share")
    try:
        t = twin.unwrapped
        t._max_steps = 10**6  # a soak, not an episode
        pages = ["about.html", "contact.html", "search.html", "index.html", "ads.html"]
        deadline = time.monotonic() + 120
        i = 0
        while time.monotonic() < deadline:
            page = pages[i % len(pages)]
            t.step("pyautogui.hotkey('ctrl', 'l')")
            t.step(f"pyautogui.write('http://localhost:8000/{page}\\n')")
            time.sleep(0.5)
            t.step("pyautogui.scroll(-5, x=600, y=500)")
            if page == "search.html":
                t.step(f"pyautogui.write('query {i}\\n')")
            t.step("pyautogui.scroll(5, x=600, y=500)")
            i += 1
        assert i > 20
        time.sleep(1.0)
        info = tasks.get_active_tab_info(t, {})
        assert info is not None and info["url"].startswith("http://localhost:8000/")
        assert t.workspace.exec("pgrep -c chromium").text.strip() not in ("", "0")
        t.step("pyautogui.hotkey('ctrl', 'l')")
        t.step("pyautogui.write('http://localhost:8000/about.html\\n')")
        deadline = time.monotonic() + 20
        while tasks.get_active_tab_info(t, {})["url"] != "http://localhost:8000/about.html":
            assert time.monotonic() < deadline, "chromium stopped answering in the clone"
            time.sleep(0.3)
    finally:
        twin.close()
