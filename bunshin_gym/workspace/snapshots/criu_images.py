"""CRIU's image files, read and written with CRIU's own image library (pycriu, installed into
the CRIU prefix by ``criu/pycriu.sh``): the pagemaps of share-mode deltas (:mod:`.delta`) and
the file table that flattening rewrites (:mod:`.flatten`)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.errors import FlattenUnavailable


def pycriu_images(p: Paths):
    """pycriu.images, from the CRIU prefix (criu/pycriu.sh) if not importable otherwise."""
    try:
        from pycriu import images  # type: ignore[import-not-found]
        return images
    except ImportError:
        pass
    where = p.criu_prefix / "lib" / "python"
    if str(where) not in sys.path and (where / "pycriu").is_dir():
        sys.path.append(str(where))
    try:
        from pycriu import images  # type: ignore[import-not-found]
    except ImportError as e:
        raise FlattenUnavailable(f"cannot flatten snapshots: pycriu is not importable ({e}); it is installed "
                                 f"into {where} by criu/pycriu.sh (scripts/setup.sh), with the protobuf "
                                 f"package in the venv") from None
    return images


def load_image(path: Path, p: Paths | None = None) -> dict:
    """A CRIU image file decoded by pycriu (``{"magic": ..., "entries": [...]}``)."""
    images = pycriu_images(p or paths())
    with open(path, "rb") as f:
        return images.load(f)


def write_image(img: dict, path: Path, p: Paths) -> None:
    """Write a CRIU image file with pycriu, atomically (a crash leaves the old file)."""
    buf = io.BytesIO()
    pycriu_images(p).dump(img, buf)
    tmp = path.with_name(path.name + ".flatten-tmp")  # not *.img: never copied as an image
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
