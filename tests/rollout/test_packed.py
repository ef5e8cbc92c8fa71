"""Step results as the prefix tree keeps them (rollout/packed.py)."""

from __future__ import annotations

import pickle
import threading
import zlib

import numpy as np

from bunshin_gym.rollout.packed import pack, unpack


def screenshot_result() -> tuple:
    rng = np.random.default_rng(0)
    shot = np.full((1080, 1920, 3), 200, np.uint8)
    shot[::7, ::3] = rng.integers(0, 255, (155, 640, 3), dtype=np.uint8)  # text-like detail
    return {"screenshot": shot, "accessibility_tree": "tag\tname\n"}, 0.0, False, False, {"step": 3}


def same(a: tuple, b: tuple) -> bool:
    return (np.array_equal(a[0]["screenshot"], b[0]["screenshot"]) and a[0]["accessibility_tree"] ==
            b[0]["accessibility_tree"] and a[1:] == b[1:])


def test_a_result_comes_back_exactly_and_smaller():
    result = screenshot_result()
    blob = pack(result)
    assert len(blob) < result[0]["screenshot"].nbytes // 4
    assert same(unpack(blob), result)


def test_a_tree_written_with_zlib_before_still_loads():
    result = screenshot_result()
    old = zlib.compress(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    assert same(unpack(old), result)


def test_members_pack_and_unpack_on_their_own_threads():
    """zstd contexts are not thread-safe: many members at once must not mix their frames."""
    results = [(i, bytes([i]) * 100_000) for i in range(16)]
    out: dict[int, object] = {}

    def member(i: int) -> None:
        for _ in range(20):
            out[i] = unpack(pack(results[i]))

    threads = [threading.Thread(target=member, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out[i] == results[i] for i in range(16))
