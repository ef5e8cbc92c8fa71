"""The abstract task: what an episode asks for, how it is set up and how it is scored.

Like BrowserGym's ``AbstractBrowserTask``: an env owns the workspace, a task owns the
episode's meaning. Each env family loads its own task files into ``Task`` objects, with the
checks here: a malformed file is a :class:`TaskError` naming the file and the field at
fault, never a task that misbehaves later (a ``setup`` string run one character at a time).
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

from bunshin_gym.errors import TaskError  # re-exported: bunshin_gym.core.task.TaskError stays


def read_task_file(path: str | Path) -> dict:
    """The JSON object of a task file; :class:`TaskError` naming the file (and the line and
    column of a JSON error) when it cannot be read, is not JSON or is not an object."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"task file {path}: cannot be read: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError(f"task file {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise TaskError(f"task file {path}: a task is a JSON object, not {_kind(config)}")
    return config


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def check_config(config: Any, where: str) -> dict:
    """``config`` if it is a dict (a task's JSON object), else :class:`TaskError`."""
    if not isinstance(config, dict):
        raise TaskError(f"{where}: a task is a JSON object (a dict), not {_kind(config)}")
    return config


def identify(config: Any, family: str, source: str | None, id_key: str = "id") -> tuple[dict, str]:
    """A task config checked to be a dict, and the name its errors go by: ``"<family> task
    '<id>' (<source>)"``."""
    config = check_config(config, f"{family} task {source or ''}".strip())
    where = f"{family} task {config.get(id_key, '?')!r:.80}" + (f" ({source})" if source else "")
    return config, where


def field(config: dict, key: str, kind: type | tuple[type, ...], where: str, *, required: bool = False,
          default: Any = None, items: type | None = None) -> Any:
    """``config[key]`` checked to be of ``kind`` (and a list's elements of ``items``);
    ``default`` when absent (or null) and not ``required``. :class:`TaskError` naming the
    field otherwise. A boolean is never taken for an integer."""
    value = config.get(key)
    if value is None:
        if required:
            raise TaskError(f"{where}: missing field {key!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = " or ".join(_kind(k()) if k in (dict, list, str, bool, int, float) else k.__name__ for k in kinds)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TaskError(f"{where}: field {key!r} must be {names}, not {_kind(value)} ({value!r:.80})")
    if items is not None:
        for i, item in enumerate(value):
            if not isinstance(item, items) or (isinstance(item, bool) and items is not bool):
                raise TaskError(f"{where}: field {key!r}[{i}] must be {_kind(items())}, "
                                f"not {_kind(item)} ({item!r:.80})")
    return value


def check_max_steps(value: Any, where: str) -> int:
    """A task's step cap: a positive integer (a JSON ``10``, never ``"10"``, ``10.5`` or ``true``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TaskError(f"{where}: field 'max_steps' must be a positive integer, not {_kind(value)} ({value!r:.80})")
    return value


class Task(abc.ABC):
    """One task: an instruction, a set-up run in a fresh workspace, and a validation.

    Attributes:
        id: unique id of the task.
        instruction: what the agent is asked to do.
        max_steps: episode length cap (truncation).
        config: the task's original definition (the file's dict).

    Raises:
        TaskError: ``id`` or ``instruction`` is not a non-empty string, or ``max_steps`` not
            a positive integer (the message names the field).
    """

    def __init__(self, id: str, instruction: str, max_steps: int = 15, config: dict | None = None):
        where = f"task {id!r:.80}"
        if not isinstance(id, str) or not id:
            raise TaskError(f"{where}: field 'id' must be a non-empty string, not {_kind(id)}")
        if not isinstance(instruction, str) or not instruction.strip():
            raise TaskError(f"{where}: the instruction must be a non-empty string, not {_kind(instruction)}")
        self.id = id
        self.instruction = instruction
        self.max_steps = check_max_steps(max_steps, where)
        self.config = config or {}

    @abc.abstractmethod
    def setup(self, env: Any) -> None:
        """Prepare the workspace for the episode (files, apps, pages)."""

    @abc.abstractmethod
    def validate(self, env: Any) -> float:
        """Score the workspace's final state: 1.0 is success, 0.0 failure."""

    def oracle(self) -> list | None:
        """A scripted solution (list of actions) when the task ships one."""
        return self.config.get("oracle")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id!r}>"
