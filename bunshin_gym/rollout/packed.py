"""Step results as the prefix tree keeps them: pickled, then compressed with zstd.

Every executed call stores its result (a desktop's is a 1920x1080 screenshot, 6 MB raw) and
every hit and checked replay loads one, on the members' threads of a CPU-bound run. Measured
on such a screenshot: zlib (level 6, what the tree used before) 80 ms to compress and 24 ms
to decompress; zstd level 1: 5 ms each, 17% smaller. Trees written before hold zlib blobs:
they still load (a zstd frame starts with its magic number, a zlib stream never does).
"""

from __future__ import annotations

import pickle
import threading
import zlib
from typing import Any

import zstandard

#: zstd's fastest levels compress a screenshot about as well as zlib's default
ZSTD_LEVEL = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "pair"):
        _local.pair = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _local.pair


def pack(value: Any) -> bytes:
    """``value`` pickled and compressed (a zstd frame that records its size)."""
    return _contexts()[0].compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def unpack(blob: bytes) -> Any:
    """What :func:`pack` packed, or what the tree stored with zlib before it."""
    raw = _contexts()[1].decompress(blob) if blob[:4] == _ZSTD_MAGIC else zlib.decompress(blob)
    return pickle.loads(raw)
