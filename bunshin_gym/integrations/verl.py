"""verl agent loops: one bunshin workspace per trajectory, the group's set-up shared by clones.

verl's ``AgentLoopWorker`` instantiates one agent loop per trajectory (through its registry and
``hydra.utils.instantiate``) and awaits its ``run()``. Its stock ``tool_agent`` loop calls a
verl ``BaseTool`` with ``create`` / ``execute`` / ``release`` around *every* call, so a tool that
holds an environment gets a new one per call. The loops here keep one workspace for the whole
trajectory instead:

* the first trajectory of a group (same task, same verl ``uid``) sets the task up in a workspace
  that is never stepped; every member of the group, the first included, runs in a live clone of
  it (memory shared copy-on-write), so all members start from the same files, processes and
  memory, as the TRL integration does;
* the model's tools are the env family's actions (the methods of the TRL ``environment_factory``
  classes, their schemas built from the type hints and ``Args:`` docstrings); a tool's
  ``create``/``release`` are cheap handles, ``execute`` steps the trajectory's workspace;
* the trajectory ends when the env's episode ends, and its ``reward_score`` is the task checker's
  score (an unfinished episode is given up first, so the checker still scores it);
* the set-up workspace is closed when the last member of its group finishes, every member's
  workspace when its trajectory ends, an error included.

Registered names (verl config ``actor_rollout_ref.rollout.agent.default_agent_loop`` or a
dataset's ``agent_name`` column): ``bunshin_shell``, ``bunshin_osworld``, ``bunshin_webarena``.
The task comes from the dataset row: ``extra_info["task"]`` (or a ``task`` column): a task id,
a task dict or a path. Importing this module registers the loops.

verl's releases with an agent loop declare pins this project cannot take (0.9.1: transformers<5.11,
tensordict<=0.10), though the agent loop imports and runs beside them; install it with
``pip install --no-deps verl==0.9.1`` (see docs/integrations/verl.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
from omegaconf import OmegaConf
from transformers.utils import get_json_schema
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from bunshin_gym.integrations.trl import (
    BunshinEnvironment,
    DesktopEnvironment,
    ShellEnvironment,
    WebEnvironment,
    tool_methods,
)

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """The set-up workspace of a group and how many of its members are running."""

    setup: asyncio.Task  # resolves to the reset, never-stepped WorkspaceEnv
    members: int = 0
    clone_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class WorkspaceTool(BaseTool):
    """One action of the env family, bound to one trajectory's workspace.

    verl's tool loop calls ``create``, ``execute`` and ``release`` around every call; here
    ``create``/``release`` only hand out a call id, the workspace lives as long as the trajectory.
    """

    def __init__(self, loop: BunshinAgentLoop, name: str, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config={}, tool_schema=tool_schema)
        self._loop = loop
        self.name = name

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        member = self._loop.member
        if member is None:
            raise RuntimeError(f"{self.name}: the trajectory has no workspace (run() sets it up)")
        method = getattr(member, self.name)
        # workspace steps block (fork, exec, browser); verl runs every trajectory of a worker on
        # one event loop, so they run in a thread
        content = await asyncio.to_thread(method, **parameters)
        return tool_response(content), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def tool_response(content: str | list) -> ToolResponse:
    """verl's ToolResponse of what a family's tool returns (text, or image blocks and text)."""
    if isinstance(content, str):
        return ToolResponse(text=content)
    images = [b["image"] for b in content if b.get("type") == "image"]
    text = "\n".join(b["text"] for b in content if b.get("type") == "text")
    return ToolResponse(text=text, image=images or None)


def task_of(kwargs: dict[str, Any]) -> Any:
    """The task spec of a dataset row as verl hands it to ``run()``."""
    extra = kwargs.get("extra_info") or {}
    spec = extra.get("task") if isinstance(extra, dict) else None
    if spec is None:
        spec = kwargs.get("task")
    if spec is None:
        raise ValueError("a bunshin agent loop needs the row's task: extra_info['task'] or a 'task' column "
                         f"(got columns {sorted(kwargs)})")
    return spec


def with_first_observation(raw_prompt: Any, text: str) -> list[dict]:
    """The row's messages with the task's first observation appended to the last user message
    (as TRL appends what ``reset`` returns), or as a new user message."""
    messages = [dict(m) for m in raw_prompt]
    if messages and messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):
        sep = "" if not messages[-1]["content"] or messages[-1]["content"][-1].isspace() else "\n\n"
        messages[-1]["content"] += sep + text
    else:
        messages.append({"role": "user", "content": text})
    return messages


class BunshinAgentLoop(ToolAgentLoop):
    """verl's tool agent loop over one bunshin workspace per trajectory (see the module doc).

    Class attributes (subclass to change them):
        family: the TRL environment_factory class whose actions are the tools; a configured one
            (``ShellEnvironment.configure(cache=..., speculation=...)``) brings its wrappers.

    Tools configured in verl (``multi_turn.tool_config_path``) are not used: the tools are the
    env family's actions.
    """

    family: ClassVar[type[BunshinEnvironment]] = BunshinEnvironment
    # groups being run, by task and uid; touched only from the worker's event loop (verl runs all
    # trajectories of a worker as tasks of one loop), between awaits, so it needs no lock
    _groups: ClassVar[dict[str, _Group]] = {}

    def __init__(self, *args: Any, tools: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, tools=None, **kwargs)
        self.member: BunshinEnvironment | None = None
        probe = self.family()  # an instance without a workspace: its bound methods give the schemas
        self.tools = {}
        for method in tool_methods(probe):
            schema = OpenAIFunctionToolSchema.model_validate(get_json_schema(method))
            self.tools[method.__name__] = WorkspaceTool(self, method.__name__, schema)
        self.tool_schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for t in self.tools.values()]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        spec = task_of(kwargs)
        key = json.dumps({"env": self.family.env_id, "task": spec, "uid": kwargs.get("uid")}, sort_keys=True,
                         default=str)
        groups = type(self)._groups
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group(asyncio.ensure_future(asyncio.to_thread(self._set_up, spec)))
        group.members += 1
        try:
            self.member, first = await self._join(group)
            messages = with_first_observation(kwargs["raw_prompt"], tool_response(first).text)
            output = await super().run(sampling_params, **{**kwargs, "raw_prompt": messages})
            output.reward_score = await asyncio.to_thread(self.member.get_reward)
            base = self.member.env.unwrapped
            output.extra_fields["bunshin"] = {"task_id": self.member.task_id, "workspace": base.workspace.id,
                                              "steps": base.steps}
            return output
        finally:
            member, self.member = self.member, None
            if member is not None:
                await asyncio.to_thread(member._close_env)
            group.members -= 1
            if group.members == 0:
                if groups.get(key) is group:
                    del groups[key]
                await _close_setup(group)

    async def _join(self, group: _Group) -> tuple[BunshinEnvironment, str | list]:
        """A member of the group: a clone of its set-up, and the first observation's content."""
        setup = await asyncio.shield(group.setup)
        async with group.clone_lock:  # one fork of the set-up at a time
            base = (await asyncio.to_thread(setup.clone, 1))[0]
        member = self.family()
        try:
            return member, member._adopt(base)
        except BaseException:
            base.close()
            raise

    def _set_up(self, spec: Any) -> Any:
        # the env itself, not gym.make's checking wrappers: the members are clones of it
        base = gym.make(self.family.env_id, **self.family.env_kwargs).unwrapped
        try:
            base.reset(options={"task": spec})
        except BaseException:
            base.close()
            raise
        return base

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        state = await super()._handle_processing_tools_state(agent_data)
        # the env ended the episode (done, or out of steps): nothing the model says next counts
        if self.member is not None and self.member._finished:
            return AgentState.TERMINATED
        return state


async def _close_setup(group: _Group) -> None:
    if not group.setup.done():
        await asyncio.wait([group.setup])
    if group.setup.cancelled() or group.setup.exception() is not None:
        return
    await asyncio.to_thread(group.setup.result().close)


@register("bunshin_shell")
class ShellAgentLoop(BunshinAgentLoop):
    """Bunshin-Shell-v0: tools ``shell(command)`` and ``done()``."""

    family = ShellEnvironment


@register("bunshin_osworld")
class DesktopAgentLoop(BunshinAgentLoop):
    """Bunshin-OSWorld-v0 in the computer_13 action space (click, type_text, press, ...)."""

    family = DesktopEnvironment


@register("bunshin_webarena")
class WebAgentLoop(BunshinAgentLoop):
    """Bunshin-WebArena-v0: click, type_text, goto, go_back, scroll, stop."""

    family = WebEnvironment


AGENT_LOOPS: dict[str, type[BunshinAgentLoop]] = {
    "bunshin_shell": ShellAgentLoop, "bunshin_osworld": DesktopAgentLoop, "bunshin_webarena": WebAgentLoop}


def write_agent_loop_config(path: str | Path) -> Path:
    """Write the file verl reads from ``actor_rollout_ref.rollout.agent.agent_loop_config_path``:
    verl's workers (Ray actors that never import this module) then register the loops by name
    and import them through ``_target_``."""
    path = Path(path)
    entries = [{"name": name, "_target_": f"{cls.__module__}.{cls.__qualname__}"} for name, cls in AGENT_LOOPS.items()]
    OmegaConf.save(OmegaConf.create(entries), path)
    return path
