"""Spaces the env families share.

:class:`PrintableText` is gymnasium's ``Text`` over every printable character (what a
command, its output, a page's text or an accessibility tree may carry). gymnasium's ``Text``
builds its character tables (a set, a list and an index of ~48,000 characters) in each
instance, and ``batch_space`` deep-copies the space once per member: a desktop group of 4
spent ~2 s of CPU in ``make_vec`` copying the tables of its three text fields (bench epoch's
groups started that much late, all at once, on 2 cores). Here the tables are built once per
process and shared, read-only, by every instance and copy; each copy has its own random
generator, as a deep copy does.

Example:
    >>> import copy
    >>> space = PrintableText(4096, min_length=0)
    >>> space.contains("héllo\\n") and copy.deepcopy(space) == space
    True
"""

from __future__ import annotations

import copy
import threading
from typing import Any, ClassVar

from gymnasium import spaces

#: every printable character below the surrogates; the families add the controls they carry
PRINTABLE = "".join(chr(c) for c in range(32, 0xD800) if chr(c).isprintable())

_TABLES = ("_char_set", "_char_list", "_char_index", "_char_str")


class PrintableText(spaces.Text):
    """``Text(max_length, min_length=..., charset=PRINTABLE + controls)``, its character
    tables shared (built once per ``controls``)."""

    _shared: ClassVar[dict[str, dict[str, Any]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, max_length: int, *, min_length: int = 1, controls: str = "\n\t",
                 seed: int | Any | None = None):
        with PrintableText._lock:
            tables = PrintableText._shared.get(controls)
            if tables is None:
                proto = spaces.Text(1, min_length=0, charset=PRINTABLE + controls)
                tables = PrintableText._shared[controls] = {k: getattr(proto, k) for k in _TABLES}
        # gymnasium's checks of the lengths, on a one-character charset (cheap), then the tables
        super().__init__(max_length, min_length=min_length, charset=" ", seed=seed)
        self.__dict__.update(tables)
        self.controls = controls

    def __deepcopy__(self, memo: dict) -> PrintableText:
        new = memo[id(self)] = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)  # the tables are never changed: shared
        new._np_random = copy.deepcopy(self._np_random, memo)
        return new

    def __reduce__(self) -> tuple:
        # pickled by its arguments and generator (a process builds its own tables once), not its tables
        return _rebuild, (self.max_length, self.min_length, self.controls), {"_np_random": self._np_random}


def _rebuild(max_length: int, min_length: int, controls: str) -> PrintableText:
    return PrintableText(max_length, min_length=min_length, controls=controls)
