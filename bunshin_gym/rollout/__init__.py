"""BunshinRL's rollout engine: GRPO-group vector env, tool-prefix cache, speculative tool
execution, the tool-call selector and the trajectory log."""

from bunshin_gym.rollout.group import GroupVectorEnv, Trajectory
from bunshin_gym.rollout.prefix_cache import PrefixCache, PrefixTree
from bunshin_gym.rollout.selector import SpecToolSelector
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.speculation import Speculation
from bunshin_gym.rollout.trajlog import TrajectoryLog

__all__ = ["GroupVectorEnv", "PrefixCache", "PrefixTree", "SpecToolSelector", "Speculation", "Trajectory",
           "TrajectoryLog", "signature"]
