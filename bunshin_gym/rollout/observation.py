"""Comparing observations and keeping what the log needs of them.

A replayed call is checked against the observation recorded when it first ran
(:func:`same_observation`); a difference means the call is not deterministic and the
prefix cache stops serving it. Text and numbers must be equal. Images (a desktop's
screenshot) may differ in a few pixels between any two runs, cached or not (a blinking
text cursor), so two images count as the same when at most :data:`IMAGE_TOLERANCE` of
their pixels differ: the same tolerance the semantics tests use.

:func:`observation_text` is the text of an observation that the trajectory log stores for
the tool-call selector (a shell's output, a page's URL and tree, a desktop's terminal).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: fraction of an image's pixels that may differ between two runs of the same call
IMAGE_TOLERANCE = 0.005
#: characters of an observation's text kept in the log (its end: the latest output)
LOG_TEXT_CHARS = 2000
# text fields of the envs' observations, in the order they are kept for the log
_TEXT_FIELDS = ("output", "last_action_error", "url", "terminal", "accessibility_tree")


def same_observation(a: Any, b: Any) -> bool:
    """Whether two observations of the same call are the same (see the module docs)."""
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return False
        return all(same_observation(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.ndim == 3 and a.dtype == np.uint8:  # an image: pixels, not channels
            return float((a != b).any(axis=-1).mean()) <= IMAGE_TOLERANCE
        return bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_observation(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def observation_text(obs: Any, limit: int = LOG_TEXT_CHARS) -> str:
    """The observation's text for the log: its text fields (known ones first), the end of
    each kept when the whole is over ``limit`` characters."""
    if isinstance(obs, str):
        return obs[-limit:]
    if not isinstance(obs, dict):
        return ""
    rest = sorted(k for k in obs if k not in _TEXT_FIELDS and k != "instruction")
    keys = [k for k in _TEXT_FIELDS if k in obs] + rest
    parts = [obs[k] for k in keys if isinstance(obs[k], str) and obs[k]]
    share = limit // max(1, len(parts))
    return "\n".join(p[-share:] for p in parts)
