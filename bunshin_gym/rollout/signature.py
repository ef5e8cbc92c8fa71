"""Normalised tool-call signatures: what makes two tool calls "the same call".

A signature is ``name(args)`` as one canonical string: a shell command is whitespace-
normalised, an action dict (OSWorld's computer_13) is its type plus its sorted arguments,
a WebArena action string is its verb plus arguments with whitespace normalised. An env may
define ``tool_signature(action) -> str`` to refine this; the cache and the selector use it.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WS = re.compile(r"\s+")


def signature(action: Any, env: Any = None) -> str:
    """Canonical signature of one tool call (name plus normalised arguments)."""
    custom = getattr(getattr(env, "unwrapped", env), "tool_signature", None)
    if custom is not None:
        return custom(action)
    if isinstance(action, str):
        text = _WS.sub(" ", action.strip())
        return f"sh({text})"
    if isinstance(action, dict):
        kind = action.get("action_type") or action.get("type") or "call"
        args = {k: v for k, v in action.items() if k not in ("action_type", "type")}
        return f"{kind}({json.dumps(args, sort_keys=True, separators=(',', ':'))})"
    return f"{type(action).__name__}({json.dumps(action, sort_keys=True, default=str)})"
