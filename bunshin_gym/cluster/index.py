"""The snapshot index: which host holds which snapshot and prefix-cache node.

Fed by the hosts' ``create`` and ``evict`` events (:meth:`HostActor.events`, also returned with
every group's result); a host that dies is dropped whole (:meth:`SnapshotIndex.drop_host`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bunshin_gym.cluster.host import IndexEntry


@dataclass(frozen=True)
class Match:
    """How much of a group's prefix a host has cached: ``depth`` calls matched (of which the
    deepest snapshotted one is ``snapshot``, at ``snapshot_depth``), ``nodes`` cached nodes of
    the task there."""

    host: str
    depth: int
    snapshot: str | None
    snapshot_depth: int
    nodes: int

    @property
    def score(self) -> tuple[int, int, int]:
        return self.depth, self.snapshot_depth, self.nodes


class SnapshotIndex:
    def __init__(self) -> None:
        self._by_host: dict[str, dict[str, IndexEntry]] = defaultdict(dict)
        self._lock = threading.Lock()

    def apply(self, host: str, events: Iterable[tuple[str, Any]]) -> None:
        """Apply a host's events: ``("create", IndexEntry)``, ``("evict", entry id)``."""
        with self._lock:
            mine = self._by_host[host]
            for kind, what in events:
                if kind == "create":
                    if what.host != host:
                        raise ValueError(f"an entry of host {what.host} reported by host {host}")
                    mine[what.id] = what
                elif kind == "evict":
                    mine.pop(what, None)
                else:
                    raise ValueError(f"unknown index event {kind!r}")

    def drop_host(self, host: str) -> int:
        """Forget everything a host held (it died); returns how many entries went."""
        with self._lock:
            return len(self._by_host.pop(host, {}))

    def holders(self, snapshot: str) -> list[str]:
        with self._lock:
            return sorted(h for h, entries in self._by_host.items() if snapshot in entries)

    def entries(self, host: str | None = None) -> list[IndexEntry]:
        with self._lock:
            hosts = [host] if host is not None else list(self._by_host)
            return [e for h in hosts for e in self._by_host.get(h, {}).values()]

    def snapshots(self, host: str) -> set[str]:
        with self._lock:
            return {e.snapshot for e in self._by_host.get(host, {}).values() if e.snapshot}

    def match(self, task: str, prefix: Sequence[str] = ()) -> list[Match]:
        """Each host's longest cached match of a group of ``task`` whose calls start with
        ``prefix`` (signatures; empty: only the task is known, and every node of the task is a
        potential hit), best first."""
        prefix = tuple(prefix)
        out = []
        with self._lock:
            for host, entries in self._by_host.items():
                mine = [e for e in entries.values() if e.task == task and (
                    not prefix or e.prefix == prefix[:e.depth] or (e.depth > len(prefix) and
                                                                   e.prefix[:len(prefix)] == prefix))]
                if not mine:
                    continue
                depth = max(min(e.depth, len(prefix)) for e in mine) if prefix else 0
                snaps = [e for e in mine if e.snapshot and (not prefix or e.prefix == prefix[:e.depth])]
                best = max(snaps, key=lambda e: e.depth, default=None)
                out.append(Match(host, depth, best.snapshot if best else None, best.depth if best else 0, len(mine)))
        return sorted(out, key=lambda m: (m.score, m.host), reverse=True)
