"""Checksums of a snapshot's CRIU images, so that a truncated or altered image is refused at
restore instead of restored (a missing page must never be served as zeros: the uffd copy of
a page image is sparse past its data, so a truncated one would read back as zeros).

``take`` records ``{name: [size, "crc32:<hex>"]}`` of every image in ``meta.json`` (written
last, so the sums and the snapshot appear together). CRC-32 (zlib) because the threat is
damage, not forgery (whoever can rewrite an image can rewrite meta.json), and it is 13x
faster than SHA-256 here: about 0.25 s instead of 3 s for 300 MB of images.

Forks and rollbacks call :func:`verify_dir` on the snapshot and every snapshot its images
need (parent chain, referenced page files; ``Store.verify``). Hashing
costs a full read of the images, so a verdict is cached per process by each file's (inode,
size, mtime): a snapshot is hashed once per process, later forks only ``stat`` its files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import zlib
from pathlib import Path

from bunshin_gym.workspace.errors import SnapshotError

log = logging.getLogger(__name__)

#: files of a snapshot's ``criu`` directory that are images (logs and stats are not restored)
IMAGE_SUFFIX = ".img"
_CHUNK = 1 << 20

_verified: dict[tuple[str, str], tuple[int, int, int]] = {}  # (dir, name) -> (ino, size, mtime_ns)
_verified_lock = threading.Lock()


#: the checksum written at take; :func:`verify_dir` also reads ``sha256:`` sums
ALGORITHM = "crc32"


def _digest(path: Path, algorithm: str = ALGORITHM) -> str:
    with open(path, "rb") as f:
        if algorithm == "crc32":
            crc = 0
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
            return f"crc32:{crc:08x}"
        h = hashlib.new(algorithm)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        return f"{algorithm}:{h.hexdigest()}"


def image_files(criu_dir: Path) -> list[Path]:
    return sorted(f for f in criu_dir.iterdir() if f.name.endswith(IMAGE_SUFFIX) and f.is_file())


def checksums(criu_dir: Path) -> dict[str, list]:
    """``{image name: [size, "crc32:<hex>"]}`` of every image in a snapshot's ``criu`` directory."""
    out = {}
    for f in image_files(criu_dir):
        st = f.stat()
        out[f.name] = [st.st_size, _digest(f)]
        _remember(criu_dir, f.name, st)  # just hashed: the files are what the sums say
    return out


def _remember(criu_dir: Path, name: str, st: os.stat_result) -> None:
    with _verified_lock:
        _verified[(str(criu_dir), name)] = (st.st_ino, st.st_size, st.st_mtime_ns)


def verify_dir(snap_id: str, criu_dir: Path, sums: dict[str, list] | None) -> None:
    """Raise :class:`SnapshotError` naming the snapshot and the image when an image recorded in
    ``sums`` is missing, of another size, or of other content. Snapshots taken before images
    carried sums (``sums`` None) are let through."""
    if sums is None:
        log.debug("snapshot %s has no image checksums (taken by an older version): not verified", snap_id)
        return
    d = str(criu_dir)
    for name, (size, digest) in sorted(sums.items()):
        f = f"{d}/{name}"  # a string, not a Path: this loop runs on every fork
        try:
            st = os.stat(f)
        except FileNotFoundError:
            raise SnapshotError(f"snapshot {snap_id} is corrupt: image {name} is missing ({f})") from None
        if st.st_size != size:
            raise SnapshotError(f"snapshot {snap_id} is corrupt: image {name} has {st.st_size} bytes, "
                                f"{size} were written ({f}); it is refused, not restored")
        key = (d, name)
        with _verified_lock:
            if _verified.get(key) == (st.st_ino, st.st_size, st.st_mtime_ns):
                continue
        algorithm, _, _ = digest.partition(":")
        if _digest(Path(f), algorithm) != digest:
            raise SnapshotError(f"snapshot {snap_id} is corrupt: image {name} does not match its checksum "
                                f"({f}); it is refused, not restored")
        _remember(criu_dir, name, st)


def forget(criu_dir: Path) -> None:
    """Drop the cached verdicts of a directory (its snapshot was deleted; tests)."""
    with _verified_lock:
        for key in [k for k in _verified if k[0] == str(criu_dir)]:
            del _verified[key]
