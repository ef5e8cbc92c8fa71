"""A snapshot bundle's CRIU images unpacked on the receiving host (``host.extract_images``):
the flat image directory and a delta's ``parent`` link go in; anything else is refused before a
byte is written, with Python's extraction filter (3.11.4+) and without it (Debian 12's 3.11.2)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from bunshin_gym.cluster.host import extract_images


def bundle(*members: tarfile.TarInfo, data: bytes = b"img") -> tarfile.TarFile:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isfile() else None)
    buf.seek(0)
    return tarfile.open(fileobj=buf)


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    m.size = 3 if kind == tarfile.REGTYPE else 0
    m.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return m


@pytest.fixture(params=["this python", "without filter"])
def python(request, monkeypatch):
    if request.param == "without filter":  # as on Python 3.11.2 (which has no tar_filter at all)
        monkeypatch.delattr(tarfile, "tar_filter", raising=False)
    return request.param


def test_a_delta_bundle_unpacks_with_its_parent_link(tmp_path: Path, python):
    extract_images(bundle(member("criu", tarfile.DIRTYPE), member("criu/pages-1.img"),
                          member("criu/parent", tarfile.SYMTYPE, "../../snap-0a1b2c3d/criu")), tmp_path)
    assert (tmp_path / "criu/pages-1.img").read_bytes() == b"img"
    assert (tmp_path / "criu/parent").readlink() == Path("../../snap-0a1b2c3d/criu")


@pytest.mark.parametrize("bad", [
    member("../escape.img"),
    member("/etc/cron.d/escape"),
    member("criu/../../escape.img"),
    member("criu/parent/pages-1.img"),  # through the parent link, into a sibling snapshot
    member("criu/sub/pages-1.img"),
    member("other/pages-1.img"),
    member("criu/parent", tarfile.SYMTYPE, "/etc"),
    member("criu/parent", tarfile.SYMTYPE, "../../../../etc"),
    member("criu/core-1.img", tarfile.SYMTYPE, "../../snap-0a1b2c3d/criu"),
    member("criu/pages-1.img", tarfile.LNKTYPE, "/etc/shadow"),
    member("criu/tty", tarfile.CHRTYPE),
], ids=lambda m: f"{m.name}->{m.linkname}" if m.linkname else m.name)
def test_a_member_that_is_not_a_criu_image_is_refused_and_nothing_is_written(tmp_path: Path, python, bad):
    dest = tmp_path / "snap"
    dest.mkdir()
    with pytest.raises(ValueError, match="is not a CRIU image"):
        extract_images(bundle(member("criu", tarfile.DIRTYPE), member("criu/pages-2.img"), bad), dest)
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "escape.img").exists()
