"""The abstract task: what an episode asks for, how it is set up and how it is scored.

Like BrowserGym's ``AbstractBrowserTask``: an env owns the workspace, a task owns the
episode's meaning. Each env family loads its own task files into ``Task`` objects.
"""

from __future__ import annotations

import abc
from typing import Any


class TaskError(ValueError):
    """A task file is malformed or names something unsupported (the message says what)."""


class Task(abc.ABC):
    """One task: an instruction, a set-up run in a fresh workspace, and a validation.

    Attributes:
        id: unique id of the task.
        instruction: what the agent is asked to do.
        max_steps: episode length cap (truncation).
        config: the task's original definition (the file's dict).
    """

    def __init__(self, id: str, instruction: str, max_steps: int = 15, config: dict | None = None):
        self.id = id
        self.instruction = instruction
        self.max_steps = max_steps
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
