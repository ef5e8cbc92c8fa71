"""Frame deltas (bunshin_gym.serve.frames through codec.encode/decode): every array a client
rebuilds is byte-for-byte the server's, whatever answers it saw, lost or shared."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from bunshin_gym.serve import codec, frames
from bunshin_gym.serve.frames import FrameStore, HeldFrames

SHOT = "/observation/screenshot"


def screen(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = np.full((1080, 1920, 3), 230, np.uint8)
    a[100:300, 200:900] = rng.integers(0, 255, (200, 700, 3), np.uint8)
    return a


def header(data: bytes) -> dict:
    (n,) = struct.unpack(">I", data[4:8])
    return json.loads(data[8:8 + n])


def ref_of(data: bytes) -> dict:
    return header(data)["value"]["observation"]["screenshot"]


def answer(a: np.ndarray, store: FrameStore, held: HeldFrames | None) -> bytes:
    return codec.encode({"observation": {"screenshot": a, "text": "x"}, "reward": 0.0}, store=store,
                        bases=held.ids() if held is not None else {})


def received(data: bytes, held: HeldFrames) -> np.ndarray:
    return codec.decode(data, held)["observation"]["screenshot"]


def test_unchanged_and_changed_rows_travel_as_deltas_and_rebuild_exactly():
    store, held = FrameStore(), HeldFrames()
    first = screen()
    data = answer(first, store, held)
    assert ref_of(data)["codec"] == "zstd" and "id" in ref_of(data)
    got = received(data, held)
    assert np.array_equal(got, first) and got.dtype == first.dtype and not got.flags.writeable

    again = first.copy()  # a new array with the same pixels, as the env returns each step
    data = answer(again, store, held)
    assert ref_of(data)["codec"] == "same" and header(data)["_blobs"] == []
    assert received(data, held) is got, "an unchanged array comes back as the same (read-only) object"

    moved = first.copy()
    moved[500:520, 40:60] = 7  # a cursor-sized change
    moved[1079] = 1
    data = answer(moved, store, held)
    ref = ref_of(data)
    assert ref["codec"] == "zstd-rows" and ref["spans"] == [[500, 520], [1079, 1080]]
    assert len(data) < 4000
    got = received(data, held)
    assert got.tobytes() == moved.tobytes()
    with pytest.raises(ValueError):
        got.flags.writeable = True  # nobody can change a base the client keeps
    assert np.array_equal(held.get(SHOT)[1], moved)

    whole = screen(seed=1)  # most rows changed: a whole array is cheaper to apply
    whole[:] = 3
    data = answer(whole, store, held)
    assert ref_of(data)["codec"] == "zstd"
    assert received(data, held).tobytes() == whole.tobytes()


def test_bit_patterns_count_not_values():
    store, held = FrameStore(), HeldFrames()
    a = np.zeros((256, 64), np.float64)
    a[3, 3] = np.nan
    received_a = codec.decode(codec.encode({"a": a}, store=store, bases=held.ids()), held)["a"]
    b = a.copy()
    b[5, 5] = -0.0  # equal as a value, not as bytes
    data = codec.encode({"a": b}, store=store, bases=held.ids())
    assert header(data)["value"]["a"]["codec"] == "zstd-rows", "-0.0 differs from 0.0 byte-for-byte"
    got = codec.decode(data, held)["a"]
    assert got.tobytes() == b.tobytes() and np.isnan(got[3, 3]) and np.signbit(got[5, 5])
    data = codec.encode({"a": b.copy()}, store=store, bases=held.ids())
    assert header(data)["value"]["a"]["codec"] == "same", "NaN equals itself byte-for-byte"
    assert received_a.tobytes() == a.tobytes()


def test_a_lost_answer_and_a_second_client_still_get_exact_arrays():
    store = FrameStore()
    alice, bob = HeldFrames(), HeldFrames()
    shots = [screen()]
    for i in range(1, 6):
        s = shots[-1].copy()
        s[10 * i:10 * i + 5] = i
        shots.append(s)
    assert received(answer(shots[0], store, alice), alice).tobytes() == shots[0].tobytes()
    answer(shots[1], store, alice)  # lost on the way: alice still holds shots[0]
    data = answer(shots[2], store, alice)
    assert ref_of(data)["codec"] == "zstd-rows"
    assert received(data, alice).tobytes() == shots[2].tobytes()
    # bob, a second client of the same env, holds nothing yet, then his own base
    assert received(answer(shots[3], store, bob), bob).tobytes() == shots[3].tobytes()
    data = answer(shots[4], store, alice)
    assert ref_of(data)["codec"] == "zstd-rows", "alice's base is still kept"
    assert received(data, alice).tobytes() == shots[4].tobytes()
    data = answer(shots[5], store, bob)
    assert received(data, bob).tobytes() == shots[5].tobytes()
    assert len(store) <= frames.KEEP


def test_a_base_the_server_dropped_gets_the_whole_array():
    store, held = FrameStore(keep=1), HeldFrames()
    a, b, c = screen(0), screen(0), screen(0)
    b[0] = 1
    c[1] = 2
    received(answer(a, store, held), held)
    answer(b, store, held)  # lost; its array replaced a's, the only one kept
    data = answer(c, store, held)
    assert ref_of(data)["codec"] == "zstd"
    assert received(data, held).tobytes() == c.tobytes()


def test_a_clone_starts_from_its_parent_s_frames_and_goes_its_own_way():
    store, held = FrameStore(), HeldFrames()
    base = screen()
    received(answer(base, store, held), held)
    clone_store, clone_held = store.fork(), held.copy()
    mine, theirs = base.copy(), base.copy()
    mine[0:4] = 1
    theirs[900:904] = 2
    d1, d2 = answer(mine, store, held), answer(theirs, clone_store, clone_held)
    assert ref_of(d1)["codec"] == ref_of(d2)["codec"] == "zstd-rows"
    assert received(d1, held).tobytes() == mine.tobytes()
    assert received(d2, clone_held).tobytes() == theirs.tobytes()
    assert held.get(SHOT)[0] != clone_held.get(SHOT)[0]


def test_an_env_that_reuses_its_array_gets_whole_arrays():
    store, held = FrameStore(), HeldFrames()
    buf = screen()
    received(answer(buf, store, held), held)
    buf[50:60] = 9  # the env writes into the array it handed out: the kept base is gone
    data = answer(buf, store, held)
    assert ref_of(data)["codec"] == "zstd"
    assert received(data, held).tobytes() == buf.tobytes()
    fresh = buf.copy()
    fresh[70] = 1
    buf[60] = 5  # the kept array changed after it was sent, and the new one is another array
    data = answer(fresh, store, held)
    assert ref_of(data)["codec"] == "zstd", "rows are never sent against a kept array that changed"
    assert received(data, held).tobytes() == fresh.tobytes()


def test_a_delta_the_client_cannot_apply_is_an_error_and_changes_nothing():
    store, held = FrameStore(), HeldFrames()
    a = screen()
    received(answer(a, store, held), held)
    b = a.copy()
    b[7] = 0
    data = answer(b, store, held)
    with pytest.raises(codec.FrameError, match="does not hold"):
        codec.decode(data, HeldFrames())
    bad = data.replace(ref_of(data)["digest"].encode(), b"0" * 32)  # not the server's array
    with pytest.raises(codec.FrameError, match="digest"):
        codec.decode(bad, held)
    assert np.array_equal(held.get(SHOT)[1], a), "a failed answer leaves the held frames as they were"
    assert received(data, held).tobytes() == b.tobytes()


def test_without_a_store_arrays_travel_whole_as_before():
    a = screen()
    data = codec.encode({"observation": {"screenshot": a}})
    ref = ref_of(data)
    assert ref["codec"] == "zstd" and "id" not in ref
    held = HeldFrames()
    assert codec.decode(data, held)["observation"]["screenshot"].tobytes() == a.tobytes()
    assert held.ids() == {}
    small = np.arange(10, dtype=np.int32)  # under MIN_BYTES: never tracked
    store = FrameStore()
    data = codec.encode({"v": small}, store=store, bases={})
    assert "id" not in header(data)["value"]["v"] and len(store) == 0
    dates = np.arange(100000).astype("datetime64[s]")  # any dtype, as bytes
    held = HeldFrames()
    got = codec.decode(codec.encode({"d": dates}, store=store, bases={}), held)["d"]
    assert got.tobytes() == dates.tobytes() and got.dtype == dates.dtype


def test_spans():
    assert frames.spans(np.array([1, 2, 3, 7])) == [[1, 4], [7, 8]]
    assert frames.spans(np.array([], dtype=np.int64)) == []
    assert frames.spans(np.array([0])) == [[0, 1]]


@pytest.mark.parametrize("libc", [True, False])
def test_identical_by_memcmp_and_without_libc(monkeypatch, libc):
    if not libc:
        monkeypatch.setattr(frames, "_memcmp", None)
    else:
        assert frames._memcmp is not None, "this host's libc has memcmp"
    a = screen()
    assert frames.identical(a, a.copy())
    for where in ((0, 0, 0), (1079, 1919, 2), (540, 3, 1)):
        b = a.copy()
        b[where] ^= 1
        assert not frames.identical(a, b)
    f = np.zeros(1 << 14)
    g = f.copy()
    g[-1] = -0.0
    assert not frames.identical(f, g), "bytes, not values"
