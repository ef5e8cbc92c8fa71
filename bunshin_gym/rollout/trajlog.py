"""The trajectory log: one JSON line per tool call, shared by the cache, speculation and the
selector. It records what was called (signature and action), where (task, episode, depth),
how long the tool took, whether the cache or speculation served it, and the text of the
observation the call was made from (``observation``: what the selector learns from).

Example:
    >>> log = TrajectoryLog("/var/lib/bunshin/trajectories.jsonl")
    >>> log.record(task="shell/count-files", episode="e1", depth=0, signature="sh(ls)", action="ls", duration=0.02)
    >>> TrajectoryLog.load(log.path)[0]["signature"]
    'sh(ls)'
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


class TrajectoryLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def record(self, **entry: Any) -> None:
        entry.setdefault("time", time.time())
        line = json.dumps(entry, default=str)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    @staticmethod
    def load(path: str | Path) -> list[dict]:
        path = Path(path)
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
        return out

    @staticmethod
    def episodes(entries: list[dict]) -> list[list[dict]]:
        """Entries grouped by episode, each in call order."""
        by: dict[str, list[dict]] = defaultdict(list)
        for e in entries:
            by[e.get("episode", "")].append(e)
        return [sorted(v, key=lambda e: e.get("depth", 0)) for v in by.values()]

    @staticmethod
    def durations(entries: list[dict]) -> dict[str, float]:
        """Median executed duration of each signature (cache hits excluded)."""
        by: dict[str, list[float]] = defaultdict(list)
        for e in entries:
            if e.get("served") in (None, "executed", "speculated") and e.get("duration") is not None:
                by[e["signature"]].append(float(e["duration"]))
        return {sig: statistics.median(v) for sig, v in by.items()}

    @staticmethod
    def episode_times(entries: list[dict]) -> dict[str, float]:
        """Median tool time of an episode of each task: the sum of its calls' durations (a
        served call counts what it took when it ran), over the task's episodes."""
        by: dict[str, list[float]] = defaultdict(list)
        for ep in TrajectoryLog.episodes(entries):
            by[ep[0].get("task", "")].append(sum(float(e.get("duration") or 0.0) for e in ep))
        return {task: statistics.median(v) for task, v in by.items()}
