"""TRL's ``environment_factory``: one class per env family, its public methods the agent's tools.

TRL (``GRPOTrainer(environment_factory=...)``) builds instances with no argument, pools them
and, before every batch, calls ``reset(**row)`` on one instance per rollout, in the order of
the batch: the ``num_generations`` rollouts of a prompt come one after the other. The model's
tool calls then call the instance's public methods, and ``get_reward()`` scores the rollout.

A GRPO group must start from one state. Here the first member of a group (the first reset
with a given row) sets the task up in a workspace and keeps that state (the env's reset
snapshot); every next reset with the same row clones it (a live fork: memory shared
copy-on-write), so all members see the same files, processes and memory. With a
:class:`~bunshin_gym.rollout.PrefixCache` and :class:`~bunshin_gym.rollout.Speculation`
configured, tool calls seen before are served from snapshots and slow ones are speculated.

Example:
    >>> from trl import GRPOConfig, GRPOTrainer
    >>> from bunshin_gym.integrations.trl import ShellEnvironment, task_rows
    >>> trainer = GRPOTrainer(model, args=GRPOConfig(num_generations=4, ...), processing_class=tok,
    ...                       train_dataset=task_rows("Bunshin-Shell-v0", ["shell/count-files"]),
    ...                       environment_factory=ShellEnvironment)
    >>> trainer.train(); ShellEnvironment.close_all()

Only tools, ``reset`` and ``get_reward`` are public functions: TRL exposes every other public
function as a tool, so set-up (``configure``) and clean-up (``close_all``) are classmethods.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium as gym

import bunshin_gym  # noqa: F401 - registers the env ids
from bunshin_gym.train.observations import render

log = logging.getLogger(__name__)


class BunshinEnvironment:
    """Base of the per-family classes; not given to TRL itself (it has no tools).

    Class attributes (set them with :meth:`configure`, which returns a subclass):
        env_id: the gymnasium id of the family.
        give_up: the action that ends an unfinished episode so its checker scores it.
        env_kwargs: keyword arguments of ``gym.make``.
        cache, speculation: rollout wrappers applied to every member (optional).
        multimodal: tools return the screenshot as an image block beside the text.
        max_chars: tail of an observation's text the model reads.
    """

    env_id: ClassVar[str] = ""
    give_up: ClassVar[Any] = "FAIL"
    env_kwargs: ClassVar[dict] = {}
    cache: ClassVar[Any] = None
    speculation: ClassVar[Any] = None
    multimodal: ClassVar[bool] = False
    max_chars: ClassVar[int] = 1500
    # per configured class (set by __init_subclass__): the group being formed and the live instances
    _group: ClassVar[tuple[str, Any] | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _instances: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._group, cls._lock, cls._instances = None, threading.Lock(), weakref.WeakSet()

    def __init__(self) -> None:
        self._env: Any = None  # the member's env, wrappers included
        self._base: Any = None  # the WorkspaceEnv inside it
        self._reward = 0.0
        self._finished = False
        self.task_id: str | None = None
        type(self)._instances.add(self)

    # set-up and clean-up (classmethods: TRL would expose a public method as a tool) ---------
    @classmethod
    def configure(cls, *, cache: Any = None, speculation: Any = None, multimodal: bool | None = None,
                  **env_kwargs: Any) -> type[BunshinEnvironment]:
        """A subclass whose instances use these rollout wrappers and ``gym.make`` arguments
        (its zero-argument constructor is what TRL calls)."""
        attrs: dict[str, Any] = {"env_kwargs": {**cls.env_kwargs, **env_kwargs}, "cache": cache,
                                 "speculation": speculation}
        if multimodal is not None:
            attrs["multimodal"] = multimodal
        return type(cls.__name__, (cls,), attrs)

    @classmethod
    def close_all(cls) -> None:
        """Close the workspaces of every instance of this class (TRL never closes its pool)."""
        for cls_ in [cls, *_subclasses(cls)]:
            with cls_._lock:
                cls_._group = None
                instances = list(cls_._instances)
            for inst in instances:
                inst._close_env()

    # TRL's contract ------------------------------------------------------------------------
    def reset(self, **row: Any) -> str:
        """Start a rollout of the row's task (column ``task``: a task id, dict or path); the
        returned text (the first observation) is appended to the prompt."""
        spec = row.get("task")
        if spec is None:
            raise ValueError(f"{type(self).__name__}.reset needs a 'task' column in the dataset row "
                             f"(got columns {sorted(row)})")
        key = json.dumps(spec, sort_keys=True, default=str)
        self._close_env()
        cls = type(self)
        with cls._lock:
            group = cls._group
            first = group[1] if group is not None and group[0] == key else None
            if first is not None and first._env is None:  # closed, or reset to another task since
                first = None
            if first is None:
                # the env itself, not gym.make's checking wrappers: members are clones of it
                base = gym.make(self.env_id, **self.env_kwargs).unwrapped
                try:
                    obs, info = base.reset(options={"task": spec})
                except BaseException:
                    base.close()
                    raise
                cls._group = (key, self)
            else:
                base = first._base
                # a live fork of the group's start; if the first member stepped already, its
                # fork is rolled back to the reset snapshot it shares with the first member
                base = base.clone(1)[0]
                if first._base.steps:
                    base.rollback()
                obs, info = base.observe(), {"task_id": base.task.id, "instruction": base.task.instruction}
        self._env = self._wrap(base, obs, info)
        self._base = base
        self._reward, self._finished = 0.0, False
        self.task_id = info.get("task_id")
        return self._content(info.get("instruction", ""), obs)

    def get_reward(self) -> float:
        """The env's reward for the rollout; an unfinished episode is ended with the give-up
        action first, so the task's checker still scores it."""
        if self._env is None:
            return 0.0
        if not self._finished:
            self._act(self.give_up)
        return self._reward

    # tools call this -----------------------------------------------------------------------
    def _act(self, action: Any) -> str | list:
        if self._env is None:
            raise RuntimeError("no episode: the trainer must call reset() first")
        if self._finished:
            return "The episode has ended; no more actions are taken."
        obs, reward, terminated, truncated, info = self._env.step(action)
        if terminated or truncated:
            self._finished, self._reward = True, float(reward)
        head = f"error: {info['error']}" if info.get("error") else ""
        return self._content(head, obs, "[episode ended]" if terminated or truncated else "")

    def _content(self, head: str, obs: Any, tail: str = "") -> str | list:
        """What the model reads: text, or (multimodal) image blocks and the text."""
        shown = render(obs, multimodal=self.multimodal, max_chars=self.max_chars)
        where = f"URL: {obs['url']}\n{obs.get('tabs', '')}".strip() if isinstance(obs, dict) and "url" in obs else ""
        text = "\n".join(p for p in (head, where, shown.text, tail) if p)
        if shown.images:
            return [*({"type": "image", "image": im} for im in shown.images), {"type": "text", "text": text}]
        return text

    def _adopt(self, base: Any) -> str | list:
        """Take ``base``, a WorkspaceEnv already reset (a clone of a group's set-up), as this
        instance's episode and return the first observation's content: the entry for other
        trainers' loops (verl's). Private on purpose: TRL offers every public method as a tool."""
        obs = base.observe()
        info = {"task_id": base.task.id, "instruction": base.task.instruction}
        self._env, self._base = self._wrap(base, obs, info), base
        self._reward, self._finished, self.task_id = 0.0, False, base.task.id
        return self._content(base.task.instruction, obs)

    def _wrap(self, env: gym.Env, obs: Any, info: dict) -> gym.Env:
        for wrapper in (self.speculation, self.cache):
            if wrapper is not None:
                env = wrapper.wrap(env)
        if hasattr(env, "start_episode"):
            env.start_episode(obs, info)
        return env

    def _close_env(self) -> None:
        env, self._env, self._base = self._env, None, None
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing a dead workspace must not fail the next reset
                log.exception("%s: closing the workspace of task %s failed", type(self).__name__, self.task_id)

    @property
    def env(self) -> Any:
        """The member's gymnasium env (wrappers included), for inspection."""
        return self._env


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


class ShellEnvironment(BunshinEnvironment):
    """Bunshin-Shell-v0: a bash shell in a Debian workspace."""

    env_id = "Bunshin-Shell-v0"

    def shell(self, command: str) -> str:
        """Run a bash command in the workspace (as user, in /home/user); returns its output and exit code.

        Args:
            command: the command line.
        """
        return self._act(command)

    def done(self) -> str:
        """Say the task is complete; the task's checker then scores the workspace."""
        return self._act("DONE")


class DesktopEnvironment(BunshinEnvironment):
    """Bunshin-OSWorld-v0 in OSWorld's computer_13 action space (screen coordinates in pixels)."""

    env_id = "Bunshin-OSWorld-v0"
    env_kwargs: ClassVar[dict] = {"action_space": "computer_13"}
    give_up: ClassVar[Any] = {"action_type": "FAIL"}
    max_chars = 8000  # the accessibility tree, when required

    def click(self, x: int, y: int, button: str = "left", num_clicks: int = 1) -> str | list:
        """Click at a point of the screen.

        Args:
            x: horizontal pixel coordinate.
            y: vertical pixel coordinate.
            button: left, right or middle.
            num_clicks: 1 for a click, 2 for a double click.
        """
        return self._act({"action_type": "CLICK", "x": x, "y": y, "button": button, "num_clicks": num_clicks})

    def type_text(self, text: str) -> str | list:
        """Type text with the keyboard at the focused element.

        Args:
            text: the text to type.
        """
        return self._act({"action_type": "TYPING", "text": text})

    def press(self, key: str) -> str | list:
        """Press and release one key.

        Args:
            key: the key's name (enter, tab, esc, a, f5, ...).
        """
        return self._act({"action_type": "PRESS", "key": key})

    def hotkey(self, keys: list[str]) -> str | list:
        """Press a key combination.

        Args:
            keys: the keys, pressed in order and released in reverse (["ctrl", "s"]).
        """
        return self._act({"action_type": "HOTKEY", "keys": list(keys)})

    def scroll(self, dx: int, dy: int) -> str | list:
        """Scroll the mouse wheel.

        Args:
            dx: horizontal clicks (positive: right).
            dy: vertical clicks (positive: up).
        """
        return self._act({"action_type": "SCROLL", "dx": dx, "dy": dy})

    def done(self) -> str | list:
        """Say the task is complete; the task's evaluator then scores the desktop."""
        return self._act({"action_type": "DONE"})

    def fail(self) -> str | list:
        """Say the task cannot be done (infeasible tasks expect this)."""
        return self._act({"action_type": "FAIL"})


class WebEnvironment(BunshinEnvironment):
    """Bunshin-WebArena-v0: a browser on the shop site, elements named by their tree ids."""

    env_id = "Bunshin-WebArena-v0"
    give_up = "stop [N/A]"
    max_chars = 24000  # a page's whole tree: the ids the tools take are in it

    def click(self, element_id: str) -> str:
        """Click an element of the page.

        Args:
            element_id: the element's id in the accessibility tree (the number in brackets).
        """
        return self._act(f"click [{element_id}]")

    def type_text(self, element_id: str, text: str, press_enter: bool = True) -> str:
        """Type into a text field.

        Args:
            element_id: the field's id in the accessibility tree.
            text: the text to type.
            press_enter: press Enter after the text.
        """
        return self._act(f"type [{element_id}] [{text}] [{int(bool(press_enter))}]")

    def goto(self, url: str) -> str:
        """Open a URL of the shop site.

        Args:
            url: the address.
        """
        return self._act(f"goto [{url}]")

    def go_back(self) -> str:
        """Go back one page in the browser's history."""
        return self._act("go_back")

    def scroll(self, direction: str) -> str:
        """Scroll the page.

        Args:
            direction: up or down.
        """
        return self._act(f"scroll [{direction}]")

    def stop(self, answer: str = "") -> str:
        """End the task, with the answer if the task asks a question.

        Args:
            answer: the answer (empty for tasks that only ask for an action).
        """
        return self._act(f"stop [{answer}]")


FAMILIES: dict[str, type[BunshinEnvironment]] = {
    c.env_id: c for c in (ShellEnvironment, DesktopEnvironment, WebEnvironment)}


def environment_class(env_id: str) -> type[BunshinEnvironment]:
    """The environment_factory class of a registered bunshin env id."""
    try:
        return FAMILIES[env_id]
    except KeyError:
        raise ValueError(f"no environment_factory class for {env_id!r}; one of {', '.join(FAMILIES)}") from None


def task_rows(task_ids: list[str], *, repeats: int = 1, system: str | None = None) -> Any:
    """A ``datasets.Dataset`` with one row per task: a conversational ``prompt`` (the task's
    instruction comes from ``reset``) and the ``task`` column that ``reset`` reads."""
    from datasets import Dataset

    prompt = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "Solve the task in the workspace with the tools.\n\n"}]
    rows = [{"prompt": prompt, "task": t} for _ in range(repeats) for t in task_ids]
    return Dataset.from_list(rows)


@atexit.register
def _close_everything() -> None:
    # TRL keeps its environment pool for the trainer's lifetime and never closes it
    BunshinEnvironment.close_all()


def tool_methods(env: BunshinEnvironment) -> list:
    """The bound methods TRL exposes as tools for ``env`` (its rule: public functions of the
    class other than ``reset`` and ``get_reward``)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


@dataclass
class PromptExample:
    """A prompt as TRL renders it and the first call the model should write (``warm_start`` input)."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]


def first_observation(cls: type[BunshinEnvironment], row: dict, task_id: str) -> tuple[Any, list]:
    """What a new instance's ``reset`` returns for ``task_id`` with ``row``, and its tools (the
    instance is closed before this returns)."""
    env = cls()
    try:
        return env.reset(**{**row, "task": task_id}), tool_methods(env)
    finally:
        env._close_env()


def first_call_examples(cls: type[BunshinEnvironment], tokenizer: Any, tasks: dict[str, Any],
                        to_call: Callable[[Any], tuple[str, dict]]) -> list[PromptExample]:
    """For each task with an oracle: TRL's prompt for it (the row's prompt plus what the real
    ``reset`` returns, tools rendered by the chat template) and the oracle's first action as a
    tool call, ended with the end-of-turn token. ``to_call`` maps an action to (tool, arguments)."""
    from bunshin_gym.train.tools import call_text

    row = task_rows([""])[0]
    out = []
    for task_id, task in tasks.items():
        actions = task.oracle() or []
        if not actions:
            continue
        first, tools = first_observation(cls, row, task_id)
        msgs = [*row["prompt"][:-1], {"role": "user", "content": row["prompt"][-1]["content"] + first}]
        prompt = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        completion = tokenizer(call_text(*to_call(actions[0])), add_special_tokens=False)["input_ids"]
        completion.append(tokenizer.eos_token_id)
        out.append(PromptExample(task_id, list(prompt), completion, [1] * len(completion)))
    return out
