"""bunshin-gym: Gymnasium environments that are live, forkable container workspaces, and
BunshinRL, a rollout engine that shares memory across forks, caches tool-call prefixes
and speculates tool calls.

    >>> import gymnasium as gym, bunshin_gym
    >>> env = gym.make("Bunshin-Shell-v0")       # or "Bunshin-OSWorld-v0", "Bunshin-WebArena-v0"
"""

from bunshin_gym.core import BunshinWrapper, EnvSnapshot, Task, WorkspaceEnv, fork_api
from bunshin_gym.registration import register_envs

register_envs()

__version__ = "0.1.0"
__all__ = ["BunshinWrapper", "EnvSnapshot", "Task", "WorkspaceEnv", "fork_api", "register_envs"]
