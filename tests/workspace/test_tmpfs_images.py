"""criu/patches/0023: a workspace's tmpfs contents (/tmp, /run, /dev/shm...) are dumped as plain
tar images, and clones get them exactly; the gzipped tars of older dumps still restore.

The dump archives every tmpfs while the workspace is frozen: without gzip that is one process
per tmpfs instead of two (~3.7 ms to ~1.4 ms each for a small one).
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from bunshin_gym.errors import ForkError
from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.snapshots import store

#: files of every kind a tmpfs holds, on three of the workspace's tmpfs mounts
MAKE = ("set -e; mkdir -p /tmp/d/sub; printf 'hello tmp' > /tmp/d/a; chmod 640 /tmp/d/a; ln -s a /tmp/d/link; "
        "ln /tmp/d/a /tmp/d/hard; truncate -s 8M /tmp/d/sparse; "
        "printf x | dd of=/tmp/d/sparse bs=1 seek=4M conv=notrunc 2>/dev/null; mkfifo /tmp/d/fifo; "
        "chown 1000:1000 /tmp/d/sub; printf 'run data' > /run/r; printf 'shm data' > /dev/shm/s")
#: what a clone must show the same: names, sizes, modes, link counts, kinds, owners, blocks
#: used (a sparse file stays sparse), contents
LOOK = ("stat -c '%n %s %a %h %F %u:%g' /tmp/d /tmp/d/a /tmp/d/link /tmp/d/hard /tmp/d/sparse /tmp/d/fifo "
        "/tmp/d/sub /run/r /dev/shm/s; du -k /tmp/d/sparse; cat /tmp/d/a /run/r /dev/shm/s; readlink /tmp/d/link; "
        "dd if=/tmp/d/sparse bs=1 skip=4M count=1 2>/dev/null")


@pytest.fixture
def source():
    ws = Workspace.create("base")
    try:
        assert ws.exec(["sh", "-c", MAKE]).ok
        yield ws
    finally:
        ws.close()


@pytest.fixture
def snapshot(source):
    """``snapshot()``: a snapshot of the source, deleted after the test (kept by default)."""
    taken = []

    def take():
        taken.append(source.snapshot())
        return taken[-1]

    yield take
    for snap in taken:
        snap.delete()


def _clones_show(snap, want: str) -> None:
    for mode in ("share", "copy"):
        (c,) = snap.fork(1, mode=mode)
        try:
            assert c.exec(["sh", "-c", LOOK]).text == want, mode
        finally:
            c.close()


def test_tmpfs_contents_are_plain_tars_and_clones_get_them_exactly(source, snapshot):
    want = source.exec(["sh", "-c", LOOK]).text
    assert "hello tmp" in want and "shm data" in want
    snap = snapshot()
    tars = sorted(snap.criu_dir.glob("tmpfs-dev-*.tar.img"))
    assert tars and not list(snap.criu_dir.glob("tmpfs*.gz.img"))
    names = set()
    for t in tars:
        with tarfile.open(t, "r:") as archive:  # uncompressed: "r:" refuses a gzipped one
            names |= set(archive.getnames())
    assert {"./d/a", "./d/sparse", "./r", "./s"} <= names
    _clones_show(snap, want)


def test_gzipped_tmpfs_images_of_an_older_dump_still_restore(source, snapshot):
    want = source.exec(["sh", "-c", LOOK]).text
    snap = snapshot()
    for t in snap.criu_dir.glob("tmpfs-dev-*.tar.img"):  # as CRIU before 0023 wrote them
        t.with_name(t.name.replace(".tar.img", ".tar.gz.img")).write_bytes(gzip.compress(t.read_bytes()))
        t.unlink()
    store.Store(snap._p).reseal(snap)
    assert list(snap.criu_dir.glob("tmpfs-dev-*.tar.gz.img")) and not list(snap.criu_dir.glob("tmpfs-dev-*.tar.img"))
    _clones_show(snap, want)


def test_the_tmpfs_tars_run_at_once(source, snapshot, monkeypatch):
    """criu/patches/0030: every tmpfs mount's tar is started before any is reaped (they ran one
    after the other, a fork and an exec each, while the workspace was frozen). Where they run
    after the tasks: since 0041 they run beside them (test_dump_beside.py)."""
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # the tars' info lines
    monkeypatch.setenv("CRIU_NS_BESIDE", "0")
    snap = snapshot()
    lines = (snap.criu_dir / "dump.log").read_text().splitlines()
    started = [i for i, line in enumerate(lines) if ": tar " in line and line.endswith("with the other mounts' ones)")]
    done = [i for i, line in enumerate(lines) if ": tar " in line and line.endswith(" done")]
    tars = list(snap.criu_dir.glob("tmpfs-dev-*.tar.img"))
    assert len(started) == len(done) == len(tars) >= 3, (len(started), len(done), len(tars))
    assert max(started) < min(done)
    _clones_show(snap, source.exec(["sh", "-c", LOOK]).text)


def test_a_tmpfs_with_mounts_below_it_is_read_through_a_detached_copy(source, snapshot, monkeypatch):
    """criu/patches/0037: the workspace's /dev is a tmpfs with mounts below it (/dev/shm, /dev/pts,
    the device nodes); CRIU reads its own content through a copy of that mount alone, detached
    (open_tree), not through a bind mount on a temporary directory in the workspace's /tmp,
    which its user namespace refuses CRIU (EOVERFLOW), nor through the helper process that then
    copied the whole mount namespace (~5 ms frozen). The tar holds /dev's own files, none of the
    mounts below it, and clones get them."""
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # the mount's info lines
    assert source.exec(["sh", "-c", "printf 'dev data' > /dev/mine"]).ok
    snap = snapshot()
    log = (snap.criu_dir / "dump.log").read_text()
    assert re.search(r"mount has children \./dev\(\d+\)", log), log[-3000:]
    assert not re.search(r"overmounted or has children \./dev\(", log), "the helper process copied the namespace"
    assert "Can't create a temporary directory" not in log
    dev = []
    for t in snap.criu_dir.glob("tmpfs-dev-*.tar.img"):
        with tarfile.open(t, "r:") as archive:
            if "./mine" in archive.getnames():
                dev.append(archive.getnames())
    assert len(dev) == 1, "no tmpfs image holds /dev's own file"
    assert {"./shm", "./pts", "./null"} <= set(dev[0]) and "./shm/s" not in dev[0], dev[0]
    assert source.exec(["sh", "-c", "ls -d /tmp/cr-tmpfs.* /cr-tmpfs.* 2>/dev/null | wc -l"]).text.strip() == "0"
    for mode in ("share", "copy"):
        (c,) = snap.fork(1, mode=mode)
        try:
            assert c.exec(["cat", "/dev/mine"]).text == "dev data", mode
            assert c.exec(["cat", "/dev/shm/s"]).text == "shm data", mode
        finally:
            c.close()


@pytest.mark.parametrize("beside", ["1", "0"], ids=["beside-the-tasks", "after-the-tasks"])
def test_a_failed_tmpfs_tar_fails_the_snapshot_and_the_source_runs_on(source, fake_bin, monkeypatch, beside):
    """A tar that fails (here one that exits 2 once it has read its stdin, as on a full disk)
    fails the dump after the others are reaped: no snapshot, the source as it was. The tars run
    in the dumper beside the tasks (0041) or after them."""
    fake = fake_bin / "tar"
    fake.write_text("#!/bin/sh\ncat > /dev/null\nexit 2\n")
    fake.chmod(0o755)
    want = source.exec(["sh", "-c", LOOK]).text
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")  # CRIU's PATH is ours
    monkeypatch.setenv("CRIU_NS_BESIDE", beside)
    with pytest.raises(ForkError, match="CRIU dump") as failed:
        source.snapshot()
    monkeypatch.undo()
    log = Path(re.search(r"log: (\S+)", str(failed.value)).group(1)).read_text()
    assert "Can't dump tmpfs content" in log, log[-2000:]
    assert source.exec(["sh", "-c", LOOK]).text == want
    assert not source.cgroup.is_frozen()
    left = subprocess.run(["pgrep", "-f", "tar --create --no-unquote"], capture_output=True, text=True)
    assert left.returncode == 1, f"a tar was left running: {left.stdout}"
