"""Tool calls in the model's text, and the env actions they stand for.

The format is the one Qwen-style chat templates teach (and render for ``tools=``)::

    <tool_call>
    {"name": "shell", "arguments": {"command": "ls /data"}}
    </tool_call>

:func:`parse_tool_call` turns a turn's text into a :class:`ToolCall` or a :class:`ToolCallError`
(never raises): malformed output becomes an error observation for the model, not a crash.
An :class:`ActionAdapter` maps a call to the env's action (a shell line, ``DONE``, ...).

Example:
    >>> call = parse_tool_call('<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>')
    >>> SHELL.to_action(call)
    'ls'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolCallError:
    message: str  # what was wrong, shown to the model as the observation


def parse_tool_call(text: str) -> ToolCall | ToolCallError:
    """The first tool call in ``text`` (a model's turn, special tokens kept or not)."""
    m = _CALL.search(text)
    if m is None:
        return ToolCallError("no tool call found: reply with <tool_call>{\"name\": ..., \"arguments\": {...}}"
                             "</tool_call>")
    if not m.group(2):
        return ToolCallError("the tool call is not closed with </tool_call>")
    body = m.group(1).strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError("the tool call needs a \"name\" string")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError("the tool call's \"arguments\" is not a JSON object")
    if not isinstance(args, dict):
        return ToolCallError("the tool call's \"arguments\" is not a JSON object")
    return ToolCall(obj["name"], args)


def call_text(name: str, arguments: dict) -> str:
    """The text a model writes for a call (what the oracle's warm start teaches)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _fn(name: str, description: str, params: dict[str, str] | None = None) -> dict:
    props = {k: {"type": "string", "description": v} for k, v in (params or {}).items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(props)}}}


@dataclass
class ActionAdapter:
    """How one env family's actions look as tools.

    Attributes:
        tools: the tool schemas given to the chat template.
        give_up: the action that ends an episode the policy ran out of budget in (it is
            still scored by the env's checker).
    """

    tools: list[dict]
    give_up: Any = "FAIL"
    finish: dict[str, Any] = field(default_factory=lambda: {"done": "DONE", "fail": "FAIL"})

    def to_action(self, call: ToolCall) -> Any | ToolCallError:
        if call.name in self.finish:
            return self.finish[call.name]
        return self.convert(call)

    def convert(self, call: ToolCall) -> Any | ToolCallError:
        raise NotImplementedError

    def from_action(self, action: Any) -> tuple[str, dict]:
        """The (name, arguments) call for an env action (oracle solutions -> model text)."""
        raise NotImplementedError

    def env_oracle(self, actions: list) -> list | None:
        """A task's shipped oracle as actions of this adapter's env action space (None where
        it cannot be said there: its task then has no oracle episode)."""
        return list(actions)


class ShellAdapter(ActionAdapter):
    def convert(self, call: ToolCall) -> Any | ToolCallError:
        if call.name != "shell":
            return ToolCallError(f"unknown tool {call.name!r}: the tools are shell, done")
        cmd = call.arguments.get("command")
        if not isinstance(cmd, str) or not cmd.strip():
            return ToolCallError("shell needs a non-empty \"command\" string")
        return cmd

    def from_action(self, action: Any) -> tuple[str, dict]:
        for name, act in self.finish.items():
            if action == act:
                return name, {}
        return "shell", {"command": action}


class DictAdapter(ActionAdapter):
    """Envs whose actions are dicts (``{"action_type": "CLICK", "x": 10, ...}``): tool ``action``
    with the dict as its arguments."""

    def convert(self, call: ToolCall) -> Any | ToolCallError:
        if call.name != "action" or not isinstance(call.arguments.get("action_type"), str):
            return ToolCallError("call the tool \"action\" with an \"action_type\" and its arguments")
        return dict(call.arguments)

    def from_action(self, action: Any) -> tuple[str, dict]:
        for name, act in self.finish.items():
            if action == act:
                return name, {}
        return "action", dict(action)

    def env_oracle(self, actions: list) -> list | None:
        """The desktop's oracles are pyautogui code: each action as its computer_13 dicts."""
        from bunshin_gym.envs.osworld.oracle import to_computer_13

        out: list = []
        for action in actions:
            if isinstance(action, dict):
                out.append(action)
                continue
            try:
                out += [a["action_type"] if a["action_type"] in ("DONE", "FAIL") else a for a in to_computer_13(action)]
            except (ValueError, SyntaxError):
                return None
        return out


class WebAdapter(ActionAdapter):
    """The web env: tool ``browser`` with one action string, WebArena's (``click [12]``) or
    BrowserGym's (``click('12')``); ``stop [answer]`` / ``send_msg_to_user(...)`` end the episode."""

    def convert(self, call: ToolCall) -> Any | ToolCallError:
        action = call.arguments.get("action")
        if call.name != "browser" or not isinstance(action, str) or not action.strip():
            return ToolCallError("call the tool \"browser\" with an \"action\" string, e.g. click [12]")
        return action

    def from_action(self, action: Any) -> tuple[str, dict]:
        return "browser", {"action": action}


SHELL = ShellAdapter([
    _fn("shell", "Run a bash command in the workspace (as user, in /home/user); returns its output and exit code.",
        {"command": "the command line"}),
    _fn("done", "Say the task is complete."),
])
DESKTOP = DictAdapter([
    _fn("action", "Do one desktop action: action_type (CLICK, TYPING, PRESS, HOTKEY, SCROLL, ...) and its "
        "arguments (x, y, text, key, keys, ...).", {"action_type": "the action's type"}),
    _fn("done", "Say the task is complete."),
])
WEB = WebAdapter([
    _fn("browser", "Do one browser action: WebArena's (click [id], type [id] [text] [1], goto [url], scroll [down], "
        "stop [answer]) or BrowserGym's (click('id'), fill('id', 'text'), send_msg_to_user('answer')).",
        {"action": "the action string"}),
], give_up="stop [N/A]", finish={})
ADAPTERS = {"Bunshin-Shell-v0": SHELL, "Bunshin-OSWorld-v0": DESKTOP, "Bunshin-WebArena-v0": WEB}


def adapter_for(env_id: str) -> ActionAdapter:
    return ADAPTERS.get(env_id, SHELL)
