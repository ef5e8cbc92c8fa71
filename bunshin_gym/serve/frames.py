"""Frame deltas: a large array (a screenshot) the client already holds is not sent again.

Over the env API the client names, per place in an answer (``/observation/screenshot``),
the id of the last array it received there; the server, which keeps the last few large
arrays it sent for each env (:class:`FrameStore`), compares the new array with that one
exactly and sends "same", only the changed rows, or (no usable base) the whole array.
A desktop step mostly changes a few rows or none: finding two 6 MB screenshots equal costs
~0.7 ms (memcmp) and finding the changed rows ~1.8 ms, where compressing one cost ~2-4 ms and
decompressing it ~1-2 ms on a quiet host (several times all of that under load).

The kept arrays are the env's own, not copies. An env that hands out the same buffer again
(writing the next screenshot into it) is detected, and so is one whose kept array changed
before rows are sent against it (its digest); an env that rewrites an array it handed out
earlier but no longer returns, to exactly the new content, is not (no bunshin env reuses
its arrays at all).

Where the env knows what it drew between two arrays (a desktop's X damage), the server
sends those rectangles without comparing anything. One such array in :data:`CHECK_EVERY`
is checked: its digest is computed after the answer went out (:meth:`FrameStore.settle`)
and compared by the client one answer late (:meth:`HeldFrames.check`). A difference stays
in every later array built on the wrong one, so it is found within that many answers; a
digest of every array cost ~0.4-0.8 ms at each end, measured, as much as everything else
the server adds to a desktop step. A client that can do work while it waits for an answer
(the env channel) makes its writable copy of the base, and the digest of an array to be
checked, meanwhile (:meth:`HeldFrames.prepare`).

Nothing depends on which answers the client saw: it states its base in each request, so a
lost answer, a second client of the same env or a clone (whose store starts as a copy of
its parent's) still gets answers it can decode; a base the server no longer keeps gets the
whole array. Every large array carries the xxh3 digest of the server's own array, and the
client checks the array it rebuilt against it: an observation is byte-for-byte the env's,
or the request fails with :class:`~bunshin_gym.serve.codec.FrameError`.

Arrays handed to the caller are read-only (as whole arrays decoded from bytes always were),
so the client can keep them as bases without copying; an unchanged array comes back as the
same object as before.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import secrets
import threading
from collections import OrderedDict

import numpy as np
import xxhash

log = logging.getLogger(__name__)

#: arrays smaller than this travel whole (tracking them costs more than sending them)
MIN_BYTES = 1 << 16
#: large arrays the server keeps per env: the last answer's, plus slack for a lost answer
#: or a second client (a 1920x1080 screenshot is 6 MB, so 18 MB an env)
KEEP = 3
#: a delta is worth it while at most this share of the rows changed
MAX_CHANGED_SHARE = 0.5
#: one array sent as drawn rectangles in this many is checked by digest (see the module doc)
CHECK_EVERY = 8
#: the digest of an array that is not checked
UNCHECKED = ""
#: ids are unique within a server process: a prefix per process, then a counter
_PREFIX = secrets.token_hex(4)
_counter = itertools.count(1)


def byte_view(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, without a copy (any dtype, datetimes included)."""
    return a.reshape(-1).view(np.uint8)


def digest(a: np.ndarray) -> str:
    """xxh3-128 of a C-contiguous array's bytes (~0.35 ms for 6 MB), as hex."""
    return xxhash.xxh3_128_hexdigest(byte_view(a))


def row_view(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as (rows, words): rows along axis 0, in the widest
    unsigned words that divide a row. Bit patterns, not values, are compared (NaN equals
    itself, -0.0 differs from 0.0), as byte-for-byte needs."""
    n = a.shape[0]
    row = a.nbytes // n
    width = next(w for w in (8, 4, 2, 1) if row % w == 0)
    return byte_view(a).view(f"<u{width}").reshape(n, row // width)


def _libc_memcmp():
    """libc's memcmp (SIMD, stops at the first difference), or None where there is no libc."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _libc_memcmp()


def identical(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether two C-contiguous arrays of one shape and dtype have the same bytes: libc's
    memcmp (0.7 ms for two equal 6 MB screenshots, where numpy's comparison took 1.8 ms;
    ctypes lets go of the GIL meanwhile)."""
    if _memcmp is None:
        return bool(np.array_equal(row_view(old), row_view(new)))
    return _memcmp(old.ctypes.data, new.ctypes.data, old.nbytes) == 0


def changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Indices along axis 0 where two C-contiguous arrays of one shape and dtype differ."""
    return np.flatnonzero((row_view(old) != row_view(new)).any(axis=1))


def spans(rows: np.ndarray) -> list[list[int]]:
    """Sorted row indices as [start, stop) runs: [1, 2, 3, 7] -> [[1, 4], [7, 8]]."""
    if not len(rows):
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1)
    starts = np.concatenate(([rows[0]], rows[breaks + 1]))
    stops = np.concatenate((rows[breaks], [rows[-1]])) + 1
    return [[int(s), int(e)] for s, e in zip(starts, stops, strict=True)]


def frozen(a: np.ndarray) -> np.ndarray:
    """``a`` (which the caller owns) as an array nobody can make writable again: a read-only
    view of a read-only owner (numpy refuses WRITEABLE on such a view)."""
    a.flags.writeable = False
    return a.view()


class FrameStore:
    """The server's side: the large arrays recently sent to the clients of one env, by id
    (least recently used dropped first). Thread-safe. The arrays are the env's own (no
    copy); each is kept with its digest, and one that changed since (an env that reuses its
    buffer) is no base any more."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._lock = threading.Lock()
        self._frames: OrderedDict[str, tuple[np.ndarray, str | None]] = OrderedDict()
        self._drawn = 0  # arrays sent as drawn rectangles

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, a: np.ndarray, a_digest: str | None) -> str:
        """Keep ``a`` (with its digest; None: computed later, by :meth:`settle`); returns its
        new id."""
        fid = f"{_PREFIX}-{next(_counter)}"
        with self._lock:
            self._frames[fid] = (a, a_digest)
            while len(self._frames) > self.keep:
                self._frames.popitem(last=False)
        return fid

    def put_drawn(self, a: np.ndarray) -> tuple[str, bool]:
        """Keep ``a``, sent as rectangles drawn on its base; returns its id and whether it is
        one to check (its digest then follows, by :meth:`settle`)."""
        with self._lock:
            self._drawn += 1
            check = self._drawn % CHECK_EVERY == 1
        return self.put(a, None if check else UNCHECKED), check

    def pending(self) -> bool:
        """Whether a digest is still to be computed (:meth:`settle` has work)."""
        with self._lock:
            return any(d is None for _, d in self._frames.values())

    def rebase(self, fid: str, a: np.ndarray) -> None:
        """``fid`` is now ``a``, an array with the same bytes (a later screenshot of an
        unchanged screen: what the env's damage is known against from now on)."""
        with self._lock:
            entry = self._frames.get(fid)
            if entry is not None:
                self._frames[fid] = (a, entry[1])

    def settle(self) -> None:
        """Compute the digests still missing (run after an answer went out, off its path)."""
        with self._lock:
            missing = [(fid, a) for fid, (a, d) in self._frames.items() if d is None]
        for fid, a in missing:
            d = digest(a)
            with self._lock:
                entry = self._frames.get(fid)
                if entry is not None and entry[0] is a and entry[1] is None:
                    self._frames[fid] = (a, d)

    def get(self, fid: str) -> tuple[np.ndarray, str | None] | None:
        """The array kept as ``fid`` and the digest it had when sent, or None (never kept,
        dropped). Its bytes may have changed since: see :meth:`intact`."""
        with self._lock:
            entry = self._frames.get(fid)
            if entry is not None:
                self._frames.move_to_end(fid)
            return entry

    def intact(self, fid: str) -> bool:
        """Whether the array kept as ``fid`` still has the bytes it was sent with (an env that
        reuses its buffer changes them); one that does not is dropped."""
        entry = self.get(fid)
        if entry is None:
            return False
        now = digest(entry[0])
        if not entry[1]:  # not settled yet, or unchecked: what it is now is what was sent
            with self._lock:
                if fid in self._frames:
                    self._frames[fid] = (entry[0], now)
            return True
        if now == entry[1]:
            return True
        log.warning("frame %s changed after it was sent (the env reuses its array): sending it whole", fid)
        with self._lock:
            self._frames.pop(fid, None)
        return False

    def fork(self) -> FrameStore:
        """A store for a clone: the same arrays (shared, not copied), its own from now on."""
        other = FrameStore(self.keep)
        with self._lock:
            other._frames = OrderedDict(self._frames)
            other._drawn = self._drawn
        return other

    def clear(self) -> None:
        with self._lock:
            self._frames.clear()


class HeldFrames:
    """The client's side: the last large array received at each place of an env's answers,
    with its id. Not thread-safe (one env handle steps from one thread at a time)."""

    def __init__(self, held: dict[str, tuple[str, np.ndarray]] | None = None,
                 digests: dict[str, str] | None = None):
        self._held: dict[str, tuple[str, np.ndarray]] = dict(held or {})
        #: digests of held arrays computed here, by id (checked against the server's)
        self._digests: dict[str, str] = dict(digests or {})
        #: writable copies of held arrays, by place: (id, copy), for the next delta to patch
        self._spares: dict[str, tuple[str, np.ndarray]] = {}
        #: ids of held arrays whose digest the server will send (arrays to check)
        self._to_check: set[str] = set()

    def ids(self) -> dict[str, str]:
        """What a request names as its bases: {place: id}."""
        return {place: fid for place, (fid, _) in self._held.items()}

    def get(self, place: str) -> tuple[str, np.ndarray] | None:
        return self._held.get(place)

    def update(self, received: dict[str, tuple[str, np.ndarray]], to_check: set[str] = frozenset()) -> None:
        """The arrays of an answer, by place; ``to_check``: those whose digest will follow."""
        self._held.update(received)
        ids = {fid for fid, _ in self._held.values()}
        self._digests = {fid: d for fid, d in self._digests.items() if fid in ids}
        self._to_check = (self._to_check | set(to_check)) & ids

    def prepare(self) -> None:
        """Work done while an answer is awaited: a writable copy of each held array (what a
        delta is applied to; an unchanged answer leaves it for the next one) and the digest
        of each held array not yet checked."""
        for place, (fid, a) in self._held.items():
            spare = self._spares.get(place)
            if spare is None or spare[0] != fid:
                self._spares[place] = (fid, a.copy())
            if fid in self._to_check and fid not in self._digests:
                self._digests[fid] = digest(a)

    def take_spare(self, place: str, fid: str) -> np.ndarray | None:
        """The writable copy of the array held as ``fid`` at ``place``, if one was made."""
        spare = self._spares.get(place)
        if spare is None or spare[0] != fid:
            return None
        del self._spares[place]
        return spare[1]

    def check(self, place: str, fid: str, server_digest: str) -> bool:
        """Whether the held array ``fid`` has the server's digest (one not held passes). On a
        difference every held array is dropped: the next answer is whole."""
        held = self._held.get(place)
        if held is None or held[0] != fid:
            return True
        mine = self._digests.get(fid)
        if mine is None:
            mine = self._digests[fid] = digest(held[1])
        if mine == server_digest:
            return True
        self._held.clear()
        self._spares.clear()
        self._digests.clear()
        self._to_check.clear()
        return False

    def copy(self) -> HeldFrames:
        """For a clone: the same arrays (read-only, so shared safely)."""
        held = HeldFrames(self._held, self._digests)
        held._to_check = set(self._to_check)
        return held
