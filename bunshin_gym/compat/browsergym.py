"""BrowserGym's interface over the web env: its observation dict and high-level actions.

Importing this module registers one gymnasium id per shipped web task,
``browsergym/bunshin.shop.<n>`` (``webarena/<n>``), as BrowserGym's own packages register
``browsergym/webarena.<n>``. A BrowserGym agent's loop then runs unchanged::

    import gymnasium as gym, bunshin_gym.compat.browsergym
    from browsergym.utils.obs import flatten_axtree_to_str

    env = gym.make("browsergym/bunshin.shop.1001")
    obs, info = env.reset()
    prompt = obs["goal_object"], flatten_axtree_to_str(obs["axtree_object"])
    obs, reward, terminated, truncated, info = env.step("click('12')")
    obs, reward, terminated, truncated, info = env.step("send_msg_to_user('$25.99')")

Observation keys: ``chat_messages``, ``goal``, ``goal_object``, ``open_pages_urls``,
``open_pages_titles``, ``active_page_index``, ``url``, ``screenshot``, ``dom_object``
(None: the env does not serialise the DOM), ``axtree_object`` (Chrome's AX-tree form, node
``browsergym_id`` = the tree id), ``extra_element_properties`` (empty), ``focused_element_bid``,
``last_action``, ``last_action_error``, ``elapsed_time``. Actions: BrowserGym's high-level
calls (:data:`~bunshin_gym.envs.webarena.actions.BROWSERGYM_FUNCTIONS`) and WebArena's own
strings. ``send_msg_to_user`` answers and ends the episode, scored by the task's evaluator.
``clone``, ``snapshot`` and ``rollback`` reach the web env underneath.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

from bunshin_gym.envs.webarena.env import WebArenaEnv
from bunshin_gym.envs.webarena.observation import axtree_object
from bunshin_gym.envs.webarena.tasks import shipped_task_ids

ID_PREFIX = "browsergym/bunshin.shop."
GREETING = "Hi! I am your UI assistant, I can perform web tasks for you. What can I help you with?"


class BrowserGymEnv(gym.Env):
    """A :class:`~bunshin_gym.envs.webarena.env.WebArenaEnv` seen as a BrowserGym ``BrowserEnv``.

    Args:
        task: the task (``webarena/<n>``, a WebArena config dict or a path); ``reset``
            may also take ``options={"task": ...}``.
        env: an existing web env to wrap (a clone, say) instead of making one.
        **env_kwargs: for :class:`WebArenaEnv` (``viewport``, ``memory_mode``, ...); screenshots are on.
    """

    metadata = {"render_modes": []}

    def __init__(self, task: Any = None, *, env: WebArenaEnv | None = None, **env_kwargs: Any):
        env_kwargs.setdefault("screenshot", True)
        self.env = env if env is not None else WebArenaEnv(task, **env_kwargs)
        self.observation_space = gym.spaces.Dict({})  # BrowserGym's own space is an unchecked dict too
        self.action_space = self.env.action_space
        self.chat_messages: list[dict] = []
        self.last_action = ""
        self._start = time.time()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._start = time.time()
        self.last_action = ""
        self.chat_messages = [{"role": "assistant", "timestamp": self._start, "message": GREETING},
                              {"role": "user", "timestamp": self._start, "message": info["instruction"]}]
        return self._obs(obs), {"task_info": {"task_id": info["task_id"]}, "task_id": info["task_id"]}

    def step(self, action: str) -> tuple[dict, float, bool, bool, dict]:
        t0 = time.time()
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.last_action = action
        answer = info.get("answer")
        if answer is not None:  # send_msg_to_user / report_infeasible / stop: the chat shows it
            self.chat_messages.append({"role": "assistant", "timestamp": time.time(), "message": answer})
        info = {**info, "action_exec_start": t0, "action_exec_stop": time.time(),
                "task_info": {"task_id": self.env.task.id if self.env.task else None}}
        return self._obs(obs), float(reward), terminated, truncated, info

    def close(self) -> None:
        self.env.close()

    # fork API of the env underneath ---------------------------------------------------------
    def clone(self, n: int = 1) -> list[BrowserGymEnv]:
        out = []
        for env in self.env.clone(n):
            twin = BrowserGymEnv(env=env)
            twin.chat_messages, twin.last_action = [dict(m) for m in self.chat_messages], self.last_action
            twin._start = self._start
            out.append(twin)
        return out

    def snapshot(self, **kwargs: Any) -> Any:
        return self.env.snapshot(**kwargs)

    def rollback(self, snapshot: Any = None) -> dict:
        return self._obs(self.env.rollback(snapshot))

    def _obs(self, obs: dict) -> dict:
        tabs = self.env.open_tabs
        tree = axtree_object(obs["accessibility_tree"])
        focused = next((n["browsergym_id"] for n in tree["nodes"]
                        if any(p["name"] == "focused" for p in n["properties"])), "")
        goal = obs["instruction"]
        return {
            "chat_messages": [dict(m) for m in self.chat_messages],
            "goal": goal,
            "goal_object": [{"type": "text", "text": goal}],
            "open_pages_urls": tuple(t.get("url", "") for t in tabs),
            "open_pages_titles": tuple(t.get("title", "") for t in tabs),
            "active_page_index": np.asarray([self.env.active_tab]),
            "url": obs["url"],
            "screenshot": obs.get("screenshot"),
            "dom_object": None,
            "axtree_object": tree,
            "extra_element_properties": {},
            "focused_element_bid": focused,
            "last_action": self.last_action,
            "last_action_error": obs["last_action_error"],
            "elapsed_time": np.asarray([time.time() - self._start]),
        }


def _entry(task_id: str):
    def make(**kwargs: Any) -> BrowserGymEnv:
        return BrowserGymEnv(task_id, **kwargs)

    return make


def register() -> list[str]:
    """Register ``browsergym/bunshin.shop.<n>`` for every shipped web task (idempotent); the ids."""
    ids = []
    for task_id in shipped_task_ids():
        env_id = ID_PREFIX + task_id.split("/", 1)[1]
        if env_id not in gym.registry:
            # no default wrappers: the web env enforces order and truncation itself
            gym.register(env_id, entry_point=_entry(task_id), disable_env_checker=True, order_enforce=False)
        ids.append(env_id)
    return ids


IDS = register()
