"""The btrfs pool: a loop-file filesystem holding images, workspace layers and snapshots.

Every image, workspace upper layer and snapshot is a btrfs subvolume, so a copy is a
constant-time snapshot and a delete reclaims exactly what that layer wrote.

Disk quotas: each workspace's subvolume gets a limit in btrfs *simple quotas* (squota,
Linux 6.7+), which charge an extent to the subvolume that wrote it. Full qgroups were
measured on this host first (a 100 MB + 2000-file subvolume, 20 read-only snapshots each
after writing 1 MB): the snapshot took 30 ms median instead of 16 ms, since every
snapshot commits and re-accounts shared extents; under simple quotas it took 13.5 ms, the
same as without quotas (the snapshot is in every fork's frozen time). Simple quotas also
give the semantics wanted here: a clone is charged only for what it writes after its
snapshot, never for the files it shares with it, and a snapshot of a workspace is charged
nothing. Debian 12's btrfs-progs (6.2) cannot enable them, so the ioctls are called here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import struct
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace.errors import SetupError, WorkspaceError

log = logging.getLogger(__name__)

# btrfs ioctls (linux/btrfs.h)
_IOC_SNAP_DESTROY = 0x5000940F  # _IOW(0x94, 15, struct btrfs_ioctl_vol_args): 4096 bytes
_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
_IOC_SNAP_CREATE_V2 = 0x50009417  # _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2): 4096 bytes
_IOC_SUBVOL_GETFLAGS = 0x80089419  # _IOR(0x94, 25, __u64)
_IOC_SUBVOL_SETFLAGS = 0x4008941A  # _IOW(0x94, 26, __u64)
_SUBVOL_RDONLY = 1 << 1
_VOL_NAME_MAX = 4087  # vol_args: __s64 fd, char name[4088]
_SUBVOL_NAME_MAX = 4039  # vol_args_v2: fd, transid, flags, a 32-byte union, char name[4040]
_IOC_FS_INFO = 0x8400941F  # _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args): 1024 bytes
_IOC_INO_LOOKUP = 0xD0009412  # _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args): 4096 bytes
_IOC_QUOTA_CTL = 0xC0109428  # _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args): cmd, status
_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args): 48 bytes
_QUOTA_CTL_ENABLE = 1
_QUOTA_CTL_ENABLE_SIMPLE = 4
_LIMIT_MAX_RFER = 1


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkspaceError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def is_mounted(mountpoint: Path) -> bool:
    target = str(mountpoint.resolve())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target and line.split()[2] == "btrfs" for line in f)


def ensure_pool(p: Paths | None = None, say: Callable[[str], None] = log.info) -> Path:
    """Create (first time) and mount the pool; idempotent and fast when already mounted.
    ``say`` reports the steps (the set-up script and the CLI print them)."""
    p = p or paths()
    if is_mounted(p.pool):
        return p.pool
    p.pool.mkdir(parents=True, exist_ok=True)
    if not p.pool_file.exists():
        say(f"creating a {p.pool_size} btrfs pool in {p.pool_file} (sparse)")
        p.pool_file.parent.mkdir(parents=True, exist_ok=True)
        _run("truncate", "-s", p.pool_size, str(p.pool_file))
        _run("mkfs.btrfs", "-q", "-L", "bunshin-pool", str(p.pool_file))
    say(f"mounting {p.pool_file} on {p.pool}")
    _run("mount", "-o", "loop,noatime,user_subvol_rm_allowed", str(p.pool_file), str(p.pool))
    for sub in (p.images, p.workspaces, p.snapshots):
        sub.mkdir(exist_ok=True)
    try:  # else the first workspace with a disk limit turns them on (and fails clearly there)
        ensure_quota(p.pool)
    except SetupError as e:
        log.warning("%s; workspaces will have no disk quota", e)
    return p.pool


def drop_backing_cache(p: Paths | None = None) -> int:
    """Drop the host's page cache of the pool's backing file (after writing back what is
    dirty), so that a read the pool's own cache misses goes to the disk; returns the bytes
    of the file that were cached before.

    The pool is a loop device over a file without direct I/O, so every block btrfs reads is
    cached twice: in btrfs's page cache and in the host's cache of the file. Dropping a
    file's pages from btrfs's cache alone (``posix_fadvise`` on it) leaves the second copy,
    and its next read is served from memory, not the disk. What a "restore from disk" costs
    is measured after this (``bunshin bench epoch``); it slows every other cold read of the
    pool until its blocks are cached again, so the cache never calls it on its own."""
    p = p or paths()
    pool_file = p.pool_file
    if not pool_file.is_file():
        return 0  # a block device or nothing: no host page cache of a file to drop
    fd = os.open(p.pool, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc().syncfs(fd) != 0:  # btrfs's dirty pages into the file (os has no syncfs in 3.11)
            os.sync()
    finally:
        os.close(fd)
    fd = os.open(pool_file, os.O_RDONLY)
    try:
        cached = _cached_bytes(fd, pool_file.stat().st_size)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached


def _cached_bytes(fd: int, size: int) -> int:
    """Bytes of the file at ``fd`` in the page cache (``cachestat``, Linux 6.5+; -1 if not
    available)."""
    # struct cachestat_range {u64 off, len}; struct cachestat {u64 nr_cache, nr_dirty, ...}
    rng = (ctypes.c_uint64 * 2)(0, size)
    out = (ctypes.c_uint64 * 5)()
    if _libc().syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        return -1
    return int(out[0]) * os.sysconf("SC_PAGE_SIZE")


#: cachestat's number, the same on every architecture but alpha (new syscalls share a table)
_SYS_CACHESTAT = 451


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def require_pool(p: Paths | None = None) -> Paths:
    p = p or paths()
    if not is_mounted(p.pool):
        raise SetupError(f"the btrfs pool is not mounted at {p.pool}; run: scripts/setup.sh")
    return p


# Subvolumes are made, snapshotted and deleted with the kernel's ioctls, not the btrfs CLI:
# a fork makes one subvolume per clone and a close deletes one, and a fork+exec of `btrfs`
# cost 60-90 ms each on a busy 2-core host (1.4 s of 16 clones' 5 s fan-out), the ioctl a
# few ms. The CLI does the same ioctls (btrfs-progs cmds/subvolume.c).
def _name_arg(path: Path, limit: int) -> bytes:
    name = os.fsencode(path.name)
    if not name or name in (b".", b"..") or len(name) > limit:
        raise WorkspaceError(f"bad subvolume name {path.name!r} (1 to {limit} bytes)")
    return name


def _on_parent(path: Path, request: int, arg: bytes, what: str) -> None:
    try:
        _ioctl(path.parent, request, arg)
    except OSError as e:
        raise WorkspaceError(f"{what} {path} failed: {e.strerror or e}") from e


def create_subvolume(path: Path) -> None:
    name = _name_arg(path, _VOL_NAME_MAX)
    _on_parent(path, _IOC_SUBVOL_CREATE, struct.pack("=q", 0) + name.ljust(_VOL_NAME_MAX + 1, b"\0"),
               "creating subvolume")


def snapshot_subvolume(src: Path, dst: Path, readonly: bool = False) -> None:
    name = _name_arg(dst, _SUBVOL_NAME_MAX)
    try:
        src_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise WorkspaceError(f"snapshot of {src} as {dst} failed: {e.strerror or e}") from e
    try:
        # vol_args_v2: fd of the source, transid (out), flags, union {size, qgroup_inherit}, name
        arg = struct.pack("=qQQ32x", src_fd, 0, _SUBVOL_RDONLY if readonly else 0) + \
            name.ljust(_SUBVOL_NAME_MAX + 1, b"\0")
        _on_parent(dst, _IOC_SNAP_CREATE_V2, arg, f"snapshot of {src} as")
    finally:
        os.close(src_fd)


def set_readonly(path: Path, readonly: bool = True) -> None:
    try:
        flags = struct.unpack("=Q", _ioctl(path, _IOC_SUBVOL_GETFLAGS, bytes(8)))[0]
        want = flags | _SUBVOL_RDONLY if readonly else flags & ~_SUBVOL_RDONLY
        if want != flags:
            _ioctl(path, _IOC_SUBVOL_SETFLAGS, struct.pack("=Q", want))
    except OSError as e:
        raise WorkspaceError(f"setting ro={readonly} on subvolume {path} failed: {e.strerror or e}") from e


def is_subvolume(path: Path) -> bool:
    try:
        return path.is_dir() and os.stat(path).st_ino == 256
    except OSError:
        return False


def delete_subvolume(path: Path) -> None:
    """Delete a subvolume and any subvolumes nested in it; missing is not an error."""
    if not path.exists():
        return
    if not is_subvolume(path):
        _run("rm", "-rf", "--one-file-system", str(path))
        return
    try:
        _destroy(path)
        return
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # ENOTEMPTY: it holds subvolumes, deleted first below
            _raise_unless_gone(path, e)
            return
    # walked only here: a workspace's layer can hold many files and rarely a subvolume
    nested = sorted(
        (Path(root) / d for root, dirs, _ in os.walk(path) for d in dirs if is_subvolume(Path(root) / d)),
        key=lambda q: len(q.parts),
        reverse=True,
    )
    for sub in [*nested, path]:
        try:
            _destroy(sub)
        except OSError as e:
            _raise_unless_gone(sub, e)


def _destroy(sub: Path) -> None:
    with contextlib.suppress(WorkspaceError):  # a read-only snapshot is made writable first
        set_readonly(sub, False)
    _ioctl(sub.parent, _IOC_SNAP_DESTROY,
           struct.pack("=q", 0) + _name_arg(sub, _VOL_NAME_MAX).ljust(_VOL_NAME_MAX + 1, b"\0"))


def _raise_unless_gone(sub: Path, error: OSError) -> None:
    # gone meanwhile: a concurrent reclaim (two gc runs, gc and close) deleted it first
    if sub.exists():
        raise WorkspaceError(f"deleting subvolume {sub} failed: {error.strerror or error}") from error


# disk quotas ---------------------------------------------------------------------------
def _ioctl(path: Path, request: int, arg: bytes) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        buf = bytearray(arg)
        fcntl.ioctl(fd, request, buf)
        return bytes(buf)
    finally:
        os.close(fd)


@functools.cache
def _fsid(pool_path: str) -> str:
    return str(uuid.UUID(bytes=_ioctl(Path(pool_path), _IOC_FS_INFO, bytes(1024))[16:32]))


def _qgroups(pool_path: Path) -> Path:
    return Path("/sys/fs/btrfs") / _fsid(str(pool_path)) / "qgroups"


def quota_mode(pool_path: Path) -> str | None:
    """``squota`` or ``qgroup`` when quotas are on in the pool, else None."""
    d = _qgroups(pool_path)
    if not d.is_dir():
        return None
    try:
        return (d / "mode").read_text().strip()
    except FileNotFoundError:  # kernels before simple quotas only have full qgroups
        return "qgroup"


def ensure_quota(pool_path: Path) -> str:
    """Turn simple quotas on in the pool if no quota mode is on yet; return the mode in force.

    Full qgroups, if someone enabled them, are left on (limits work there too, at the
    snapshot cost measured above).
    """
    mode = quota_mode(pool_path)
    if mode:
        return mode
    try:
        _ioctl(pool_path, _IOC_QUOTA_CTL, struct.pack("=QQ", _QUOTA_CTL_ENABLE_SIMPLE, 0))
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise SetupError(f"cannot enable btrfs simple quotas on {pool_path}: {e}") from e
        # a kernel before 6.7 (the kmod VM's 6.1) has no simple quotas: full qgroups limit as
        # well, at a cost in snapshot time, and charge a clone for the files it inherited too
        try:
            _ioctl(pool_path, _IOC_QUOTA_CTL, struct.pack("=QQ", _QUOTA_CTL_ENABLE, 0))
        except OSError as e2:
            raise SetupError(f"cannot enable btrfs quotas on {pool_path}: simple quotas: {e}; qgroups: {e2}") from e2
        log.warning("no btrfs simple quotas on this kernel (Linux 6.7+): enabled full qgroups on %s", pool_path)
        return quota_mode(pool_path) or "qgroup"
    log.info("enabled btrfs simple quotas on %s", pool_path)
    return quota_mode(pool_path) or "squota"


def subvolume_id(path: Path) -> int:
    """The btrfs id of the subvolume ``path`` is the top of."""
    return struct.unpack_from("=Q", _ioctl(path, _IOC_INO_LOOKUP, struct.pack("=QQ", 0, 256) + bytes(4080)))[0]


def limit_subvolume(path: Path, max_bytes: int) -> None:
    """Cap what a subvolume may hold under the pool's quota (0: no cap); writes past it fail
    with EDQUOT inside the workspace, and nothing else in the pool is touched."""
    if max_bytes:
        ensure_quota(path.parent)
    elif quota_mode(path.parent) is None:
        return
    # qgroupid 0: the subvolume of the descriptor; the kernel's "no limit" is all ones
    try:
        _ioctl(path, _IOC_QGROUP_LIMIT, struct.pack("=QQQQQQ", 0, _LIMIT_MAX_RFER, max_bytes or (1 << 64) - 1, 0, 0, 0))
    except OSError as e:  # named: a bare OSError out of a fork says neither what nor where
        raise WorkspaceError(f"setting the disk limit of subvolume {path} to {max_bytes} bytes failed: "
                             f"{e.strerror or e}") from e


def disk_usage(path: Path) -> tuple[int, int] | None:
    """(bytes charged, limit; 0 = none) of a subvolume under the pool's quota; None if quotas
    are off. Read from sysfs: no transaction, cheap enough for every step."""
    try:
        qg = _qgroups(path.parent) / f"0_{subvolume_id(path)}"
        used = int((qg / "referenced").read_text())
        limit = int((qg / "max_referenced").read_text()) if (qg / "max_referenced").exists() else 0
    except (OSError, ValueError):
        return None
    return used, limit if limit < 1 << 63 else 0


def clear_stale_qgroups(pool_path: Path) -> int:
    """Remove the quota groups of deleted subvolumes (``bunshin gc``); returns how many went.

    The kernel keeps a deleted subvolume's qgroup until asked; one whose extents are still
    being freed (the cleaner runs every commit, ~30 s) is busy and goes in a later run."""
    if quota_mode(pool_path) is None:
        return 0
    proc = subprocess.run(["btrfs", "qgroup", "clear-stale", str(pool_path)], capture_output=True, text=True)
    return proc.stdout.count("Delete stale qgroup")
