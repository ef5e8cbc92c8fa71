"""BunshinRL's rollout engine: GRPO-group vector env, tool-prefix cache, speculative tool
execution, the tool-call selector, the trajectory log and the step log."""

from bunshin_gym.rollout.group import GroupVectorEnv, Trajectory
from bunshin_gym.rollout.prefix_cache import PrefixCache, PrefixTree
from bunshin_gym.rollout.selector import SpecToolSelector
from bunshin_gym.rollout.signature import signature
from bunshin_gym.rollout.speculation import Speculation
from bunshin_gym.rollout.steplog import StepLog
from bunshin_gym.rollout.trajlog import TrajectoryLog

__all__ = ["GroupVectorEnv", "PrefixCache", "PrefixTree", "SpecToolSelector", "Speculation", "StepLog",
           "Trajectory", "TrajectoryLog", "signature"]
