"""Observations as what a policy reads: text, or text plus images for multimodal models.

- shell: ``{"output", "exit_code", ...}`` -> the output's tail and the exit code;
- desktop: ``{"screenshot": HxWx3 uint8, "accessibility_tree": str, ...}`` -> the tree as text,
  and the screenshot as an image only for a multimodal policy (a text model is told it
  was left out);
- anything else: strings as they are, other values as JSON.

Example:
    >>> render({"output": "a\\nb\\n", "exit_code": 0}).text
    'a\\nb\\n[exit code 0]'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TREE_KEYS = ("accessibility_tree", "a11y_tree", "axtree")
IMAGE_KEYS = ("screenshot", "image")


@dataclass
class Rendered:
    text: str
    images: list = field(default_factory=list)  # PIL images, for multimodal policies only


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def render(obs: Any, *, multimodal: bool = False, max_chars: int = 1500) -> Rendered:
    """What the policy sees of one observation."""
    if isinstance(obs, str):
        return Rendered(_tail(obs, max_chars))
    if isinstance(obs, dict):
        image_key = next((k for k in IMAGE_KEYS if isinstance(obs.get(k), np.ndarray)), None)
        tree_key = next((k for k in TREE_KEYS if k in obs), None)
        if image_key or tree_key:
            parts, images = [], []
            if image_key:
                if multimodal:
                    from PIL import Image

                    images.append(Image.fromarray(np.asarray(obs[image_key], dtype=np.uint8)))
                else:
                    h, w = obs[image_key].shape[:2]
                    parts.append(f"[screenshot {w}x{h} not shown: text-only policy]")
            if tree_key:
                parts.append(_tail(str(obs[tree_key]), max_chars))
            return Rendered("\n".join(parts), images)
        if "output" in obs:
            code = int(obs.get("exit_code", 0))
            status = "[timed out]" if code == -9 else f"[exit code {code}]"
            out = _tail(str(obs["output"]), max_chars)
            return Rendered(f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}{status}")
    return Rendered(_tail(json.dumps(obs, default=_json_default, sort_keys=True), max_chars))


def _json_default(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return f"<array {v.shape} {v.dtype}>"
    if isinstance(v, np.generic):
        return v.item()
    return str(v)
