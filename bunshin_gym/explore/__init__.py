"""``bunshin explore``: a local web page to look at recorded rollouts (their GRPO groups as
fork trees, each step's observation and action), training curves, and live workspaces.

The page reads what a run records: ``steps.jsonl`` and ``media/`` (the step log,
:mod:`bunshin_gym.rollout.steplog`) and ``report.json`` (``bunshin train``'s report).
"""

from bunshin_gym.explore.app import create_app, serve
from bunshin_gym.explore.runs import Run, build_tree

__all__ = ["Run", "build_tree", "create_app", "serve"]
