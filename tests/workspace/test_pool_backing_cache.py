"""``pool.drop_backing_cache``: after it, a read of the pool that btrfs's own cache misses goes
to the disk, not to the host's cache of the pool's loop file (what ``bunshin bench epoch``
needs to time a restore "from disk")."""

from __future__ import annotations

import os
import secrets

from bunshin_gym.config import paths
from bunshin_gym.workspace import pool


def test_a_file_dropped_from_both_caches_is_no_longer_in_the_loop_files_cache():
    p = paths()
    f = p.pool / f".cache-probe-{secrets.token_hex(4)}"
    try:
        f.write_bytes(os.urandom(16 << 20))
        pool.drop_backing_cache(p)  # written back: the file's blocks are on the disk
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of btrfs's cache
        finally:
            os.close(fd)
        f.read_bytes()  # read through the loop device: now in the loop file's cache as well
        cached = pool.drop_backing_cache(p)
        assert cached >= 16 << 20, cached
        # what the host caches of the file now is what other agents read since: far less
        assert pool.drop_backing_cache(p) < cached // 2
    finally:
        f.unlink(missing_ok=True)


def test_nothing_to_drop_when_the_pool_is_not_on_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("BUNSHIN_POOL_FILE", str(tmp_path / "absent.img"))
    assert pool.drop_backing_cache(paths()) == 0
