"""Where a host keeps its state, and simulated hosts on one machine.

On a real cluster every Ray node is one host with the default paths (``BUNSHIN_HOME``, its own
pool and ``BUNSHIN_RUN``): :func:`node_env` of a host with no simulation is empty and the host
actor reads the node's own configuration.

On one machine several hosts are simulated, each with its own paths, set as environment
variables in its actor's ``runtime_env`` (the package reads them at use, so every layer below,
``SnapshotStore()`` and ``paths()`` included, sees the host's own):

- ``BUNSHIN_POOL``: ``$BUNSHIN_HOME/cluster/<node>/pool``, a bind mount of the subvolume
  ``.cluster/<node>`` of the machine's btrfs pool (one pool file per host would need its images
  copied in; a subvolume shares them and ``btrfs send``/``receive`` still move snapshots between
  the hosts' trees). The pool's ``images`` directory is bind-mounted into it read-write (the
  id-shifted image copies are made there on first use), so the hosts need no image builds.
- ``BUNSHIN_RUN``: ``$BUNSHIN_RUN/cluster/<node>``: the host's workspace records and logs.
- ``BUNSHIN_CGROUP_ROOT``: a host-private cgroup root. Workspace cgroups are swept by ``bunshin
  gc`` when no record of *its* run directory names them, so hosts sharing the machine's cgroup
  root would have their workspaces killed by any other gc. Under cgroup v2 it is a child cgroup
  ``bunshin-cluster-<node>``; under v1 a directory of links ``<controller> ->
  /sys/fs/cgroup/<controller>/bunshin-cluster-<node>``.
- the prefix cache of the host lives in ``$BUNSHIN_HOME/cluster/<node>/prefix-cache``.

The CRIU build and the runtime layer (``BUNSHIN_HOME``) are shared: they are read-only.
"""

from __future__ import annotations

import logging
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym import config
from bunshin_gym.workspace import pool

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
#: cgroup v1 controllers a workspace may use (cgroups.V1_CONTROLLERS)
_V1 = ("memory", "freezer", "pids", "devices")


@dataclass(frozen=True)
class NodeLayout:
    """The paths of one simulated host."""

    name: str
    base: Path  # $BUNSHIN_HOME/cluster/<name>
    subvolume: Path  # the pool subvolume mounted at ``pool``
    run: Path
    cgroup_root: Path

    @property
    def pool(self) -> Path:
        return self.base / "pool"

    @property
    def prefix_cache(self) -> Path:
        return self.base / "prefix-cache"

    def env(self) -> dict[str, str]:
        """The environment variables that point the package at this host's paths."""
        return {"BUNSHIN_POOL": str(self.pool), "BUNSHIN_RUN": str(self.run),
                "BUNSHIN_CGROUP_ROOT": str(self.cgroup_root)}


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad host name {name!r}: 1-31 of a-z, 0-9 and '-', starting with a letter or digit")
    return name


def layout(name: str) -> NodeLayout:
    """The layout of simulated host ``name`` (nothing is made)."""
    p = config.paths()
    base = p.home / "cluster" / check_name(name)
    cg = Path(f"/sys/fs/cgroup/bunshin-cluster-{name}") if _unified() else base / "cgroup"
    return NodeLayout(name, base, p.pool / ".cluster" / name, p.run / "cluster" / name, cg)


def prepare(name: str) -> NodeLayout:
    """Make (idempotent) simulated host ``name``: its pool subvolume mounted with the images, its
    run directory and cgroup root. Needs the machine's pool (``scripts/setup.sh``)."""
    p = pool.require_pool()
    lay = layout(name)
    lay.subvolume.parent.mkdir(exist_ok=True)
    if not pool.is_subvolume(lay.subvolume):
        pool.create_subvolume(lay.subvolume)
    for sub in ("workspaces", "snapshots", "images"):
        (lay.subvolume / sub).mkdir(exist_ok=True)
    lay.pool.mkdir(parents=True, exist_ok=True)
    if not pool.is_mounted(lay.pool):
        _run("mount", "--bind", str(lay.subvolume), str(lay.pool))
    images = lay.pool / "images"
    if not _is_mountpoint(images):
        _run("mount", "--bind", str(p.images), str(images))
    lay.run.mkdir(parents=True, exist_ok=True)
    lay.prefix_cache.mkdir(parents=True, exist_ok=True)
    _prepare_cgroup_root(lay)
    return lay


def reclaim_host(name: str, timeout: float = 300.0) -> dict:
    """Reclaim what simulated host ``name`` left (every workspace and snapshot under its
    paths), for a host whose Ray node is gone so no task can run there. In a new process with
    the host's environment: the cgroup root is read once at import (``cgroups.CGROOT``), so a
    reclaim in this process with the variables changed would sweep the machine's cgroup root,
    killing every workspace its run directory does not name."""
    import json
    import os
    import sys

    env = {**os.environ, **layout(name).env()}
    code = "import json; from bunshin_gym.cluster.host import reclaim; print(json.dumps(reclaim(owned=True)))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reclaiming host {name} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def remove(name: str) -> None:
    """Unmount and delete simulated host ``name`` (its workspaces must be gone: ``reclaim`` first)."""
    lay = layout(name)
    cgroup_roots = [lay.cgroup_root] if _unified() else \
        [Path("/sys/fs/cgroup") / c / f"bunshin-cluster-{name}" for c in _V1]
    # the host's mounts, deepest first: its pool and images, the uffd page images' tmpfs in its run dir
    for mnt in sorted(_mounts_under(lay.base, lay.run), key=lambda m: -len(m.parts)):
        _run("umount", str(mnt))
    if pool.is_subvolume(lay.subvolume):
        (lay.subvolume / "images").rmdir()
        pool.delete_subvolume(lay.subvolume)
    subprocess.run(["rm", "-rf", "--one-file-system", str(lay.base), str(lay.run)], check=False)
    for root in cgroup_roots:  # a cgroup directory goes with rmdir, children first
        for d in sorted((q for q in root.rglob("*") if q.is_dir()), key=lambda q: -len(q.parts)) \
                if root.is_dir() else []:
            d.rmdir()
        if root.is_dir():
            root.rmdir()


def _mounts_under(*dirs: Path) -> list[Path]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            target = Path(line.split()[1].replace("\\040", " "))
            if any(target == d or d in target.parents for d in dirs):
                out.append(target)
    return out


def _prepare_cgroup_root(lay: NodeLayout) -> None:
    if _unified():
        lay.cgroup_root.mkdir(exist_ok=True)
        have = set((Path("/sys/fs/cgroup") / "cgroup.controllers").read_text().split())
        enable = " ".join(f"+{c}" for c in ("memory", "pids") if c in have)
        if enable:
            (Path("/sys/fs/cgroup") / "cgroup.subtree_control").write_text(enable)
        return
    lay.cgroup_root.mkdir(parents=True, exist_ok=True)
    for ctl in _V1:
        host = Path("/sys/fs/cgroup") / ctl
        if not host.is_dir():
            continue  # an optional controller this host lacks (cgroups._v1_controllers)
        target = host / f"bunshin-cluster-{lay.name}"
        target.mkdir(exist_ok=True)
        if ctl == "memory" and (target / "memory.use_hierarchy").exists():
            # charges of the workspaces below count here too (per-host memory)
            try:
                (target / "memory.use_hierarchy").write_text("1")
            except OSError:
                pass  # already hierarchical, or set by the parent
        link = lay.cgroup_root / ctl
        if not link.is_symlink():
            link.symlink_to(target)


def _unified() -> bool:
    return (Path("/sys/fs/cgroup") / "cgroup.controllers").exists()


def _is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
