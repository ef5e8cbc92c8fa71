"""The env API's wire format: a JSON header plus binary blobs, so that arrays (screenshots)
travel as compressed bytes, not as JSON lists.

A frame is ``MAGIC``, a 4-byte big-endian header length, the UTF-8 JSON header, then the
blobs back to back; the header lists their lengths under ``"_blobs"``. An array inside the
value is replaced by ``{"__ndarray__": i, "dtype", "shape", "codec"}`` naming blob ``i``,
its bytes compressed with zstd's fast level -1 (a 1920x1080 screenshot: ~6 MB raw, ~120 KB
compressed in ~15 ms, decompressed in ~6 ms; PNG took ~300 ms and zlib ~130 ms to
compress the same). Bytes values travel as blobs too. Spaces travel as JSON descriptions
(:func:`space_to_json`).
"""

from __future__ import annotations

import json
import struct
import threading
from typing import Any

import numpy as np
import zstandard
from gymnasium import spaces

from bunshin_gym.errors import BunshinError

MAGIC = b"BSN1"
MEDIA_TYPE = "application/x-bunshin-frame"
#: zstd effort: a step's latency matters more than the bytes on a loopback or LAN link; the
#: first fast level (-1) gave the same size as level 1 on desktop screenshots, 30-60% sooner
ZSTD_LEVEL = -1
_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "pair"):
        _local.pair = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _local.pair


class FrameError(BunshinError, ValueError):
    """Bytes that are not a frame of this format."""


def _encode_array(a: np.ndarray, blobs: list[bytes]) -> dict:
    a = np.ascontiguousarray(a)
    blobs.append(_zstd()[0].compress(a.tobytes()))
    return {"__ndarray__": len(blobs) - 1, "dtype": a.dtype.str, "shape": list(a.shape), "codec": "zstd"}


def _decode_array(ref: dict, blobs: list[bytes]) -> np.ndarray:
    try:
        if ref["codec"] != "zstd":
            raise FrameError(f"unknown array codec {ref['codec']!r}")
        raw = _zstd()[1].decompress(blobs[ref["__ndarray__"]])
        return np.frombuffer(raw, dtype=np.dtype(ref["dtype"])).reshape(tuple(int(n) for n in ref["shape"]))
    except (KeyError, IndexError, TypeError, ValueError, zstandard.ZstdError) as e:
        raise FrameError(f"a bad array in the frame: {e}") from None


def _lower(value: Any, blobs: list[bytes]) -> Any:
    if isinstance(value, np.ndarray):
        return _encode_array(value, blobs)
    if isinstance(value, dict):
        return {str(k): _lower(v, blobs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lower(v, blobs) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        blobs.append(value)
        return {"__bytes__": len(blobs) - 1}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # an odd info value (a path, an enum): its text, never a failed step


def _raise(value: Any, blobs: list[bytes]) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return _decode_array(value, blobs)
        if "__bytes__" in value and len(value) == 1:
            return blobs[value["__bytes__"]]
        return {k: _raise(v, blobs) for k, v in value.items()}
    if isinstance(value, list):
        return [_raise(v, blobs) for v in value]
    return value


def encode(value: Any) -> bytes:
    """One frame holding ``value`` (dicts, lists, scalars, strings, arrays, bytes)."""
    blobs: list[bytes] = []
    header = json.dumps({"value": _lower(value, blobs), "_blobs": [len(b) for b in blobs]},
                        separators=(",", ":"), allow_nan=True).encode()
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *blobs])


def decode(data: bytes) -> Any:
    if data[:4] != MAGIC or len(data) < 8:
        raise FrameError("not a bunshin frame (bad magic)")
    (n,) = struct.unpack(">I", data[4:8])
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise FrameError(f"a bad frame header: {e}") from None
    blobs, at = [], 8 + n
    for size in header.get("_blobs", []):
        blobs.append(data[at:at + size])
        at += size
    if at != len(data):
        raise FrameError(f"the frame is {len(data)} bytes, its header names {at}")
    return _raise(header["value"], blobs)


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
