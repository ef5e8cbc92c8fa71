"""OSWorld's ``DesktopEnv`` interface over Bunshin-OSWorld-v0, so an OSWorld agent loop runs unchanged.

OSWorld (``desktop_env/desktop_env.py``) is driven as::

    env = DesktopEnv(action_space="pyautogui", screen_size=(1920, 1080), require_a11y_tree=True)
    obs = env.reset(task_config=example)            # example: an OSWorld task dict
    obs, reward, done, info = env.step(action, pause)  # reward is always 0
    score = env.evaluate()                          # the task's evaluator

and this class is driven the same way: the observation is OSWorld's dict (``screenshot`` as
PNG bytes, ``accessibility_tree`` and ``terminal`` as text or None when not required,
``instruction``), ``step`` returns OSWorld's tuple with ``info`` ``{"done": True}`` after
DONE and ``{"fail": True}`` after FAIL, and only DONE/FAIL end the episode (OSWorld's runner
caps steps itself). The VM arguments (``provider_name``, ``path_to_vm``, ``snapshot_name``,
``region``, ``headless``, ``os_type``, ``enable_proxy``, ``client_password``) are accepted and
have no effect: the desktop is a bunshin workspace. ``clone(n)`` forks the live desktop.

Example:
    >>> from bunshin_gym.compat.osworld import DesktopEnv
    >>> env = DesktopEnv(action_space="pyautogui", require_a11y_tree=False)
    >>> obs = env.reset(task_config=json.load(open("terminal-mkdir-projects.json")))
    >>> obs, reward, done, info = env.step("pyautogui.write('mkdir ~/projects\\\\n')", pause=0.5)
    >>> env.step("DONE"); env.evaluate()
    1.0
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import numpy as np
from PIL import Image

from bunshin_gym.envs.osworld.env import OSWorldEnv

log = logging.getLogger(__name__)

#: no step cap of its own: OSWorld's runners stop after their max_steps
UNCAPPED = 1 << 30


def png_bytes(screenshot: np.ndarray) -> bytes:
    """A screenshot array as the PNG bytes OSWorld's controller returns (agents base64 them)."""
    buf = io.BytesIO()
    Image.fromarray(np.asarray(screenshot, dtype=np.uint8)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class DesktopEnv:
    """OSWorld's ``DesktopEnv`` (see the module docs); ``**env_kwargs`` go to
    :class:`~bunshin_gym.envs.osworld.env.OSWorldEnv` (``memory_mode``, ``limits``, ...)."""

    def __init__(self, provider_name: str = "bunshin", region: str | None = None, path_to_vm: str | None = None,
                 snapshot_name: str = "init_state", action_space: str = "computer_13", cache_dir: str = "cache",
                 screen_size: tuple[int, int] = (1920, 1080), headless: bool = True, require_a11y_tree: bool = True,
                 require_terminal: bool = False, os_type: str = "Ubuntu", enable_proxy: bool = False,
                 client_password: str = "password", *, _env: OSWorldEnv | None = None, **env_kwargs: Any):
        ignored = {k: v for k, v in (("provider_name", provider_name), ("path_to_vm", path_to_vm),
                                     ("region", region), ("os_type", os_type)) if v not in (None, "bunshin", "Ubuntu")}
        if ignored:
            log.info("DesktopEnv: %s have no effect (the desktop is a bunshin workspace)", ", ".join(ignored))
        self.action_space = action_space
        self.screen_size = (int(screen_size[0]), int(screen_size[1]))
        self.require_a11y_tree = require_a11y_tree
        self.require_terminal = require_terminal
        self.cache_dir = cache_dir
        self.snapshot_name = snapshot_name
        self.client_password = client_password
        env_kwargs.setdefault("max_steps", UNCAPPED)
        self.env = _env or OSWorldEnv(action_space=action_space, screen_size=self.screen_size,
                                      require_a11y_tree=require_a11y_tree, require_terminal=require_terminal,
                                      cache_dir=cache_dir if cache_dir and os.path.isdir(cache_dir) else None,
                                      **env_kwargs)
        self.instruction: str | None = None
        self.action_history: list[Any] = []
        self._step_no = 0
        self._score: float | None = None  # the evaluator's score, once the episode ended

    # OSWorld's API --------------------------------------------------------------------------
    def reset(self, task_config: dict | None = None, seed: int | None = None, options: dict | None = None) -> dict:
        """Set the task up (an OSWorld task dict, or a shipped task id); the first observation."""
        if task_config is None and self.env.task is None:
            raise ValueError("DesktopEnv.reset needs a task_config (an OSWorld task dict) on the first reset")
        spec = task_config if task_config is not None else self.env.task
        obs, info = self.env.reset(seed=seed, options={**(options or {}), "task": spec})
        self.instruction = info["instruction"]
        self.action_history, self._step_no, self._score = [], 0, None
        return self._obs(obs)

    def step(self, action: Any, pause: float = 2) -> tuple[dict, float, bool, dict]:
        """One action (a pyautogui code string or a computer_13 dict, or WAIT/FAIL/DONE); then
        ``pause`` seconds before the observation, as OSWorld does. Reward 0: call evaluate()."""
        self._step_no += 1
        self.action_history.append(action)
        self.env.settle = self.env.wait_seconds = max(0.0, float(pause))
        obs, reward, terminated, truncated, step_info = self.env.step(action)
        special = self.env.last_action
        info: dict = {"done": True} if special == "DONE" else {"fail": True} if special == "FAIL" else {}
        if "error" in step_info:
            info["error"] = step_info["error"]  # bunshin's: OSWorld raises or logs instead
        done = terminated or truncated
        if done:
            self._score = float(reward)
        return self._obs(obs), 0, done, info

    def evaluate(self) -> float:
        """The task's evaluator on the current state (for an ended episode, its score then)."""
        if self.env.task is None:
            raise ValueError("DesktopEnv.evaluate: no task (reset(task_config) first)")
        if self._score is not None:
            return self._score
        return float(self.env.task.validate(self.env))

    def render(self, mode: str = "rgb_array") -> bytes:
        """The screen as PNG bytes (what OSWorld's render returns)."""
        return png_bytes(self.env.screenshot())

    def close(self) -> None:
        self.env.close()

    @property
    def vm_screen_size(self) -> tuple[int, int]:
        return self.screen_size

    # bunshin's extra: forks -----------------------------------------------------------------
    def clone(self, n: int = 1) -> list[DesktopEnv]:
        """``n`` live forks of this desktop, each an independent ``DesktopEnv`` at this step."""
        out = []
        for env in self.env.clone(n):
            twin = DesktopEnv(action_space=self.action_space, screen_size=self.screen_size,
                              require_a11y_tree=self.require_a11y_tree, require_terminal=self.require_terminal,
                              _env=env)
            twin.instruction, twin.action_history = self.instruction, list(self.action_history)
            twin._step_no, twin._score = self._step_no, self._score
            out.append(twin)
        return out

    def __enter__(self) -> DesktopEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _obs(self, obs: dict) -> dict:
        return {
            "screenshot": png_bytes(obs["screenshot"]),
            "accessibility_tree": obs["accessibility_tree"] if self.require_a11y_tree else None,
            "terminal": obs["terminal"] if self.require_terminal else None,
            "instruction": self.instruction,
        }
