"""Memory of the workspaces one process runs: what a rollout run costs, never host-wide.

The sum of the run's workspaces' cgroup charge, the tmpfs page images their share clones
map (allocated bytes, counted once per snapshot copy, parents included), and the resident
memory of their userfaultfd monitors. The prefix cache sizes its residency budget from it
(:class:`~bunshin_gym.rollout.residency.Residency`), and ``bunshin bench epoch`` samples it.
"""

from __future__ import annotations

import os
from pathlib import Path

from bunshin_gym.config import paths
from bunshin_gym.workspace import records, uffd
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.memstat import rollup

__all__ = ["run_bytes", "workspace_memory"]


def _dir_bytes(d: Path) -> int:
    total = 0
    try:
        for f in d.iterdir():
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_blocks * 512  # allocated, not apparent (images have headroom)
    except OSError:
        pass
    return total


def workspace_memory(owner: int | None = None) -> dict[str, int]:
    """Bytes used by the workspaces this process (or ``owner``) runs, by part: ``cgroups``,
    ``page_images``, ``monitors``, and how many ``workspaces`` there are."""
    owner = os.getpid() if owner is None else owner
    mine = [r for r in records.all_records() if r.owner == owner and r.pid1]
    cgroups = 0
    for r in mine:
        try:
            cgroups += Cgroup(r.cgroup).memory_usage()
        except (OSError, ValueError):
            pass  # closed meanwhile
    root = paths().run / "uffd-images"
    used = uffd.with_ancestors(root, {r.snapshot for r in mine if "uffd" in r.extra and r.snapshot})
    images = sum(_dir_bytes(root / n) for n in used)
    monitors = [pid for r in mine if "uffd" in r.extra for pid in (r.extra["uffd"].get("guard"),
                                                                   r.extra["uffd"].get("worker")) if pid]
    return {"cgroups": cgroups, "page_images": images, "monitors": rollup(monitors)["Rss"],
            "workspaces": len(mine)}


def run_bytes(owner: int | None = None) -> int:
    """The total of :func:`workspace_memory`: bytes of this process's workspaces."""
    parts = workspace_memory(owner)
    return parts["cgroups"] + parts["page_images"] + parts["monitors"]
