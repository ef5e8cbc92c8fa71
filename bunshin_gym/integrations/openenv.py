"""OpenEnv: an ``Environment`` server per env family, for OpenEnv's own clients.

OpenEnv (``openenv-core``) serves an ``Environment`` (``reset``, ``step``, ``state``) over
HTTP and WebSocket; each WebSocket session gets its own instance, so concurrent sessions are
concurrent episodes. Here an instance is one bunshin episode; sessions that reset to the
same task clone the first one's set-up (the group logic of :mod:`bunshin_gym.integrations.trl`).

Serve (any ASGI server; uvicorn is in the ``serve`` extra)::

    from bunshin_gym.integrations.openenv import create_app
    app = create_app("Bunshin-Shell-v0", max_concurrent_envs=16)
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Drive with OpenEnv's client (typed :class:`BunshinEnvClient`, or its ``GenericEnvClient``)::

    with BunshinEnvClient(base_url="http://127.0.0.1:8000") as env:
        result = env.reset(task="shell/count-files")
        result = env.step(BunshinAction(action="ls /data | wc -l > answer.txt"))
        result = env.step(BunshinAction(action="DONE"))      # result.reward: the checker's score

An action is the env's own (a shell line, a computer_13 dict, a WebArena or BrowserGym
string); the observation is its text (``text``), with ``error`` set when the action failed.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field

from bunshin_gym.integrations.trl import BunshinEnvironment, environment_class


class BunshinAction(Action):
    """One env action: a shell command line, a computer_13 dict, or a web action string."""

    action: str | dict[str, Any] = Field(description="the env's action (e.g. 'ls /data', 'DONE', 'click [12]')")


class BunshinObservation(Observation):
    text: str = Field(default="", description="what the agent reads: the task and first observation, or the "
                      "action's output")
    task_id: str | None = Field(default=None, description="the episode's task")
    error: str = Field(default="", description="why the action failed ('' when it worked)")


class BunshinState(State):
    task_id: str | None = Field(default=None, description="the episode's task")


class BunshinOpenEnv(Environment):
    """A bunshin episode as an OpenEnv ``Environment`` (see the module docs); subclasses set
    ``member_class`` (use :func:`environment_for`)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance is its own workspace (or clone)
    member_class: type[BunshinEnvironment]

    def __init__(self) -> None:
        super().__init__()
        self.member = self.member_class()
        self._state = BunshinState(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, task: Any = None,
              **kwargs: Any) -> BunshinObservation:
        if task is None:
            raise ValueError("reset needs a task, e.g. reset(task='shell/count-files')")
        text = self.member.reset(task=task)
        if isinstance(text, list):  # a multimodal member: the text blocks
            text = "\n".join(b["text"] for b in text if b.get("type") == "text")
        self._state = BunshinState(episode_id=episode_id or uuid.uuid4().hex, step_count=0,
                                   task_id=self.member.task_id)
        return BunshinObservation(text=text, task_id=self.member.task_id, done=False, reward=0.0)

    def step(self, action: BunshinAction, timeout_s: float | None = None, **kwargs: Any) -> BunshinObservation:
        if self.member.env is None:
            raise ValueError("step before reset: call reset(task=...) first")
        self._state.step_count += 1
        text = self.member._act(action.action)
        if isinstance(text, list):
            text = "\n".join(b["text"] for b in text if b.get("type") == "text")
        error = text.split("\n", 1)[0].removeprefix("error: ") if text.startswith("error: ") else ""
        done = self.member._finished
        return BunshinObservation(text=text, task_id=self.member.task_id, error=error, done=done,
                                  reward=self.member.get_reward() if done else 0.0)

    @property
    def state(self) -> BunshinState:
        return self._state

    def close(self) -> None:
        self.member._close_env()


@functools.cache
def environment_for(env_id: str) -> type[BunshinOpenEnv]:
    """The OpenEnv ``Environment`` class of a bunshin env id (one class per family, made once)."""
    member = environment_class(env_id).configure()
    return type(f"{member.__name__}OpenEnv", (BunshinOpenEnv,), {"member_class": member})


def create_app(env_id: str, *, max_concurrent_envs: int = 8) -> Any:
    """OpenEnv's FastAPI app serving ``env_id`` (HTTP and WebSocket sessions)."""
    return create_fastapi_app(environment_for(env_id), BunshinAction, BunshinObservation,
                              max_concurrent_envs=max_concurrent_envs)


class BunshinEnvClient(EnvClient[BunshinAction, BunshinObservation, BunshinState]):
    """OpenEnv's ``EnvClient`` for the bunshin servers (one WebSocket session per instance)."""

    def _step_payload(self, action: BunshinAction) -> dict[str, Any]:
        return action.model_dump(exclude={"metadata"})

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[BunshinObservation]:
        obs = BunshinObservation(**payload.get("observation", {}), done=payload.get("done", False),
                                 reward=payload.get("reward"))
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> BunshinState:
        return BunshinState(**payload)
