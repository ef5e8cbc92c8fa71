"""The btrfs pool: a loop-file filesystem holding images, workspace layers and snapshots.

Every image, workspace upper layer and snapshot is a btrfs subvolume, so a copy is a
constant-time snapshot and a delete reclaims exactly what that layer wrote.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace.errors import SetupError, WorkspaceError


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def is_mounted(mountpoint: Path) -> bool:
    target = str(mountpoint.resolve())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target and line.split()[2] == "btrfs" for line in f)


def ensure_pool(p: Paths | None = None, log=print) -> Path:
    """Create (first time) and mount the pool; idempotent and fast when already mounted."""
    p = p or paths()
    if is_mounted(p.pool):
        return p.pool
    p.pool.mkdir(parents=True, exist_ok=True)
    if not p.pool_file.exists():
        log(f"creating a {p.pool_size} btrfs pool in {p.pool_file} (sparse)")
        p.pool_file.parent.mkdir(parents=True, exist_ok=True)
        _run("truncate", "-s", p.pool_size, str(p.pool_file))
        _run("mkfs.btrfs", "-q", "-L", "bunshin-pool", str(p.pool_file))
    log(f"mounting {p.pool_file} on {p.pool}")
    _run("mount", "-o", "loop,noatime,user_subvol_rm_allowed", str(p.pool_file), str(p.pool))
    for sub in (p.images, p.workspaces, p.snapshots):
        sub.mkdir(exist_ok=True)
    return p.pool


def require_pool(p: Paths | None = None) -> Paths:
    p = p or paths()
    if not is_mounted(p.pool):
        raise SetupError(f"the btrfs pool is not mounted at {p.pool}; run: scripts/setup.sh")
    return p


def create_subvolume(path: Path) -> None:
    _run("btrfs", "-q", "subvolume", "create", str(path))


def snapshot_subvolume(src: Path, dst: Path, readonly: bool = False) -> None:
    _run("btrfs", "-q", "subvolume", "snapshot", *(["-r"] if readonly else []), str(src), str(dst))


def set_readonly(path: Path, readonly: bool = True) -> None:
    _run("btrfs", "property", "set", "-ts", str(path), "ro", "true" if readonly else "false")


def is_subvolume(path: Path) -> bool:
    try:
        return path.is_dir() and os.stat(path).st_ino == 256
    except OSError:
        return False


def delete_subvolume(path: Path) -> None:
    """Delete a subvolume and any subvolumes nested in it; missing is not an error."""
    if not path.exists():
        return
    nested = sorted(
        (Path(root) / d for root, dirs, _ in os.walk(path) for d in dirs if is_subvolume(Path(root) / d)),
        key=lambda q: len(q.parts),
        reverse=True,
    )
    for sub in [*nested, path]:
        if is_subvolume(sub):
            try:
                set_readonly(sub, False)
            except WorkspaceError:
                pass
            try:
                _run("btrfs", "-q", "subvolume", "delete", str(sub))
            except WorkspaceError:
                if sub.exists():
                    raise
                # deleted meanwhile by a concurrent reclaim (two gc runs, gc and close)
        elif sub.exists():
            _run("rm", "-rf", "--one-file-system", str(sub))
