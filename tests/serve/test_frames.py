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


# damage: the env says what it drew between two arrays (a desktop's X damage) -------------------
class Drawn:
    """What a damage-tracking env knows: the rectangles drawn before each array it returned
    (by identity), like the X client's capture log (whose real one tests/envs checks)."""

    def __init__(self):
        self.log: list[tuple[np.ndarray, list]] = []

    def returned(self, a: np.ndarray, rects: list) -> np.ndarray:
        self.log.append((a, rects))
        return a

    def __call__(self, old: np.ndarray, new: np.ndarray):
        at = {id(a): i for i, (a, _) in enumerate(self.log)}
        i, j = at.get(id(old)), at.get(id(new))
        if i is None or j is None or j < i:
            return None
        return [r for _, rects in self.log[i + 1:j + 1] for r in rects]


def drawn_answer(a: np.ndarray, store: FrameStore, held: HeldFrames, drawn: Drawn) -> bytes:
    return codec.encode({"observation": {"screenshot": a}}, store=store, bases=held.ids(), damage={SHOT: drawn})


def test_drawn_rectangles_travel_without_comparing_and_rebuild_exactly(monkeypatch):
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    first = drawn.returned(screen(), [(0, 0, 1920, 1080)])
    got = received(drawn_answer(first, store, held, drawn), held)  # no base yet: whole

    compared = []
    monkeypatch.setattr(frames, "identical", lambda *a: compared.append(a) or True)
    monkeypatch.setattr(frames, "changed_rows", lambda *a: compared.append(a) or np.array([], np.int64))

    typed = first.copy()
    typed[500:510, 40:70] = 9
    typed[1070:1080, 1900:1920] = 3
    drawn.returned(typed, [(40, 500, 30, 10), (1900, 1070, 20, 10)])
    data = drawn_answer(typed, store, held, drawn)
    ref = ref_of(data)
    assert ref["codec"] == "zstd-rects" and ref["rects"] == [[40, 500, 30, 10], [1900, 1070, 20, 10]]
    assert len(data) < 2000 and "digest" not in ref  # its digest is computed after the answer
    assert "base_digest" in ref  # the first frame's, known since it was sent whole
    held.prepare()  # what the channel client does while it waits
    spare = held._spares[SHOT][1]
    now = received(data, held)
    assert np.array_equal(now, typed) and not now.flags.writeable and np.shares_memory(now, spare)
    assert not got.flags.writeable and np.array_equal(got, first), "the earlier array is not touched"

    same = drawn.returned(typed.copy(), [])  # nothing drawn: same, and the newer array is the base
    data = drawn_answer(same, store, held, drawn)
    assert ref_of(data)["codec"] == "same" and received(data, held) is now
    assert store.get(ref_of(data)["id"])[0] is same
    assert compared == [], "nothing was compared"

    store.settle()  # after the answer went out: the digests of what was sent without one
    later = drawn.returned(typed.copy(), [(0, 0, 4, 4)])
    data = drawn_answer(later, store, held, drawn)
    assert ref_of(data)["base_digest"] == frames.digest(typed)
    assert np.array_equal(received(data, held), later)


def test_an_unchanged_array_found_by_comparing_is_the_base_from_then_on(monkeypatch):
    # a desktop env's snapshot closes its X connection: the next capture, on a new one, knows
    # no damage against the array the client holds, and the unchanged screen is compared once;
    # from then on what X draws is sent without comparing (it was compared every step after)
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    first = screen()  # not in the env's log any more
    received(drawn_answer(first, store, held, drawn), held)
    again = drawn.returned(first.copy(), [(0, 0, 1920, 1080)])  # the new connection's first capture
    data = drawn_answer(again, store, held, drawn)
    assert ref_of(data)["codec"] == "same"
    assert store.get(ref_of(data)["id"])[0] is again

    compared = []
    monkeypatch.setattr(frames, "identical", lambda *a: compared.append(a) or True)
    monkeypatch.setattr(frames, "changed_rows", lambda *a: compared.append(a) or np.array([], np.int64))
    typed = again.copy()
    typed[500:510, 40:70] = 9
    drawn.returned(typed, [(40, 500, 30, 10)])
    data = drawn_answer(typed, store, held, drawn)
    assert ref_of(data)["codec"] == "zstd-rects" and compared == []
    assert np.array_equal(received(data, held), typed)


def test_a_held_array_that_is_not_the_server_s_is_found_one_answer_late():
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    first = drawn.returned(screen(), [(0, 0, 1920, 1080)])
    received(drawn_answer(first, store, held, drawn), held)
    second = first.copy()
    second[10:20, 10:20] = 1
    drawn.returned(second, [(10, 10, 10, 10)])
    data = drawn_answer(second, store, held, drawn)
    # the client's copy goes wrong (the env drew more than it said, or a bug): not found yet ...
    body = header(data)
    blob = data[8 + struct.unpack(">I", data[4:8])[0]:]
    bad = np.frombuffer(codec._zstd()[1].decompress(blob), np.uint8).copy()
    bad[0] ^= 1
    blob = codec._zstd()[0].compress(bad.tobytes())
    body["_blobs"] = [len(blob)]
    h = json.dumps(body).encode()
    tampered = codec.MAGIC + struct.pack(">I", len(h)) + h + blob
    wrong = received(tampered, held)
    assert not np.array_equal(wrong, second)
    store.settle()
    third = second.copy()
    drawn.returned(third, [])
    with pytest.raises(codec.FrameError, match="not the server's"):  # ... but at the next answer
        received(drawn_answer(third, store, held, drawn), held)
    assert held.ids() == {}, "the held arrays are dropped: the next answer is whole"
    assert np.array_equal(received(drawn_answer(third, store, held, drawn), held), third)


def test_unknown_or_too_large_damage_falls_back_to_comparing():
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    first = drawn.returned(screen(), [(0, 0, 1920, 1080)])
    received(drawn_answer(first, store, held, drawn), held)
    other = first.copy()
    other[3] = 5
    data = drawn_answer(other, store, held, drawn)  # not in the env's log: compared, by rows
    assert ref_of(data)["codec"] == "zstd-rows"
    assert np.array_equal(received(data, held), other)
    big = other.copy()
    big[:900] = 1
    drawn.returned(big, [(0, 0, 1920, 900)])
    data = drawn_answer(big, store, held, drawn)
    assert ref_of(data)["codec"] == "zstd"
    assert np.array_equal(received(data, held), big)


@pytest.mark.parametrize("rects, why", [([[1900, 0, 40, 2]], "outside"), ([[0, 0, 2, 2]], "take"),
                                        ([[0, 0, 40, 40]], "need more"), ("no", "must be a list")])
def test_bad_rectangles_are_an_error_and_change_nothing(rects, why):
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    first = drawn.returned(screen(), [(0, 0, 1920, 1080)])
    got = received(drawn_answer(first, store, held, drawn), held)
    second = first.copy()
    second[0:3, 0:3] = 2
    drawn.returned(second, [(0, 0, 3, 3)])
    data = drawn_answer(second, store, held, drawn)
    body = header(data)
    body["value"]["observation"]["screenshot"]["rects"] = rects
    n = struct.unpack(">I", data[4:8])[0]
    h = json.dumps(body).encode()
    with pytest.raises(codec.FrameError, match=why):
        received(codec.MAGIC + struct.pack(">I", len(h)) + h + data[8 + n:], held)
    assert held.get(SHOT)[1] is got


def _flip_a_pixel(data: bytes) -> bytes:
    """The same answer with one value of its rectangles' pixels changed."""
    (n,) = struct.unpack(">I", data[4:8])
    blob = bytearray(codec._zstd()[1].decompress(data[8 + n:]))
    blob[0] ^= 1
    blob = codec._zstd()[0].compress(bytes(blob))
    body = header(data)
    body["_blobs"] = [len(blob)]
    h = json.dumps(body).encode()
    return codec.MAGIC + struct.pack(">I", len(h)) + h + blob


def test_one_drawn_array_in_check_every_is_checked_and_a_wrong_one_is_found_within_that_many():
    store, held, drawn = FrameStore(), HeldFrames(), Drawn()
    a = drawn.returned(screen(), [(0, 0, 1920, 1080)])
    received(drawn_answer(a, store, held, drawn), held)
    follows = []
    for i in range(2 * frames.CHECK_EVERY):
        a = a.copy()
        a[600 + i, 5:9] = i
        drawn.returned(a, [(5, 600 + i, 4, 1)])
        data = drawn_answer(a, store, held, drawn)
        follows.append(bool(ref_of(data).get("digest_follows")))
        if i == 2:
            data = _flip_a_pixel(data)  # an unchecked array goes wrong at the client
        try:
            received(data, held)
        except codec.FrameError as e:
            assert "not the server's" in str(e)
            break
        finally:
            store.settle()
    else:
        raise AssertionError("the wrong array was never found")
    assert follows[0] and not any(follows[1:frames.CHECK_EVERY])
    assert i <= frames.CHECK_EVERY + 1, f"found only at answer {i}"


@pytest.mark.parametrize("raw", [
    b'{"reward": NaN, "low": -Infinity, "high": Infinity}',  # answers may carry them
    b'{"big": 123456789012345678901234567890, "edge": 9223372036854775807, "neg": -9223372036854775809}',
    b'{"tiny": 1e-400, "huge": 1.5e400, "z": -0.0, "f": 0.1, "i": 17}',
    b'"\\ud800 lone surrogate"', b'{"a": 1, "a": 2}', '{"s": "\\u00e9", "n": 12345678901234567890}',
    bytearray(b'[1, "2", [3.5, null, true]]'), memoryview(b'{"x": [{"y": "z"}]}'),
])
def test_loads_reads_what_json_reads(raw):
    want = json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)
    got = codec.loads(raw)
    assert repr(got) == repr(want)  # repr: NaN, -0.0 and int against float told apart


def test_long_fractions_are_read_by_orjson_as_json_reads_them(monkeypatch):
    """A run of 19 digits right after a point is a fraction, which both parsers read as the
    same float: orjson reads it (every answer's timings have such runs); integers of 19 digits
    and more still go to ``json``."""
    rng = np.random.default_rng(7)
    floats = [float(x) for x in rng.random(500) * 10.0 ** rng.integers(-12, 4, 500)]
    texts = [repr(f) for f in floats] + ["0." + "".join(map(str, rng.integers(0, 10, 40))) for _ in range(200)]
    texts += ["0.0003290370004833676", "1.00000000000000000000001", "9.9999999999999999999999e-5",
              "-0.12345678901234567890"]
    raw = ("[" + ",".join(texts) + "]").encode()
    assert not codec._has_long_digits(raw)
    want = json.loads(raw)
    monkeypatch.setattr(codec.json, "loads", lambda *_: pytest.fail("read by json, not orjson"))
    assert repr(codec.loads(raw)) == repr(want)
    for integer in (b'[0.5,12345678901234567890]', b'{"a":-1234567890123456789}', b'[1e1234567890123456789]',
                    b'[0.12345678901234567890,12345678901234567890123]'):
        assert codec._has_long_digits(integer), integer


@pytest.mark.parametrize("raw", [b'{"a":', b"\xff\xfe", memoryview(b"[1,"), b""])
def test_loads_refuses_what_json_refuses_with_a_value_error(raw):
    with pytest.raises(ValueError):
        codec.loads(raw)


@pytest.mark.parametrize("value", [
    {"reward": float("nan"), "low": -float("inf"), "high": float("inf")},  # written as json writes them
    {"reward": np.float32("nan"), "n": np.int64(7), "f": np.float64(0.1), "ok": np.bool_(True)},
    {"big": 123456789012345678901234567890, "edge": 2**63 - 1, "neg": -(2**63) - 1},  # beyond orjson's 64 bits
    {"s": "\ud800 lone surrogate", "t": "caf\u00e9 \U0001f600"},
    {"z": -0.0, "tiny": 5e-324, "f": 0.1, "nested": [{"x": (1, 2.5, None)}], 3: "an int key"},
])
def test_an_answer_reads_back_as_json_would_give_it(value):
    """The header is written by orjson where it writes the same values as ``json`` would,
    by ``json`` elsewhere: NaN and infinities (orjson writes null), integers beyond 64 bits, lone
    surrogates (orjson refuses them)."""
    got = codec.decode(codec.encode(value))
    want = json.loads(json.dumps(value, default=lambda v: v.item()))
    if any(isinstance(v, np.generic) for v in value.values()):
        want = {k: v.item() for k, v in value.items()}
    assert repr(got) == repr(want)  # repr: NaN, -0.0, int and float told apart
