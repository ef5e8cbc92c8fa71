"""The gym layer: ``WorkspaceEnv``, the fork-forwarding wrapper base, tasks and registration."""

from bunshin_gym.core.env import EnvSnapshot, WorkspaceEnv, fork_pending
from bunshin_gym.core.task import Task, TaskError
from bunshin_gym.core.wrappers import BunshinWrapper, fork_api

__all__ = ["BunshinWrapper", "EnvSnapshot", "Task", "TaskError", "WorkspaceEnv", "fork_api", "fork_pending"]
