"""Fixtures of the explorer tests: runs recorded by the real rollout engine (shell groups, a
desktop group), the explorer served by uvicorn on a loopback port, and a real headless
chromium driven by playwright.

The host has no browser of its own; the web workspace image that set-up builds holds Debian's
chromium (the one the web env drives), a bookworm binary like the host: it runs on the host
with the image's libraries on its library path.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym import config
from bunshin_gym.rollout import PrefixCache, SpecToolSelector, Speculation, StepLog, TrajectoryLog, signature

REPO = Path(__file__).resolve().parents[2]
#: the committed screenshots of the page (bench/results/explore) are refreshed on purpose only:
#: ``BUNSHIN_EXPLORE_SHOTS=bench/results/explore .venv/bin/python -m pytest tests/explore/test_page.py``

# the shell run: what each member of a group does (member i plays PLANS[i])
COUNT_FILES = [["ls /data", "ls /data | wc -l > answer.txt", "DONE"],
               ["ls  /data", "ls /data | wc -l > answer.txt", "DONE"],  # same call as m0's (blanks)
               ["ls /data", "echo 0 > answer.txt", "DONE"],
               ["pwd", "DONE"]]
MAKE_DIR = [["mkdir -p /home/user/projects/alpha", "DONE"],
            ["mkdir /home/user/projects/alpha", "DONE"],  # no parent directory: fails, reward 0
            ["mkdir -p /home/user/projects/alpha", "DONE"],
            ["DONE"]]
#: (epoch, task, plans, nodes of its tree, steps served by the prefix cache, rewards)
SHELL_GROUPS = [
    ("epoch 1", "shell/count-files", COUNT_FILES, 7, 4, [1.0, 1.0, 0.0, 0.0]),
    ("epoch 1", "shell/make-dir", MAKE_DIR, 5, 2, [1.0, 0.0, 1.0, 0.0]),
    # the same group again: the prefix cache (kept across epochs) serves every call
    ("epoch 2", "shell/count-files", COUNT_FILES, 7, 11, [1.0, 1.0, 0.0, 0.0]),
]

DESKTOP_PLANS = [["pyautogui.click(300, 200)", "pyautogui.write('mkdir ~/projects\\n')", "DONE"],
                 ["pyautogui.click(300, 200)", "DONE"]]


#: the speculation run: a slow call the selector has seen before, made after 4 s of "thinking"
SLOW = "sleep 1; echo done > /home/user/spec.txt; cat /home/user/spec.txt"


def record_groups(run_dir: Path, env_id: str, groups: list[tuple], G: int, *, think_s: float = 0.0,
                  **env_kwargs) -> tuple:
    """Run ``groups`` ((epoch, task, plans, ...) each) through one GroupVectorEnv with the prefix
    cache and the step log; returns (group env, cache, trajectories per group). The caller
    closes the env and clears the cache. ``think_s``: how long the policy takes over its first
    call (what speculation overlaps)."""
    steps = StepLog(run_dir)
    cache = PrefixCache(run_dir / "prefix-cache", log=TrajectoryLog(run_dir / "trajectories.jsonl"))
    envs = gym.make_vec(env_id, num_envs=G, vectorization_mode="vector_entry_point", cache=cache,
                        step_log=steps, **env_kwargs)

    def policy(plans: list[list[str]], i: int, hist: list) -> str:
        if not hist:
            time.sleep(think_s)
        return plans[i][len(hist)]

    out = []
    try:
        for epoch, task, plans, *_ in groups:
            steps.epoch = epoch
            out.append(envs.run_group(lambda i, obs, hist, plans=plans: policy(plans, i, hist), options={"task": task}))
        steps.flush()
    except BaseException:
        envs.close()
        cache.clear()
        raise
    return envs, cache, out


@pytest.fixture(scope="session")
def shell_run(tmp_path_factory):
    """A run of three real shell groups (G=4), recorded by the rollout engine: (dir, trajectories)."""
    run_dir = tmp_path_factory.mktemp("runs") / "shell-run"
    envs, cache, trajs = record_groups(run_dir, "Bunshin-Shell-v0", SHELL_GROUPS, 4)
    envs.close()
    cache.clear()
    return run_dir, trajs


@pytest.fixture(scope="package")  # its desktops live until the explore tests end, not the session
def desktop_run(tmp_path_factory):
    """A real desktop group (G=2, pyautogui clicks and typing, screenshots, accessibility tree,
    terminal), recorded by the rollout engine; its workspaces stay up for the live view.
    Yields (dir, group env, trajectories)."""
    run_dir = tmp_path_factory.mktemp("runs") / "desktop-run"
    envs, cache, trajs = record_groups(run_dir, "Bunshin-OSWorld-v0",
                                       [("epoch 1", "osworld/terminal-mkdir-projects", DESKTOP_PLANS)], 2,
                                       action_space="pyautogui", require_a11y_tree=True, require_terminal=True)
    try:
        yield run_dir, envs, trajs[0]
    finally:
        envs.close()
        cache.clear()


@pytest.fixture(scope="session")
def speculation_run(tmp_path_factory):
    """A real shell group (G=1) whose slow first call is run by speculation in a fork while the
    policy thinks, and adopted: (dir, trajectories)."""
    run_dir = tmp_path_factory.mktemp("runs") / "spec-run"
    # what the selector learns from: earlier episodes of the task (SLOW took 1 s, DONE nothing)
    entries = [{"task": "shell/make-dir", "episode": f"e{r}", "depth": d, "signature": signature(a), "action": a,
                "duration": t} for r in range(5) for d, (a, t) in enumerate([(SLOW, 1.0), ("DONE", 0.01)])]
    spec = Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries), min_duration=0.5)
    envs, cache, trajs = record_groups(run_dir, "Bunshin-Shell-v0", [("epoch 1", "shell/make-dir", [[SLOW, "DONE"]])],
                                       1, think_s=4.0, speculation=spec)
    envs.close()
    cache.clear()
    return run_dir, trajs[0]


class Explorer:
    """The explorer app served by uvicorn in a thread, on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="explorer")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the explorer did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


@pytest.fixture
def explorer():
    """``explorer(run=..., runs_root=...)`` serves an explorer; all are stopped at the end."""
    from bunshin_gym.explore import create_app

    started: list[Explorer] = []

    def start(*args, **kwargs) -> Explorer:
        started.append(Explorer(create_app(*args, **kwargs)))
        return started[-1]

    yield start
    for e in started:
        e.close()


def host_chromium() -> tuple[str, dict]:
    """(chromium binary, environment) of the web image's chromium, run on the host."""
    from bunshin_gym.workspace.images import ImageStore

    image = ImageStore(log=lambda *a: None).get("webarena")
    exe = image / "usr/lib/chromium/chromium"
    if not exe.exists():
        raise FileNotFoundError(f"{exe}: the web image has no chromium (rebuild it: bunshin image build webarena)")
    libs = [image / d for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu",
                                "usr/lib/x86_64-linux-gnu/pulseaudio")]
    return str(exe), {**os.environ, "LD_LIBRARY_PATH": ":".join(map(str, libs)),
                      "FONTCONFIG_FILE": str(image_fonts(image))}


def image_fonts(image: Path) -> Path:
    """A fontconfig file naming the image's fonts, for its chromium run on the host: a host
    without fonts (a fresh Debian 12 server) has no fontconfig set-up, and chromium then
    aborts on the first text it lays out (SkFontMgr_FontConfigInterface: "Not implemented")."""
    import tempfile

    conf = Path(tempfile.mkdtemp(prefix="bunshin-explore-fonts-"))  # private: not a fixed name in /tmp
    (conf / "fonts.conf").write_text(
        '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">\n<fontconfig>\n'
        f'  <dir>{image / "usr/share/fonts"}</dir>\n  <cachedir>{conf / "cache"}</cachedir>\n'
        f'  <include ignore_missing="yes">{image / "etc/fonts/conf.d"}</include>\n</fontconfig>\n')
    return conf / "fonts.conf"


# package scope: playwright's sync API keeps an event loop running in this thread while it is
# open, and later tests of the session (asyncio.run in the e2b SDK tests) must not see it
@pytest.fixture(scope="package")
def browser():
    from playwright.sync_api import sync_playwright

    exe, env = host_chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, env=env, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1500, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    """The folder the page's screenshots (and the 10k-step timing) go to: pytest's temporary
    folder, so a test run leaves the git tree as it was; ``BUNSHIN_EXPLORE_SHOTS`` names
    another (relative: to the repository), e.g. the committed ``bench/results/explore``."""
    wanted = config.get("BUNSHIN_EXPLORE_SHOTS")
    out = (REPO / wanted) if wanted else tmp_path_factory.mktemp("explore-shots")
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger(__name__).info("explorer screenshots: %s", out)
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("prefix-cache"))
    return dst
