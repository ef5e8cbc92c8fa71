"""The step log: one JSON line per env step of a GRPO group, for looking at rollouts later
(``bunshin explore``).

The trajectory log (:mod:`~bunshin_gym.rollout.trajlog`) records tool calls for the cache and
the selector; it does not know groups, members, rewards or what an observation looked like.
The step log does, in ``steps.jsonl`` of a run directory, three kinds of lines:

- ``{"kind": "group", "group", "epoch", "task", "members", "instruction", "obs", "time"}``:
  a group was set up (``obs``: its first observation, every member's start);
- ``{"kind": "step", "group", "member", "episode", "depth", "action", "signature", "served",
  "duration", "think_s", "fork_s", "reward", "terminated", "truncated", "error", ["element_box",]
  "obs", "time"}``: a member's step (``served``: ``executed``, ``cache`` or ``speculation``;
  ``duration``: what the member waited for it; ``fork_s``: what the call took in its speculative
  fork, if adopted; ``element_box``: the step info's, where a web action's element was, so the
  explorer draws the action there);
- ``{"kind": "end", "group", "member", "reward", "steps", "wall_s", "error", "time"}``.

An observation is kept small: its text fields' tails inline (``obs["text"]``, at most
:data:`INLINE_CHARS` each), the whole text (each field capped at :data:`FULL_CHARS`) in
``media/<hash>.json`` when it is longer, and an image (a desktop's or a page's screenshot) as
a thumbnail and a JPEG in ``media/``, each made once: files are named by the hash of what they
hold, so the steps the prefix cache serves, which repeat an observation, add no file. Images
are encoded by a worker thread (about 0.1 s for a 1080p screen, which the member's thread
would otherwise wait for); the thread ends when nothing is left to write, and
:meth:`StepLog.flush` waits for it. A step line may name a file a few milliseconds before it
is written.

Example:
    >>> steps = StepLog("runs/run-1")
    >>> steps.epoch = "GRPO step 1"
    >>> envs = gym.make_vec("Bunshin-Shell-v0", num_envs=4, vectorization_mode="vector_entry_point",
    ...                     step_log=steps)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
#: characters of each text field kept inline in a step line (the tail: the latest output)
INLINE_CHARS = 400
#: characters of each text field kept in the observation's media file
FULL_CHARS = 200_000
#: longest side of a screenshot's thumbnail, in pixels
THUMB_SIDE = 320
#: JPEG quality of the kept screenshots and thumbnails
JPEG_QUALITY = 80


def served_from(info: dict) -> str:
    """Where a step's result came from, by its info: ``cache``, ``speculation`` or ``executed``."""
    if info.get("cache") == "hit":
        return "cache"
    if info.get("speculation") == "hit":
        return "speculation"
    return "executed"


def action_text(action: Any) -> str:
    """An action as text (a string as is, a dict action as JSON)."""
    if isinstance(action, str):
        return action
    try:
        return json.dumps(action, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(action)


class StepLog:
    """Writes ``steps.jsonl`` and ``media/`` in ``run_dir`` (see the module docs). Thread-safe:
    the members of a group record from their own threads.

    Args:
        run_dir: the run's directory.
        screenshots: keep each screenshot as a JPEG besides its thumbnail (the step view).
    """

    def __init__(self, run_dir: str | Path, *, screenshots: bool = True):
        self.dir = Path(run_dir)
        self.media = self.dir / "media"
        self.media.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "steps.jsonl"
        self.screenshots = screenshots
        #: the label groups started now get (``"GRPO step 3"``, ``"eval before"``); set by the driver
        self.epoch = ""
        self._lock = threading.Lock()
        self._written: set[str] = set()
        self._jobs: list[tuple] = []  # (path, make) for the worker
        self._worker: threading.Thread | None = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every media file named so far is written."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout)

    # records ---------------------------------------------------------------------------
    def group(self, *, task: str, members: int, instruction: str = "", obs: Any = None) -> str:
        """Record a group's set-up; returns its id."""
        gid = uuid.uuid4().hex[:12]
        self._write({"kind": "group", "group": gid, "epoch": self.epoch, "task": task, "members": members,
                     "instruction": instruction, "obs": self.observation(obs)})
        return gid

    def step(self, group: str, member: int, depth: int, *, action: Any, obs: Any, reward: float,
             terminated: bool, truncated: bool, info: dict, duration: float, think_s: float | None = None,
             signature: str | None = None, episode: str | None = None) -> None:
        entry = {"kind": "step", "group": group, "member": member, "episode": episode, "depth": depth,
                 "action": action_text(action), "signature": signature or action_text(action),
                 "served": served_from(info), "duration": round(float(duration), 6),
                 "think_s": None if think_s is None else round(float(think_s), 6),
                 "fork_s": _seconds(info.get("speculation_s")), "reward": float(reward),
                 "terminated": bool(terminated), "truncated": bool(truncated), "error": info.get("error")}
        if info.get("element_box") is not None:  # only web steps that target an element have one
            entry["element_box"] = info["element_box"]
        entry["obs"] = self.observation(obs)
        self._write(entry)

    def end(self, group: str, member: int, *, reward: float, steps: int, wall_s: float,
            error: str | None = None) -> None:
        self._write({"kind": "end", "group": group, "member": member, "reward": float(reward), "steps": steps,
                     "wall_s": round(float(wall_s), 6), "error": error})

    def _write(self, entry: dict) -> None:
        entry["time"] = time.time()
        line = json.dumps(entry, default=_plain)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    # observations ----------------------------------------------------------------------
    def observation(self, obs: Any) -> dict:
        """What a step line keeps of an observation (see the module docs)."""
        if obs is None:
            return {}
        if not isinstance(obs, dict):
            obs = {"output": obs} if isinstance(obs, str) else {}
        out: dict[str, Any] = {"text": {}}
        full: dict[str, str] = {}
        for key, value in obs.items():
            if key == "instruction":
                continue  # the same for every step: the group line has it
            if isinstance(value, str):
                out["text"][key] = value[-INLINE_CHARS:]
                full[key] = value[-FULL_CHARS:]
            elif isinstance(value, np.ndarray) and value.ndim == 3 and value.dtype == np.uint8 and value.size:
                out.update(self._image(value))
            elif isinstance(value, (int, float, bool, np.integer, np.floating, np.bool_)):
                out.setdefault("values", {})[key] = value.item() if hasattr(value, "item") else value
        if any(len(v) > INLINE_CHARS for v in full.values()):
            data = json.dumps(full, sort_keys=True).encode()
            out["full"] = self._media(data, "json", lambda: data)
        return out

    def _image(self, rgb: np.ndarray) -> dict:
        h, w = rgb.shape[:2]
        rgb = np.ascontiguousarray(rgb)
        digest = hashlib.sha1(memoryview(rgb).cast("B"), usedforsecurity=False)
        digest.update(f"{h}x{w}".encode())
        key = digest.hexdigest()[:20]
        out = {"size": [w, h], "thumb": self._media_named(f"{key}-t.jpg", lambda: _jpeg(rgb, THUMB_SIDE), later=True)}
        if self.screenshots:
            out["shot"] = self._media_named(f"{key}.jpg", lambda: _jpeg(rgb, None), later=True)
        return out

    def _media(self, data: bytes, ext: str, make) -> str:
        key = hashlib.sha1(data, usedforsecurity=False).hexdigest()[:20]
        return self._media_named(f"{key}.{ext}", make)

    def _media_named(self, name: str, make, later: bool = False) -> str:
        """``media/NAME``, written once (by content hash: an existing file holds the same), now or
        by the worker thread (``later``)."""
        rel = f"media/{name}"
        with self._lock:
            if name in self._written:
                return rel
            self._written.add(name)
        path = self.media / name
        if path.exists():
            return rel
        if not later:
            _write(path, make)
            return rel
        with self._lock:
            self._jobs.append((path, make))
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="step-log-media")
                self._worker.start()
        return rel

    def _drain(self) -> None:
        """The worker: write queued media files until none is left, then end."""
        while True:
            with self._lock:
                if not self._jobs:
                    self._worker = None
                    return
                path, make = self._jobs.pop(0)
            try:
                _write(path, make)
            except Exception:  # noqa: BLE001 - a missing thumbnail must not stop the others
                log.exception("step log: writing %s failed", path)


def _write(path: Path, make) -> None:
    tmp = path.with_suffix(f".tmp{threading.get_ident()}")
    tmp.write_bytes(make())
    tmp.replace(path)


def _seconds(v: Any) -> float | None:
    return None if v is None else round(float(v), 6)


def _jpeg(rgb: np.ndarray, side: int | None) -> bytes:
    from PIL import Image

    img = Image.fromarray(rgb[..., :3])
    if side is not None:
        img.thumbnail((side, side))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return str(v)
