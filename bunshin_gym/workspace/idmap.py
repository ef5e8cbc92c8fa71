"""The user namespace of workspaces: root inside is an unprivileged host id.

Every workspace runs in its own user namespace whose ids ``0..COUNT-1`` map to host ids
``BASE..BASE+COUNT-1`` (``BUNSHIN_USERNS_BASE``, default 1000000, 65536 ids; ``BUNSHIN_USERNS=0``
turns it off). Root inside then owns nothing of the host: a file it creates is owned by host
uid ``BASE``, and a host file it could reach would be "nobody" to it.

Files show the right owners inside by **shifted ownership**, not idmapped mounts: each image
gets one shifted copy (a writable btrfs snapshot of the image with every owner moved up by
``BASE``, then frozen read-only), made once per image and shared by all its workspaces, and
upper layers are created owned by ``BASE``. Why not idmapped mounts: CRIU 4.2 neither dumps
nor restores idmapped mounts, and the overlay's layers would all have to be idmapped again on
every restore; the shifted copy costs a few seconds once per image and nothing per fork (the
snapshot shares all data extents with the image; only metadata is rewritten). All workspaces
share one range, as with Docker's userns-remap: they cannot reach each other's files anyway
(own mount namespaces, no snapshot store), and one range keeps the image's page cache shared.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.config import userns_base
from bunshin_gym.workspace import pool

log = logging.getLogger(__name__)

FILE_CAPS = "security.capability"  # chown drops it; put back after


@dataclass(frozen=True)
class IdMap:
    base: int
    count: int = 65536

    @property
    def arg(self) -> str:
        """The launcher's IDMAP argument."""
        return f"{self.base}:{self.count}"


def current() -> IdMap | None:
    """The id map new workspaces get (None: no user namespace)."""
    base = userns_base()
    return IdMap(base) if base is not None else None


def launch_arg(idmap: IdMap | None) -> str:
    return idmap.arg if idmap else "-"


def shift_tree(root: Path, base: int) -> int:
    """Move every owner under ``root`` up by ``base`` (uids and gids), keeping setuid/setgid
    bits and file capabilities, which chown clears. Returns the number of entries."""
    n = 0
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files, ""] if dirpath == str(root) else [*dirs, *files]:
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            if st.st_uid >= base:
                continue  # shifted already (a resumed shift)
            caps = None
            if stat.S_ISREG(st.st_mode):
                try:
                    caps = os.getxattr(path, FILE_CAPS, follow_symlinks=False)
                except OSError:
                    caps = None
            os.chown(path, st.st_uid + base, st.st_gid + base, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode))
            if caps is not None:
                os.setxattr(path, FILE_CAPS, caps, follow_symlinks=False)
            n += 1
    return n


def shifted_path(image_path: Path, base: int) -> Path:
    """Where the shifted copy of an image lives (no dot: image names end in ``.json``)."""
    return image_path.with_name(f"{image_path.name}-ids{base}")


def shifted_copies(image_path: Path) -> list[Path]:
    """Every shifted copy of an image, with the files that mark them (for pruning)."""
    return sorted(image_path.parent.glob(f"{image_path.name}-ids*"))


def shifted_image(image_path: Path, idmap: IdMap) -> Path:
    """The read-only copy of an image with owners shifted for ``idmap`` (made once)."""
    dst = shifted_path(image_path, idmap.base)
    done = dst.with_name(dst.name + ".shifted")  # beside it: nothing may appear in the image's root
    if done.exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    with open(image_path.parent / f".{dst.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return dst
        for stale in (tmp, dst):
            if stale.exists():
                pool.delete_subvolume(stale)
        t0 = time.perf_counter()
        pool.snapshot_subvolume(image_path, tmp)
        n = shift_tree(tmp, idmap.base)
        pool.set_readonly(tmp)
        os.rename(tmp, dst)
        done.write_text(f"{idmap.base}\n")
        log.info("shifted %s for user namespace base %d: %d entries in %.1f s", image_path.name, idmap.base, n,
                 time.perf_counter() - t0)
    return dst


def lower_image(image_path: Path | str, base: int | None) -> Path:
    """The image layer a workspace with this namespace base mounts (shifted when it has one)."""
    return shifted_image(Path(image_path), IdMap(base)) if base is not None else Path(image_path)


def let_restores_traverse(directory: Path) -> None:
    """Let a restore in a user namespace reach images below a host-private directory.

    CRIU's restoring tasks open image files (a delta's ``parent`` link, its pages) after they
    entered the workspace's user namespace, where host root's 0700 directories are closed to
    them. The directory gets group = the namespace's root group and mode 0710: they may pass
    through it (not list it); host users other than root still cannot.
    """
    ids = current()
    st = directory.stat()
    if ids is None or (st.st_gid == ids.base and stat.S_IMODE(st.st_mode) == 0o710):
        return
    os.chown(directory, 0, ids.base)
    os.chmod(directory, 0o710)


def own_dirs(idmap: IdMap | None, *dirs: Path) -> None:
    """Give fresh directories (a workspace's upper and work) to the namespace's root."""
    if idmap is None:
        return
    for d in dirs:
        os.chown(d, idmap.base, idmap.base)
