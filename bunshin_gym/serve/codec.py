"""The env API's wire format: a JSON header plus binary blobs, so that arrays (screenshots)
travel as compressed bytes, not as JSON lists.

A frame is ``MAGIC``, a 4-byte big-endian header length, the UTF-8 JSON header, then the
blobs back to back; the header lists their lengths under ``"_blobs"``. An array inside the
value is replaced by ``{"__ndarray__": i, "dtype", "shape", "codec"}`` naming blob ``i``:

- ``zstd``: its bytes compressed with zstd's fast level -1, straight from the array's memory
  (a 1920x1080 desktop screenshot: 6 MB raw, ~12-120 KB compressed in 2-4 ms, decompressed
  in ~1 ms on a quiet host; PNG took ~300 ms and zlib ~130 ms to compress the same);
- with a frame store (the env API's per-env answers), large arrays also carry an ``id`` and
  the ``digest`` of the server's array, and may be ``same`` (no blob: the client's array at
  that place, ``base``, unchanged) or ``zstd-rows`` (the rows in ``spans`` replaced in the
  client's ``base``): see :mod:`bunshin_gym.serve.frames`;
- where the env knows what was drawn between the client's array and the new one (a desktop's
  X damage, ``damage=``), ``zstd-rects``: the pixels of the rectangles ``rects`` ([x, y, w, h]
  on axes 1 and 0), back to back, replaced in ``base``; nothing is compared. One such array
  in :data:`~bunshin_gym.serve.frames.CHECK_EVERY` has ``digest_follows``: its digest is
  computed after the answer went out (:meth:`~bunshin_gym.serve.frames.FrameStore.settle`)
  and a later answer against it as a base carries it as ``base_digest``, which the client
  checks.

Bytes values travel as blobs too. Spaces travel as JSON descriptions (:func:`space_to_json`).
"""
from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orjson
import zstandard
from gymnasium import spaces

from bunshin_gym.core.spaces import PrintableText
from bunshin_gym.errors import BunshinError
from bunshin_gym.serve import frames

MAGIC = b"BSN1"
MEDIA_TYPE = "application/x-bunshin-frame"
#: zstd effort: a step's latency matters more than the bytes on a loopback or LAN link; the
#: first fast level (-1) gave the same size as level 1 on desktop screenshots, 30-60% sooner
ZSTD_LEVEL = -1
_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread
#: what precedes a frame in an env channel's answer (:mod:`bunshin_gym.serve.channel`): the
#: server's seconds on the request and its encoding's seconds, big-endian doubles
CHANNEL_TIMING = struct.Struct(">dd")
#: a local channel's message (:mod:`bunshin_gym.serve.local_channel`): its kind (one of the
#: ``LOCAL_*`` below) and its length, then that many bytes
LOCAL_HEADER = struct.Struct(">BI")
#: client to server: a JSON object (the hello, then requests)
LOCAL_JSON = 1
#: server to client: an answer (``CHANNEL_TIMING`` then a frame); an error (JSON, the HTTP
#: status and message of the same error); the hello accepted (empty)
LOCAL_ANSWER, LOCAL_ERROR, LOCAL_OK = 2, 3, 4


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "pair"):
        _local.pair = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _local.pair


#: values an answer carries as they are (exact types: a subclass goes through ``lower``; so do
#: floats, which may be NaN or infinite)
_PLAIN = frozenset({str, int, bool, type(None)})
#: what JSON gives that may hold an array or bytes
_NESTED = frozenset({dict, list})


def loads(raw: bytes | bytearray | memoryview | str) -> Any:
    """JSON text as Python values, exactly as ``json.loads`` reads it: by orjson (a step's
    header and request are read in about half the time, on both ends of every hot call), and by
    ``json`` for what orjson reads otherwise or refuses: a run of 19 digits that may be an
    integer (one that may not fit in 64 bits, which orjson would read as a float; a false alarm
    in a string only costs the slower parse), NaN and Infinity (which answers may carry), lone
    surrogates; and to raise ``json``'s own error."""
    if isinstance(raw, memoryview):
        raw = raw.cast("B") if raw.format != "B" or raw.ndim != 1 else raw
    if not _has_long_digits(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(bytes(raw) if isinstance(raw, memoryview) else raw)


#: every digit as "0": a run of 19 digits is then a run of 19 zeros, found by a substring
#: search (~1.5 us for a step's header, where a regular expression took ~10 us)
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19
_POINT = ord(".")


def _has_long_digits(raw: bytes | bytearray | memoryview | str) -> bool:
    """Whether JSON text holds a run of 19 or more ASCII digits that is not the fraction of a
    number (digits right after a point: both parsers read those as the same float; every
    answer's timings have such runs, as 0.0003290370004833676 does)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")  # digits are ASCII: the rest does not matter
    elif isinstance(raw, memoryview):
        raw = bytes(raw)
    zeros = raw.translate(_DIGITS_AS_ZERO)
    at = zeros.find(_LONG_RUN)
    while at >= 0:
        if at == 0 or zeros[at - 1] != _POINT:
            return True
        end = at + len(_LONG_RUN)
        while end < len(zeros) and zeros[end] == 0x30:  # to the run's end: the next find starts a new run
            end += 1
        at = zeros.find(_LONG_RUN, end)
    return False


def dumps(value: Any, *, finite: bool) -> bytes:
    """JSON text of ``value`` as ``json.dumps(allow_nan=True)`` would give it (the same values
    read back): by orjson (~15x faster for a step's header), by ``json`` where orjson would write
    something else or refuses: ``finite=False`` (the caller saw a NaN or an infinity, which
    orjson writes as null), an integer beyond 64 bits, a lone surrogate, a type it does not
    know."""
    if finite:
        try:
            return orjson.dumps(value)
        except orjson.JSONEncodeError:
            pass
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


class FrameError(BunshinError, ValueError):
    """Bytes that are not a frame of this format."""


#: what an env knows was drawn between two arrays it returned, old then new: rectangles
#: (x, y, w, h), or None when it does not know
Damage = Callable[[np.ndarray, np.ndarray], "list[tuple[int, int, int, int]] | None"]


class _Encoder:
    """One answer's encoding: blobs, and frame deltas when a store is given (see
    :mod:`bunshin_gym.serve.frames`)."""

    def __init__(self, store: frames.FrameStore | None, bases: Mapping[str, str] | None,
                 damage: Mapping[str, Damage] | None = None):
        self.blobs: list[bytes] = []
        self.store = store
        self.bases = bases or {}
        self.damage = damage or {}
        #: no NaN or infinity in the answer (what orjson would write as null)
        self.finite = True

    def blob(self, data: Any) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def array(self, a: np.ndarray, place: str) -> dict:
        a = np.ascontiguousarray(a)
        head = {"dtype": a.dtype.str, "shape": list(a.shape)}
        if self.store is None or a.nbytes < frames.MIN_BYTES or a.ndim == 0 or a.shape[0] == 0:
            return {"__ndarray__": self.blob(_zstd()[0].compress(frames.byte_view(a))), **head, "codec": "zstd"}
        base_id = self.bases.get(place)
        entry = self.store.get(base_id) if isinstance(base_id, str) else None
        # an env that hands out the same buffer again has changed the kept array: no base
        if entry is not None and entry[0].shape == a.shape and entry[0].dtype == a.dtype \
                and not np.may_share_memory(entry[0], a):
            base, base_digest = entry
            damage = self.damage.get(place)
            rects = damage(base, a) if damage is not None and a.ndim >= 2 else None
            if rects is not None:
                ref = self.rects(a, head, base_id, base_digest, rects)
                if ref is not None:
                    return ref
            # unchanged, the common case, ends here: one memcmp (~0.7 ms for 6 MB, quiet)
            elif frames.identical(base, a):
                # the new array is the base from now on: the env's damage is known against it
                # (the base may be older than the env's connection: a snapshot closes it, and a
                # new one knows no damage before its first capture)
                self.store.rebase(base_id, a)
                return {"__ndarray__": None, **head, "codec": "same", "base": base_id, "id": base_id,
                        "digest": base_digest}
            rows = frames.changed_rows(base, a)
            # rows changed: they are sent against the kept array, which must still be the one sent
            if len(rows) <= frames.MAX_CHANGED_SHARE * a.shape[0] and self.store.intact(base_id):
                a_digest = frames.digest(a)
                data = _zstd()[0].compress(frames.byte_view(np.ascontiguousarray(a[rows])))
                return {"__ndarray__": self.blob(data), **head, "codec": "zstd-rows", "base": base_id,
                        "spans": frames.spans(rows), "id": self.store.put(a, a_digest), "digest": a_digest}
        a_digest = frames.digest(a)
        return {"__ndarray__": self.blob(_zstd()[0].compress(frames.byte_view(a))), **head, "codec": "zstd",
                "id": self.store.put(a, a_digest), "digest": a_digest}

    def rects(self, a: np.ndarray, head: dict, base_id: str, base_digest: str | None,
              rects: list[tuple[int, int, int, int]]) -> dict | None:
        """``a`` as the client's ``base`` with ``rects`` replaced (the env's word for what
        changed: nothing is compared); None when they cover too much of it to be worth it."""
        checked = {"base_digest": base_digest} if base_digest else {}
        if not rects:
            # the same pixels in a later array: that array is the base from now on (the env's
            # damage is known from it onwards)
            self.store.rebase(base_id, a)
            return {"__ndarray__": None, **head, "codec": "same", "base": base_id, "id": base_id, **checked}
        if sum(w * h for _, _, w, h in rects) > frames.MAX_CHANGED_SHARE * a.shape[0] * a.shape[1]:
            return None
        pixels = np.concatenate([a[y:y + h, x:x + w].reshape(-1) for x, y, w, h in rects])
        data = _zstd()[0].compress(frames.byte_view(pixels))
        fid, check = self.store.put_drawn(a)
        return {"__ndarray__": self.blob(data), **head, "codec": "zstd-rects", "base": base_id,
                "rects": [list(r) for r in rects], "id": fid, **({"digest_follows": True} if check else {}),
                **checked}

    def lower(self, value: Any, place: str) -> Any:
        if isinstance(value, np.ndarray):
            return self.array(value, place)
        if isinstance(value, float):  # numpy's float64 included
            if not math.isfinite(value):
                self.finite = False
            return float(value)
        # plain values (most of an answer) are taken as they are, without a call or a place
        if isinstance(value, dict):
            return {str(k): v if type(v) in _PLAIN else self.lower(v, f"{place}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [v if type(v) in _PLAIN else self.lower(v, f"{place}/{i}") for i, v in enumerate(value)]
        if isinstance(value, np.generic):
            return self.lower(value.item(), place)  # a float32 NaN is seen as one
        if isinstance(value, bytes):
            return {"__bytes__": self.blob(value)}
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return str(value)  # an odd info value (a path, an enum): its text, never a failed step


class _Decoder:
    def __init__(self, blobs: list[bytes], held: frames.HeldFrames | None):
        self.blobs = blobs
        self.held = held
        self.received: dict[str, tuple[str, np.ndarray]] = {}
        self.to_check: set[str] = set()  # ids of received arrays whose digest will follow

    def array(self, ref: dict, place: str) -> np.ndarray:
        try:
            kind = ref["codec"]
            dtype, shape = np.dtype(ref["dtype"]), tuple(int(n) for n in ref["shape"])
            if kind == "zstd":
                raw = _zstd()[1].decompress(self.blobs[ref["__ndarray__"]])
                a = np.frombuffer(raw, dtype=dtype).reshape(shape)
            elif kind in ("same", "zstd-rows", "zstd-rects"):
                base = self.held.get(place) if self.held is not None else None
                if base is None or base[0] != ref["base"]:
                    raise FrameError(f"{place}: a delta against frame {ref['base']!r}, which this client does "
                                     f"not hold ({base[0] if base else 'none'})")
                if base[1].shape != shape or base[1].dtype != dtype:
                    raise FrameError(f"{place}: a delta of a {shape} {dtype} array against a "
                                     f"{base[1].shape} {base[1].dtype} one")
                if ref.get("base_digest") is not None:
                    # the server's digest of the base, checked one answer late (see the module doc)
                    if not self.held.check(place, ref["base"], ref["base_digest"]):
                        raise FrameError(f"{place}: the array this client holds as {ref['base']} is not the "
                                         "server's (digest mismatch, found one answer late)")
                if kind == "same":
                    a = base[1]  # read-only: the same object serves again
                elif kind == "zstd-rows":
                    a = self.patch(base[1], ref, place)
                else:
                    a = self.patch_rects(base[1], ref, place)
            else:
                raise FrameError(f"unknown array codec {kind!r}")
        except (KeyError, IndexError, TypeError, ValueError, zstandard.ZstdError) as e:
            if isinstance(e, FrameError):
                raise
            raise FrameError(f"a bad array in the frame: {e}") from None
        if "id" in ref:
            if kind not in ("same", "zstd-rects") and frames.digest(a) != ref["digest"]:
                raise FrameError(f"{place}: the rebuilt array is not the server's (digest mismatch)")
            self.received[place] = (ref["id"], a)
            if ref.get("digest_follows"):
                self.to_check.add(ref["id"])
        return a

    def _writable_copy(self, base: np.ndarray, ref: dict, place: str) -> np.ndarray:
        """A copy of the base to patch: the one the client made while it waited, if any."""
        spare = self.held.take_spare(place, ref["base"]) if self.held is not None else None
        return spare if spare is not None else base.copy()

    def patch(self, base: np.ndarray, ref: dict, place: str) -> np.ndarray:
        rows = np.frombuffer(_zstd()[1].decompress(self.blobs[ref["__ndarray__"]]), dtype=base.dtype)
        rows = rows.reshape(-1, *base.shape[1:])
        out = self._writable_copy(base, ref, place)
        at = 0
        for start, stop in ref["spans"]:
            if not 0 <= start < stop <= base.shape[0]:
                raise FrameError(f"a delta's rows [{start}, {stop}) are outside the array's {base.shape[0]}")
            out[start:stop] = rows[at:at + stop - start]
            at += stop - start
        if at != len(rows):
            raise FrameError(f"a delta names {at} rows and carries {len(rows)}")
        return frames.frozen(out)

    def patch_rects(self, base: np.ndarray, ref: dict, place: str) -> np.ndarray:
        pixels = np.frombuffer(_zstd()[1].decompress(self.blobs[ref["__ndarray__"]]), dtype=base.dtype)
        cell = int(np.prod(base.shape[2:], dtype=np.int64))  # values a pixel (3 for RGB)
        height, width = base.shape[:2]
        rects = ref["rects"]
        if not isinstance(rects, list):
            raise FrameError("a delta's rects must be a list")
        out = self._writable_copy(base, ref, place)
        at = 0
        for x, y, w, h in rects:
            if not (0 <= x < x + w <= width and 0 <= y < y + h <= height):
                raise FrameError(f"a delta's rectangle {[x, y, w, h]} is outside the {width}x{height} array")
            n = w * h * cell
            if at + n > len(pixels):
                raise FrameError(f"a delta's rectangles need more than the {len(pixels)} values it carries")
            out[y:y + h, x:x + w] = pixels[at:at + n].reshape(h, w, *base.shape[2:])
            at += n
        if at != len(pixels):
            raise FrameError(f"a delta's rectangles take {at} values and it carries {len(pixels)}")
        return frames.frozen(out)

    def raise_(self, value: Any, place: str) -> Any:
        if isinstance(value, dict):
            if "__ndarray__" in value:
                return self.array(value, place)
            if "__bytes__" in value and len(value) == 1:
                return bytes(self.blobs[value["__bytes__"]])
            return {k: self.raise_(v, f"{place}/{k}") if type(v) in _NESTED else v for k, v in value.items()}
        if isinstance(value, list):
            return [self.raise_(v, f"{place}/{i}") if type(v) in _NESTED else v for i, v in enumerate(value)]
        return value


def encode(value: Any, *, store: frames.FrameStore | None = None, bases: Mapping[str, str] | None = None,
           damage: Mapping[str, Damage] | None = None) -> bytes:
    """One frame holding ``value`` (dicts, lists, scalars, strings, arrays, bytes).

    With ``store`` (the env's :class:`~bunshin_gym.serve.frames.FrameStore`), large arrays
    are sent as deltas against the arrays the client holds (``bases``: {place: id}, as
    :meth:`~bunshin_gym.serve.frames.HeldFrames.ids` gives them) and kept for the next answer;
    ``damage`` ({place: function}) says what changed between two arrays at a place, where
    the env knows (then nothing is compared).
    """
    enc = _Encoder(store, bases, damage)
    lowered = enc.lower(value, "")
    header = dumps({"value": lowered, "_blobs": [len(b) for b in enc.blobs]}, finite=enc.finite)
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *enc.blobs])


def decode(data: bytes | memoryview, held: frames.HeldFrames | None = None) -> Any:
    """The value of a frame. ``held``: the client's frames, which deltas are applied to and
    which the answer's large arrays then replace (only once the whole frame decoded)."""
    data = memoryview(data)  # blobs are views: a whole screenshot is not copied to be read
    if len(data) < 8 or bytes(data[:4]) != MAGIC:
        raise FrameError("not a bunshin frame (bad magic)")
    (n,) = struct.unpack(">I", data[4:8])
    try:
        header = loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise FrameError(f"a bad frame header: {e}") from None
    blobs, at = [], 8 + n
    for size in header.get("_blobs", []):
        blobs.append(data[at:at + size])
        at += size
    if at != len(data):
        raise FrameError(f"the frame is {len(data)} bytes, its header names {at}")
    dec = _Decoder(blobs, held)
    value = dec.raise_(header["value"], "")
    if held is not None:
        held.update(dec.received, dec.to_check)
    return value


# spaces -------------------------------------------------------------------------------------
def space_to_json(space: spaces.Space | None) -> dict | None:
    """A JSON description of a space: gymnasium's standard spaces exactly; any other space as
    its class and public attributes (rebuilt by a client that can import the class)."""
    if space is None:
        return None
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {k: space_to_json(s) for k, s in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(s) for s in space.spaces]}
    if isinstance(space, spaces.Box):
        low, high = space.low, space.high
        uniform = bool((low == low.flat[0]).all() and (high == high.flat[0]).all()) if low.size else True
        return {"type": "Box", "shape": list(space.shape), "dtype": np.dtype(space.dtype).str,
                "low": low.flat[0].item() if uniform and low.size else low.tolist(),
                "high": high.flat[0].item() if uniform and high.size else high.tolist()}
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiBinary):
        return {"type": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": space.nvec.tolist(), "dtype": np.dtype(space.dtype).str}
    if isinstance(space, PrintableText):  # its arguments, not its ~48,000 characters
        return {"type": "PrintableText", "max_length": space.max_length, "min_length": space.min_length,
                "controls": space.controls}
    if isinstance(space, spaces.Text):
        return {"type": "Text", "max_length": space.max_length, "min_length": space.min_length,
                "charset": "".join(sorted(space.character_set))}
    cls = type(space)
    attrs = {k: v for k, v in vars(space).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
    return {"type": "python", "class": f"{cls.__module__}:{cls.__qualname__}", "attrs": attrs}


def space_from_json(d: dict | None) -> spaces.Space | None:
    if d is None:
        return None
    kind = d.get("type")
    if kind == "Dict":
        return spaces.Dict({k: space_from_json(v) for k, v in d["spaces"].items()})
    if kind == "Tuple":
        return spaces.Tuple([space_from_json(v) for v in d["spaces"]])
    if kind == "Box":
        dtype, shape = np.dtype(d["dtype"]), tuple(d["shape"])
        low, high = (np.broadcast_to(np.asarray(d[k], dtype=dtype), shape).copy() for k in ("low", "high"))
        return spaces.Box(low, high, shape, dtype)
    if kind == "Discrete":
        return spaces.Discrete(d["n"], start=d.get("start", 0))
    if kind == "MultiBinary":
        return spaces.MultiBinary(d["n"])
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(d["nvec"], dtype=np.dtype(d["dtype"]))
    if kind == "PrintableText":
        return PrintableText(d["max_length"], min_length=d["min_length"], controls=d["controls"])
    if kind == "Text":
        return spaces.Text(d["max_length"], min_length=d["min_length"], charset=d["charset"])
    if kind == "python":
        import importlib

        module, _, name = d["class"].partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
            space = cls.__new__(cls)
            spaces.Space.__init__(space)
            vars(space).update(d.get("attrs") or {})
            return space
        except (ImportError, AttributeError, TypeError):
            return spaces.Space()  # a client without that class: an opaque space
    raise FrameError(f"unknown space type {kind!r}")
