"""Memory of the workspaces one process runs: what a rollout run costs, never host-wide.

The sum of the run's workspaces' cgroup charge, the tmpfs page images their share clones
map or the process keeps for its hot cached snapshots (allocated bytes, counted once per
snapshot copy, parents included), and the resident memory of their userfaultfd monitors.
The prefix cache sizes its residency budget from it
(:class:`~bunshin_gym.rollout.residency.Residency`), speculation bounds the memory of its
live forks by a share of it (:class:`RunBudget`), and ``bunshin bench epoch`` samples it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from bunshin_gym.config import paths
from bunshin_gym.workspace import records, uffd
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.memstat import rollup

__all__ = ["RunBudget", "run_bytes", "workspace_memory"]

logger = logging.getLogger(__name__)


def _dir_bytes(d: Path) -> int:
    total = 0
    try:
        for f in d.iterdir():
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_blocks * 512  # allocated, not apparent (images have headroom)
    except OSError:
        pass
    return total


def _kept_copies(root: Path, owner: int) -> set[str]:
    """Snapshots whose tmpfs copy ``owner`` keeps mapped or not (its prefix cache's hot ones)."""
    if not os.path.ismount(root):
        return set()
    try:
        return {d.name for d in root.iterdir() if d.is_dir() and uffd.keeper(d) == owner}
    except OSError:
        return set()


def workspace_memory(owner: int | None = None) -> dict[str, int]:
    """Bytes used by the workspaces this process (or ``owner``) runs, by part: ``cgroups``,
    ``page_images`` (those its clones map and those it keeps), ``monitors``, and how many
    ``workspaces`` there are."""
    owner = os.getpid() if owner is None else owner
    mine = [r for r in records.all_records() if r.owner == owner and r.pid1]
    cgroups = 0
    for r in mine:
        try:
            cgroups += Cgroup(r.cgroup).memory_usage()
        except (OSError, ValueError):
            pass  # closed meanwhile
    root = paths().run / "uffd-images"
    served = [r for r in mine if r.uffd is not None]  # share clones: a monitor, a mapped image
    used = uffd.with_ancestors(root, {r.snapshot for r in served if r.snapshot} | _kept_copies(root, owner))
    images = sum(_dir_bytes(root / n) for n in used)
    monitors = [pid for r in served for pid in (r.uffd.guard, r.uffd.worker) if pid]
    return {"cgroups": cgroups, "page_images": images, "monitors": rollup(monitors)["Rss"],
            "workspaces": len(mine)}


def run_bytes(owner: int | None = None) -> int:
    """The total of :func:`workspace_memory`: bytes of this process's workspaces."""
    parts = workspace_memory(owner)
    return parts["cgroups"] + parts["page_images"] + parts["monitors"]


class RunBudget:
    """A byte budget that is a share of the run's peak memory (:func:`run_bytes`), or fixed.

    The run's memory is read at most every ``refresh_s`` seconds, and the peak is never
    lowered: a group's workspaces closing does not shrink what the next group may use.

    Args:
        fixed: a budget in bytes (None: sized from the run).
        fraction: the budget's share of the run's peak memory.
        run_memory: bytes the run uses now (default: this process's workspaces).
        refresh_s: the least seconds between two reads.
    """

    def __init__(self, fixed: int | None = None, *, fraction: float, run_memory: Callable[[], int] = run_bytes,
                 refresh_s: float = 2.0):
        if fixed is not None and fixed < 0:
            raise ValueError(f"memory budget must be >= 0 bytes or None (sized from the run), not {fixed}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"memory budget fraction must be between 0 and 1, not {fraction}")
        self.fixed, self.fraction, self.run_memory, self.refresh_s = fixed, fraction, run_memory, refresh_s
        self.run_peak = 0
        self._read_at = -math.inf

    @property
    def budget(self) -> int:
        """The budget in bytes now (a run-sized one reads the run's memory first, when due)."""
        if self.fixed is not None:
            return self.fixed
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            self._read_at = now
            try:
                self.run_peak = max(self.run_peak, self.run_memory())
            except OSError as e:  # a workspace closing under the read: sized at the next read
                logger.debug("reading the run's memory failed: %s", e)
        return int(self.fraction * self.run_peak)
