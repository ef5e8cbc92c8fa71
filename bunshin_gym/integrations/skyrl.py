"""SkyRL: the bunshin envs as ``skyrl_gym`` text envs, made with skyrl-gym's own ``make``.

Importing this module registers ``bunshin-shell``, ``bunshin-desktop`` and ``bunshin-web``
with ``skyrl_gym``. SkyRL's generator makes one env per sample with the dataset row's
``extras``, calls ``init(prompt)`` and then ``step(llm_output)`` until ``done``::

    import skyrl_gym, bunshin_gym.integrations.skyrl
    env = skyrl_gym.make("bunshin-shell", env_config={}, extras={"task": "shell/count-files", "max_turns": 6})
    prompt, info = env.init([{"role": "user", "content": "Solve the task with the tools."}])
    out = env.step('<tool_call>{"name": "shell", "arguments": {"command": "ls /data"}}</tool_call>')
    out["observations"], out["reward"], out["done"], out["metadata"]

The model's turn holds one tool call in the Qwen/Hermes format (:mod:`bunshin_gym.train.tools`);
malformed output gets an error observation and costs a turn. The episode ends when the env
ends it (DONE, ``stop``, its step cap) or after ``max_turns``; the last step's reward is the
task checker's score (an unfinished episode is ended with the give-up action first).

The samples of one prompt start from one workspace: the first env made for a task sets it up,
the next ones for the same task clone it (as :mod:`bunshin_gym.integrations.trl` does; this
module drives its environment classes).
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from bunshin_gym.integrations.trl import (
    BunshinEnvironment,
    DesktopEnvironment,
    ShellEnvironment,
    WebEnvironment,
)
from bunshin_gym.train.tools import DESKTOP, SHELL, WEB, ActionAdapter, ToolCallError, parse_tool_call


class BunshinTextEnv(BaseTextEnv):
    """One SkyRL trajectory in a bunshin env (see the module docs).

    Args:
        env_config: SkyRL's per-env-class config; ``max_turns`` (default 8) is read from it.
        extras: the dataset row's extras: ``task`` (required: a task id, dict or path; also read
            from ``extras["reward_spec"]["task"]``) and ``max_turns``.
    """

    environment: type[BunshinEnvironment] = ShellEnvironment
    adapter: ActionAdapter = SHELL

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = dict(extras or {})
        config = dict(env_config or {})
        self.task = extras.get("task", (extras.get("reward_spec") or {}).get("task"))
        if self.task is None:
            raise ValueError(f"{type(self).__name__} needs extras['task'] (a task id such as 'shell/count-files'); "
                             f"got extras keys {sorted(extras)}")
        self.max_turns = int(extras.get("max_turns", config.get("max_turns", 8)))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        self.member = self.environment()
        self.reward = 0.0

    def init(self, prompt: list[dict]) -> tuple[list[dict], dict[str, Any]]:
        """Set the task up (or clone the group's set-up) and append its instruction and first
        observation to the prompt's last user message."""
        first = self.member.reset(task=self.task)
        prompt = [dict(m) for m in prompt]
        if prompt and prompt[-1].get("role") == "user":
            prompt[-1]["content"] = f"{prompt[-1]['content']}\n\n{first}".lstrip()
        else:
            prompt.append({"role": "user", "content": first})
        return prompt, {"task_id": self.member.task_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        call = parse_tool_call(action)
        act = self.adapter.to_action(call) if not isinstance(call, ToolCallError) else call
        metadata: dict[str, Any] = {"task_id": self.member.task_id, "turn": self.turns}
        if isinstance(act, ToolCallError):
            text, metadata["error"] = f"error: {act.message}", act.message
        else:
            text = self.member._act(act)
            if isinstance(text, list):  # image blocks: a text env passes on the text only
                text = "\n".join(b["text"] for b in text if b.get("type") == "text")
        done = self.member._finished or self.turns >= self.max_turns
        reward = 0.0
        if done:
            reward = self.reward = self.member.get_reward()
            metadata["success"] = reward >= 1.0
        observations = [] if done else [{"role": "user", "content": text}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata=metadata,
                                     postprocessed_action=None)

    def get_metrics(self) -> dict[str, Any]:
        return {"reward": self.reward, "turns": self.turns}

    def close(self) -> None:
        self.member._close_env()


class ShellTextEnv(BunshinTextEnv):
    environment = ShellEnvironment
    adapter = SHELL


class DesktopTextEnv(BunshinTextEnv):
    environment = DesktopEnvironment
    adapter = DESKTOP


class WebTextEnv(BunshinTextEnv):
    environment = WebEnvironment
    adapter = WEB


ENV_IDS = {"bunshin-shell": ShellTextEnv, "bunshin-desktop": DesktopTextEnv, "bunshin-web": WebTextEnv}


def register() -> list[str]:
    """Register the envs with skyrl_gym (idempotent); their ids."""
    for env_id, cls in ENV_IDS.items():
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=f"{__name__}:{cls.__name__}")
    return list(ENV_IDS)


register()
