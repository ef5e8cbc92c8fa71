"""Dump the desktop's accessibility tree (AT-SPI) as XML, in the shape of OSWorld's.

Run inside the workspace as a short-lived process (a live accessibility connection from
outside would block CRIU): ``python3 a11y_dump.py [--walker fast|old] [--max-nodes N]
[--seconds S]``. Elements are named after AT-SPI roles (``push-button``, ``frame``...),
attributes ``name``, ``st:*`` states, ``cp:screencoord`` / ``cp:size`` and the text of text
elements. Only showing elements are kept; a table with thousands of children (a Calc sheet
reports 2^31-1) is not iterated: its visible cells are read through the table interface.

Two walkers give the same XML. ``old`` (:class:`Dumper`) asks libatspi one question at a
time. ``fast`` (the default, :class:`FastWalker`) speaks D-Bus itself, peer to peer to each
app, and asks each tree level's questions in one batch; it keeps two small files in
``$XDG_RUNTIME_DIR`` between dumps: libatspi's role names (so that no dump but the first
loads the Atspi typelib) and the Calc cell objects of the last dump (Calc never frees a cell
object an AT-SPI client asks for, so they are asked again instead of made anew). If the
fast walker fails it says so on stderr and the old one runs.

If AT-SPI is unavailable (no bus, no registry), it falls back to the X window tree
(``<desktop-frame source="x11">`` with each top-level window's name, class and geometry).
"""

from __future__ import annotations

import getopt
import itertools
import json
import os
import socket
import struct
import sys
import time


# A dump is a new process each step, so what it imports is paid each step: xml.sax.saxutils
# pulls in urllib.request and http.client (most of the interpreter's start-up here) for
# two one-line functions, and argparse costs more than getopt. escape and quoteattr below
# are saxutils' own (tests/test_osworld_a11y.py checks them against it).
def escape(data: str) -> str:
    """``xml.sax.saxutils.escape``: &, < and >."""
    return data.replace("&", "&amp;").replace(">", "&gt;").replace("<", "&lt;")


def quoteattr(data: str) -> str:
    """``xml.sax.saxutils.quoteattr``: escaped, newlines and tabs as references, quoted with
    the quote the value lacks (double quotes as &quot; if it has both)."""
    data = escape(data).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    if '"' in data:
        if "'" in data:
            return '"{}"'.format(data.replace('"', "&quot;"))
        return f"'{data}'"
    return f'"{data}"'


STATES = ("focused", "selected", "checked", "pressed", "expanded", "editable", "enabled", "visible", "showing",
          "focusable", "selectable", "sensitive", "active", "multi-line", "single-line", "modal")
MAX_TEXT = 400
HEADER = ('<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state" '
          'xmlns:attr="https://accessibility.ubuntu.example.org/ns/attributes" '
          'xmlns:cp="https://accessibility.ubuntu.example.org/ns/component" '
          'xmlns:txt="https://accessibility.ubuntu.example.org/ns/text" '
          'xmlns:val="https://accessibility.ubuntu.example.org/ns/value"')


def _tag(role: str) -> str:
    t = "".join(c if c.isalnum() else "-" for c in (role or "unknown").strip().lower())
    return t if t and t[0].isalpha() else "node-" + t


class Dumper:
    def __init__(self, atspi, max_nodes: int, deadline: float):
        self.A = atspi
        self.max_nodes = max_nodes
        self.deadline = deadline
        self.count = 0
        self.out: list[str] = []
        self.state_types = {}
        for s in STATES:
            st = getattr(atspi.StateType, s.upper().replace("-", "_"), None)
            if st is not None:
                self.state_types[s] = st

    def node(self, acc, depth: int, app_level: bool = False) -> None:
        if self.count >= self.max_nodes or time.monotonic() > self.deadline:
            return
        A = self.A
        try:
            role = acc.get_role_name()
            name = acc.get_name() or ""
            ss = acc.get_state_set()
        except Exception:  # noqa: BLE001 - a dead or busy element is skipped
            return
        if not app_level and not ss.contains(A.StateType.SHOWING):
            return
        self.count += 1
        attrs = [f"name={quoteattr(name[:200])}"]
        for s, st in self.state_types.items():
            if ss.contains(st):
                attrs.append(f'st:{s}="true"')
        comp = acc.get_component_iface() if not app_level else None
        if comp is not None:
            try:
                ext = comp.get_extents(A.CoordType.SCREEN)
                attrs.append(f'cp:screencoord="({ext.x}, {ext.y})" cp:size="({ext.width}, {ext.height})"')
            except Exception:  # noqa: BLE001
                pass
        text = ""
        ti = acc.get_text_iface()
        if ti is not None:
            try:
                n = ti.get_character_count()
                text = ti.get_text(0, min(n, MAX_TEXT)) or ""
            except Exception:  # noqa: BLE001
                text = ""
        vi = acc.get_value_iface()
        if vi is not None:
            try:
                attrs.append(f'val:value="{vi.get_current_value()}"')
            except Exception:  # noqa: BLE001
                pass
        tag = _tag(role)
        pad = "  " * depth
        try:
            n_children = acc.get_child_count()
        except Exception:  # noqa: BLE001
            n_children = 0
        body: list[str] = []
        if role in ("table", "tree table", "spreadsheet") and n_children > 2000:
            attrs.append(f'attr:children="{n_children}"')
            self._visible_cells(acc, depth + 1, body)
            n_children = 0
        head = f"{pad}<{tag} {' '.join(attrs)}"
        if not n_children and not body:
            self.out.append(f"{head}>{escape(text)}</{tag}>" if text else f"{head}/>")
            return
        self.out.append(f"{head}>{escape(text)}")
        self.out.extend(body)
        for i in range(min(n_children, 3000)):
            try:
                child = acc.get_child_at_index(i)
            except Exception:  # noqa: BLE001
                continue
            if child is not None:
                self.node(child, depth + 1)
        self.out.append(f"{pad}</{tag}>")

    def _visible_cells(self, table, depth: int, body: list[str]) -> None:
        """The cells of a huge table that lie inside its visible extents (Calc)."""
        A = self.A
        ti = table.get_table_iface() if hasattr(table, "get_table_iface") else None
        comp = table.get_component_iface()
        if ti is None or comp is None:
            return
        try:
            ext = comp.get_extents(A.CoordType.SCREEN)
            first = comp.get_accessible_at_point(ext.x + 2, ext.y + 2, A.CoordType.SCREEN)
            last = comp.get_accessible_at_point(ext.x + ext.width - 3, ext.y + ext.height - 3, A.CoordType.SCREEN)
            r0, c0 = _cell_pos(ti, first)
            r1, c1 = _cell_pos(ti, last)
        except Exception:  # noqa: BLE001
            return
        pad = "  " * depth
        for r in range(r0, min(r1, r0 + 60) + 1):
            for c in range(c0, min(c1, c0 + 26) + 1):
                try:
                    cell = ti.get_accessible_at(r, c)
                    name = cell.get_name() or ""
                    cti = cell.get_text_iface()
                    text = cti.get_text(0, min(cti.get_character_count(), MAX_TEXT)) if cti else ""
                except Exception:  # noqa: BLE001
                    continue
                if text or self.count < self.max_nodes // 2:
                    self.count += 1
                    body.append(f"{pad}<table-cell name={quoteattr(name)}>{escape(text)}</table-cell>")


def _cell_pos(ti, cell) -> tuple[int, int]:
    idx = cell.get_index_in_parent()
    return ti.get_row_at_index(idx), ti.get_column_at_index(idx)


def dump_atspi(max_nodes: int, seconds: float, call_timeout: float = 1.5) -> str:
    import gi

    gi.require_version("Atspi", "2.0")
    from gi.repository import Atspi

    # libatspi's per-call timeout: a fresh libatspi client asks Calc for its whole object
    # cache (Cache.GetItems, 2-5 s of Calc's time on a busy host), and calls made meanwhile
    # that wait longer than this fail, which leaves the app out of the tree
    Atspi.set_timeout(int(call_timeout * 1000), -1)
    desktop = Atspi.get_desktop(0)
    d = Dumper(Atspi, max_nodes, time.monotonic() + seconds)
    d.out.append(HEADER + ">")
    for i in range(desktop.get_child_count()):
        app = desktop.get_child_at_index(i)
        if app is not None:
            d.node(app, 1, app_level=True)
    d.out.append("</desktop-frame>")
    return "\n".join(d.out)


# The pipelined walker -------------------------------------------------------------------
# The same questions as Dumper's, asked of the apps with raw D-Bus calls (Gio), many in
# flight at a time and one tree level per round instead of one round trip per question:
# the old walker's cost is almost all waiting (walker -> bus -> app -> bus -> walker for
# each of ~8 questions per node, and for each of ~5 per visible Calc cell), which on a
# busy host is one scheduler wake-up of three processes per question. AT-SPI's cache
# interface (Cache.GetItems) was tried first and dropped: LibreOffice answers it for every
# object it ever created (1850 on the Calc task, menus included), which took it 1.9-5.7 s.

ACC = "org.a11y.atspi.Accessible"
IFACE_COMPONENT = "org.a11y.atspi.Component"
IFACE_TEXT = "org.a11y.atspi.Text"
IFACE_VALUE = "org.a11y.atspi.Value"
IFACE_TABLE = "org.a11y.atspi.Table"
PROPS = "org.freedesktop.DBus.Properties"
NULL_PATH = "/org/a11y/atspi/null"
ROOT_PATH = "/org/a11y/atspi/accessible/root"
#: calls in flight at once on one connection (the a11y bus's dbus-daemon refuses more than
#: its max_replies_per_connection, 128 by default, pending on one connection)
WINDOW = 96
#: longest wait for the next reply (the old walker waits 1.5 s per call; a batch is longer)
REPLY_TIMEOUT_S = 5.0
#: calls marshalled and written at a time within a window
SEND_CHUNK = 64
HUGE_TABLE_ROLES = ("table", "tree table", "spreadsheet")
#: cell objects kept between dumps (see FastWalker._cell_paths), the most recently seen: a
#: few views' worth (a Calc view shows ~1000 cells), so that scrolling back finds them
MAX_KEPT_CELLS = 6000


class CallFailed(Exception):
    """A D-Bus call that returned an error (the element is gone, busy, lacks the interface)."""

    def __init__(self, name: str, message: str = ""):
        super().__init__(f"{name}: {message}" if message else name)
        self.name = name


#: what an object answers for an interface it does not have
NO_INTERFACE_ERRORS = ("org.freedesktop.DBus.Error.UnknownMethod", "org.freedesktop.DBus.Error.UnknownInterface",
                       "org.freedesktop.DBus.Error.UnknownProperty")


#: a cell whose object did not answer (see FastWalker._read_cells)
_RETIRED = object()


class Node:
    """What the walker learned about one accessible (the input of :func:`build_xml`).

    ``role`` is the role name (``"push button"``), ``states`` the set of state names that
    are set, ``extents`` ``(x, y, w, h)`` or None, ``text`` the first MAX_TEXT characters
    of a text element ("" if none), ``value`` the current value of a value element or None,
    ``n_children`` the child count the element reports, ``children`` the first
    min(n_children, 3000) children (None for one that could not be read), ``cells`` the
    visible cells ``(name, text)`` of a huge table. ``ok`` is False when the role, name or
    state could not be read: the element is then left out, as the old walker does.
    """

    __slots__ = ("ref", "ok", "role", "name", "states", "n_children", "ifaces", "extents", "text", "value",
                 "children", "cells")

    def __init__(self, ref: tuple[str, str] | None = None, *, ok: bool = True, role: str = "unknown",
                 name: str = "", states: frozenset[str] = frozenset(), n_children: int = 0,
                 ifaces: frozenset[str] = frozenset(), extents: tuple[int, int, int, int] | None = None,
                 text: str = "", value: float | None = None, children: list | None = None,
                 cells: list[tuple[str, str]] | None = None):
        self.ref, self.ok, self.role, self.name, self.states = ref, ok, role, name, states
        self.n_children, self.ifaces, self.extents, self.text, self.value = n_children, ifaces, extents, text, value
        self.children = children if children is not None else []
        self.cells = cells


def build_xml(apps: list[Node], max_nodes: int = 3000) -> str:
    """The XML of the old walker (:class:`Dumper`) for an already fetched tree: same element
    order, attributes, limits (``max_nodes`` counted in document order, cells of huge tables
    counted and kept as ``Dumper._visible_cells`` does)."""
    out = [HEADER + ">"]
    count = 0

    def node(n: Node, depth: int, app_level: bool) -> None:
        nonlocal count
        if count >= max_nodes or not n.ok:  # (the time limit applies to the fetch: FastWalker.fetch)
            return
        if not app_level and "showing" not in n.states:
            return
        count += 1
        attrs = [f"name={quoteattr(n.name[:200])}"]
        attrs.extend(f'st:{s}="true"' for s in STATES if s in n.states)
        if n.extents is not None and not app_level:
            x, y, w, h = n.extents
            attrs.append(f'cp:screencoord="({x}, {y})" cp:size="({w}, {h})"')
        if n.value is not None:
            attrs.append(f'val:value="{n.value}"')
        tag = _tag(n.role)
        pad = "  " * depth
        n_children = n.n_children
        body: list[str] = []
        if n.role in HUGE_TABLE_ROLES and n_children > 2000:
            attrs.append(f'attr:children="{n_children}"')
            cpad = "  " * (depth + 1)
            for name, text in n.cells or ():
                if text or count < max_nodes // 2:
                    count += 1
                    body.append(f"{cpad}<table-cell name={quoteattr(name)}>{escape(text)}</table-cell>")
            n_children = 0
        head = f"{pad}<{tag} {' '.join(attrs)}"
        if not n_children and not body:
            out.append(f"{head}>{escape(n.text)}</{tag}>" if n.text else f"{head}/>")
            return
        out.append(f"{head}>{escape(n.text)}")
        out.extend(body)
        for child in n.children[:min(n_children, 3000)]:
            if child is not None:
                node(child, depth + 1, False)
        out.append(f"{pad}</{tag}>")

    for app in apps:
        node(app, 1, True)
    out.append("</desktop-frame>")
    return "\n".join(out)


# A minimal D-Bus client over a unix socket ----------------------------------------------
# PyGObject spends ~300 us of CPU per call building and unpacking GVariants; a walk asks
# thousands of questions, so the walker speaks the wire protocol itself (little-endian
# marshalling of the few signatures AT-SPI uses) and writes a whole round of calls before
# reading the replies.

_ALIGN = {"y": 1, "b": 4, "n": 2, "q": 2, "i": 4, "u": 4, "x": 8, "t": 8, "d": 8, "h": 4, "s": 4, "o": 4, "g": 1,
          "a": 4, "(": 8, "{": 8, "v": 1}
_FIXED = {"y": "B", "b": "I", "n": "h", "q": "H", "i": "i", "u": "I", "x": "q", "t": "Q", "d": "d", "h": "I"}


def _one_type(sig: str, i: int) -> int:
    """The index just past the single complete type starting at ``sig[i]``."""
    c = sig[i]
    if c == "a":
        return _one_type(sig, i + 1)
    if c in "({":
        close = ")" if c == "(" else "}"
        i += 1
        while sig[i] != close:
            i = _one_type(sig, i)
        return i + 1
    return i + 1


class _Reader:
    def __init__(self, buf: bytes, pos: int = 0):
        self.buf, self.pos = buf, pos

    def align(self, n: int) -> None:
        self.pos += -self.pos % n

    def read(self, sig: str) -> list:
        out, i = [], 0
        while i < len(sig):
            j = _one_type(sig, i)
            out.append(self.value(sig[i:j]))
            i = j
        return out

    def value(self, t: str):
        c = t[0]
        self.align(_ALIGN[c])
        buf = self.buf
        if c in _FIXED:
            fmt = _FIXED[c]
            v = struct.unpack_from("<" + fmt, buf, self.pos)[0]
            self.pos += struct.calcsize(fmt)
            return bool(v) if c == "b" else v
        if c in "so":
            n = struct.unpack_from("<I", buf, self.pos)[0]
            s = buf[self.pos + 4:self.pos + 4 + n].decode("utf-8", "replace")
            self.pos += 5 + n
            return s
        if c == "g":
            n = buf[self.pos]
            s = buf[self.pos + 1:self.pos + 1 + n].decode()
            self.pos += 2 + n
            return s
        if c == "v":
            return self.value(self.value("g"))
        if c == "a":
            n = struct.unpack_from("<I", buf, self.pos)[0]
            self.pos += 4
            self.align(_ALIGN[t[1]])
            end = self.pos + n
            items = []
            while self.pos < end:
                items.append(self.value(t[1:]))
            return items
        return tuple(self.read(t[1:-1]))  # struct or dict entry


class _Writer:
    def __init__(self):
        self.buf = bytearray()

    def align(self, n: int) -> None:
        self.buf += b"\0" * (-len(self.buf) % n)

    def write(self, sig: str, values) -> None:
        i = k = 0
        while i < len(sig):
            j = _one_type(sig, i)
            self.value(sig[i:j], values[k])
            i, k = j, k + 1

    def value(self, t: str, v) -> None:
        c = t[0]
        self.align(_ALIGN[c])
        if c in _FIXED:
            self.buf += struct.pack("<" + _FIXED[c], v)
        elif c in "so":
            b = v.encode()
            self.buf += struct.pack("<I", len(b)) + b + b"\0"
        elif c == "g":
            b = v.encode()
            self.buf += bytes([len(b)]) + b + b"\0"
        elif c == "v":
            sig, inner = v
            self.value("g", sig)
            self.value(sig, inner)
        elif c == "a":
            self.buf += b"\0\0\0\0"
            at = len(self.buf) - 4
            self.align(_ALIGN[t[1]])
            start = len(self.buf)
            for item in v:
                self.value(t[1:], item)
            struct.pack_into("<I", self.buf, at, len(self.buf) - start)
        else:
            self.write(t[1:-1], v)


def _pack_strings(*strings: str) -> bytes:
    out = b""
    for s in strings:
        b = s.encode()
        out += b"\x00" * (-len(out) % 4) + struct.pack("<I", len(b)) + b + b"\x00"
    return out


#: bodies of the signatures asked most, packed directly (the generic writer otherwise)
_BODY_PACKERS = {"": lambda: b"", "ss": _pack_strings, "u": struct.Struct("<I").pack, "i": struct.Struct("<i").pack,
                 "ii": struct.Struct("<ii").pack, "iiu": struct.Struct("<iiI").pack}


def _string_at(body: bytes, pos: int) -> tuple[str, int]:
    """The string starting at ``pos`` (aligned already) and the offset past it."""
    n = struct.unpack_from("<I", body, pos)[0]
    return body[pos + 4:pos + 4 + n].decode("utf-8", "replace"), pos + 5 + n


def _read_body(sig: str, body: bytes) -> list:
    """A reply's values: the replies AT-SPI gives most read directly, others generically."""
    if not sig:
        return []
    if sig == "v":
        n = body[0]
        inner = body[1:1 + n].decode()
        pos = 2 + n
        if inner == "s":
            pos += -pos % 4
            return [_string_at(body, pos)[0]]
        if inner in ("i", "u"):
            pos += -pos % 4
            return [struct.unpack_from("<i" if inner == "i" else "<I", body, pos)[0]]
    elif sig == "au":
        n = struct.unpack_from("<I", body, 0)[0]
        return [list(struct.unpack_from(f"<{n // 4}I", body, 4))]
    elif sig == "u":
        return [struct.unpack_from("<I", body, 0)[0]]
    elif sig == "i":
        return [struct.unpack_from("<i", body, 0)[0]]
    elif sig == "(iiii)":
        return [struct.unpack_from("<iiii", body, 0)]
    elif sig in ("s", "(so)", "a(so)", "as"):
        if sig == "s":
            return [_string_at(body, 0)[0]]
        if sig == "(so)":
            a, pos = _string_at(body, 0)
            return [(a, _string_at(body, pos + (-pos % 4))[0])]
        # an array's length counts bytes from its first element, which starts aligned
        pos = 4 if sig == "as" else 8
        end, items = pos + struct.unpack_from("<I", body, 0)[0], []
        if sig == "as":
            while pos < end:
                v, pos = _string_at(body, pos)
                items.append(v)
                pos += -pos % 4
            return [items]
        while pos < end:
            a, pos = _string_at(body, pos)
            b, pos = _string_at(body, pos + (-pos % 4))
            items.append((a, b))
            pos += -pos % 8
        return [items]
    return _Reader(body).read(sig)


class WireError(Exception):
    """The connection failed (not one call: that is a :class:`CallFailed` in its slot)."""


class Wire:
    """One D-Bus connection (to a bus, or peer to peer to an app) that pipelines calls."""

    def __init__(self, address: str, *, bus: bool, timeout: float = REPLY_TIMEOUT_S):
        path = None
        for part in address.split(";"):
            kind, _, rest = part.partition(":")
            if kind != "unix":
                continue
            kv = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
            path = kv.get("path") or ("\0" + kv["abstract"] if "abstract" in kv else None)
            if path:
                break
        if not path:
            raise WireError(f"no unix socket in D-Bus address {address!r}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.serial = 0
        self._fixed: dict[tuple, bytes] = {}
        self.rbuf, self.rpos = b"", 0
        # a bus refuses more than max_replies_per_connection (128 by default) pending calls
        self.window = WINDOW if bus else 4096
        try:
            self.sock.connect(path)
            self.sock.sendall(b"\0AUTH EXTERNAL " + str(os.getuid()).encode().hex().encode() + b"\r\n")
            line = self._line()
            if not line.startswith(b"OK"):
                raise WireError(f"D-Bus authentication refused at {address}: {line!r}")
            self.sock.sendall(b"BEGIN\r\n")
            if bus:
                self.call_many([("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello",
                                 "", ())])
        except WireError:
            self.sock.close()
            raise
        except OSError as e:
            self.sock.close()
            raise WireError(f"D-Bus connection to {address}: {e}") from e

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> bytes:
        buf = b""
        while not buf.endswith(b"\r\n"):  # byte by byte: nothing past the line may be eaten
            chunk = self.sock.recv(1)
            if not chunk:
                raise WireError("D-Bus peer closed the connection during authentication")
            buf += chunk
        return buf[:-2]

    def _message(self, dest: str | None, path: str, iface: str, member: str, sig: str, args) -> bytes:
        """A method call. The header fields but the path are the same for every call of a
        member: they are marshalled once, the path appended last (its entry starts 8-aligned
        as every header field does, the fields array starting at offset 16)."""
        self.serial += 1
        key = (dest, iface, member, sig)
        fixed = self._fixed.get(key)
        if fixed is None:
            w = _Writer()
            w.buf += bytes(16)  # the fixed header, so that alignment counts from the message start
            fields = [(2, ("s", iface)), (3, ("s", member))]
            if dest:
                fields.append((6, ("s", dest)))
            if sig:
                fields.append((8, ("g", sig)))
            for f in fields:
                w.value("(yv)", f)
            w.align(8)
            fixed = self._fixed[key] = bytes(w.buf[16:])
        p = path.encode()
        fields = fixed + b"\x01\x01o\x00" + struct.pack("<I", len(p)) + p + b"\x00"
        pack = _BODY_PACKERS.get(sig)
        if pack is not None:
            body = pack(*args)
        else:
            w = _Writer()
            w.write(sig, args)
            body = bytes(w.buf)
        return b"".join((struct.pack("<cBBBIII", b"l", 1, 0, 1, len(body), self.serial, len(fields)), fields,
                         b"\x00" * (-len(fields) % 8), body))

    def call_many(self, calls: list[tuple]) -> list:
        """``calls``: (destination or None, path, interface, member, signature, args); each
        reply's values as a list, or a :class:`CallFailed`. A window of calls is written
        before any reply is read."""
        out: list = []
        for at in range(0, len(calls), self.window):
            out += self._window(calls[at:at + self.window])
        return out

    def _window(self, calls: list[tuple]) -> list:
        first = self.serial + 1
        try:
            # written in chunks as they are marshalled: the app starts answering while the
            # rest is built (paired with whole-window writes on the Calc task: 280 vs 301 ms)
            for at in range(0, len(calls), SEND_CHUNK):
                self.sock.sendall(b"".join(self._message(*c) for c in calls[at:at + SEND_CHUNK]))
            results: list = [None] * len(calls)
            left = len(calls)
            while left:
                kind, reply_to, sig, error, body = self._read_message()
                i = reply_to - first
                if kind not in (2, 3) or not 0 <= i < len(calls):
                    continue  # a signal, or a reply to nothing of this batch
                if kind == 2:
                    results[i] = _read_body(sig, body)
                else:
                    results[i] = CallFailed(error, _Reader(body).read(sig)[0] if sig.startswith("s") else "")
                left -= 1
            return results
        except (OSError, struct.error, IndexError, ValueError) as e:
            raise WireError(f"D-Bus connection broke: {e}") from e

    def _read_message(self) -> tuple[int, int, str, str, bytes]:
        head = self._recv(16)
        if head[:1] != b"l":
            raise WireError("big-endian D-Bus messages are not read here")
        kind = head[1]
        body_len, fields_len = struct.unpack_from("<I", head, 4)[0], struct.unpack_from("<I", head, 12)[0]
        rest = self._recv(fields_len + (-(16 + fields_len) % 8) + body_len)
        reply_to, sig, error = 0, "", ""
        # the header fields a reply carries: (code, variant) structs, each 8-aligned from the
        # message start (offset 16 here is offset 0 of ``rest``); read without the generic
        # reader, which cost more than the rest of the walk
        pos = 0
        while pos < fields_len:
            pos += -pos % 8
            code, n = rest[pos], rest[pos + 1]
            t = rest[pos + 2:pos + 2 + n]
            pos += 3 + n
            if t in (b"s", b"o"):
                pos += -(pos + 16) % 4
                ln = struct.unpack_from("<I", rest, pos)[0]
                value = rest[pos + 4:pos + 4 + ln].decode()
                pos += 5 + ln
                if code == 4:
                    error = value
            elif t == b"g":
                ln = rest[pos]
                value = rest[pos + 1:pos + 1 + ln].decode()
                pos += 2 + ln
                if code == 8:
                    sig = value
            elif t == b"u":
                pos += -(pos + 16) % 4
                if code == 5:
                    reply_to = struct.unpack_from("<I", rest, pos)[0]
                pos += 4
            else:  # a field of another type: the generic reader for them all
                for c, v in _Reader(head + rest[:fields_len], 12).value("a(yv)"):
                    reply_to, sig, error = (v if c == 5 else reply_to), (v if c == 8 else sig), (v if c == 4 else error)
                break
        return kind, reply_to, sig, error, rest[len(rest) - body_len:]

    def _recv(self, n: int) -> bytes:
        while len(self.rbuf) - self.rpos < n:
            chunk = self.sock.recv(max(65536, n))
            if not chunk:
                raise WireError("D-Bus peer closed the connection")
            self.rbuf, self.rpos = self.rbuf[self.rpos:] + chunk, 0
        out = self.rbuf[self.rpos:self.rpos + n]
        self.rpos += n
        return out


class Pipeline:
    """Calls to one application: (object path, interface, member, signature, args) each."""

    def __init__(self, wire: Wire, dest: str | None):
        self.wire = wire
        self.dest = dest  # None on a peer-to-peer connection to the app
        self.calls = 0

    def run(self, calls: list[tuple[str, str, str, str, tuple]]) -> list:
        self.calls += len(calls)
        return self.wire.call_many([(self.dest, *c) for c in calls]) if calls else []


def _ok(r) -> bool:
    return not isinstance(r, CallFailed)


class AppMemo:
    """What one dump learned about an app that the next dump need not ask again, because an
    object never changes it: its interfaces (by object path: a path names one object for
    the app's life, atk-bridge numbers them from a counter, and an object's interfaces are
    those of its type) and the names of Calc's cell objects (see FastWalker._read_cells).
    Only what the last dump saw is kept, so it stays the size of one tree. A dump run in
    the desktop server keeps it in memory; the server is forked with the workspace, so a
    clone starts with its source's memo, which is as exact for the clone's app."""

    __slots__ = ("ifaces", "names", "listed")

    def __init__(self):
        self.ifaces: dict[str, frozenset[str]] = {}
        self.names: dict[str, str] = {}
        #: paths of the objects whose children were listed (a hint, see FastWalker._basics)
        self.listed: set[str] = set()


class FastWalker:
    """Fetch one application's tree level by level, each level's questions in one batch.

    Per level: the states of every node (a node that is not showing is left out with its
    subtree, as the old walker does, so nothing else is asked of it); then role, name, child
    count and interfaces of the showing ones; then their extents, text, value and children.
    """

    def __init__(self, tables: dict, pipe: Pipeline, cells: dict[str, str] | None = None,
                 known: AppMemo | None = None):
        self.roles: list[str] = tables["roles"]
        self.extended_role: int = tables["extended"]
        self.state_bits: dict[str, int] = tables["states"]
        self.pipe = pipe
        #: "table path row,column" -> cell path, from the last dump (see _cell_paths)
        self.cells: dict[str, str] = cells if cells is not None else {}
        #: what the last dump learned that an object never changes (see AppMemo); ``memo``
        #: is what this dump learned, for the next one
        self.known = known or AppMemo()
        self.memo = AppMemo()

    def fetch(self, root_path: str, deadline: float) -> Node:
        """The app's tree under ``root_path``; levels not started by ``deadline`` are left out.

        Two rounds a level where the memo knows the nodes: their basics (with the children
        of the nodes whose children were listed last time), then their details together with
        the states of those children; a third, the states, only for children not known then."""
        root = Node((self.pipe.dest or "", root_path))
        level: list[tuple[Node, bool, object]] = [(root, True, None)]
        while level and time.monotonic() < deadline:
            wanted = self._states(level)
            listed = self._basics(wanted)
            level = self._details(wanted, listed)
        return root

    def _states(self, level: list[tuple[Node, bool, object]]) -> list[tuple[Node, bool]]:
        """Each node's states (asked now unless the last round asked them already); the shown
        ones (every app), to be asked more of."""
        ask = [n for n, _, st in level if st is None]
        got = iter(self.pipe.run([(n.ref[1], ACC, "GetState", "", ()) for n in ask]))
        showing_bit = self.state_bits["showing"]
        wanted = []
        for n, app, st in level:
            if st is None:
                st = next(got)
            if not _ok(st):
                n.ok = False
                continue
            words = st[0]
            bits = sum(w << (32 * k) for k, w in enumerate(words))
            n.states = frozenset(s for s, b in self.state_bits.items() if bits >> b & 1)
            if app or bits >> showing_bit & 1:
                wanted.append((n, app))
            else:
                n.ok = False  # not shown: left out, as the old walker does, whatever its role
        return wanted

    def _basics(self, wanted: list[tuple[Node, bool]]) -> dict:
        """Role, name, child count and interfaces of each node; the children of a node whose
        children were listed in the last dump (``AppMemo.listed``: a hint, used only if its
        child count now says they are listed, as _details would) and that is no table (the
        only kind with 2^31 children): node -> GetChildren's answer."""
        calls = []
        known_ifaces, seen_ifaces, listed_before = self.known.ifaces, self.memo.ifaces, self.known.listed
        for n, _ in wanted:
            p = n.ref[1]
            calls += [(p, ACC, "GetRole", "", ()), (p, PROPS, "Get", "ss", (ACC, "Name")),
                      (p, PROPS, "Get", "ss", (ACC, "ChildCount"))]
            ifaces = known_ifaces.get(p)
            if ifaces is None:
                calls.append((p, ACC, "GetInterfaces", "", ()))
            elif p in listed_before and IFACE_TABLE not in ifaces:
                calls.append((p, ACC, "GetChildren", "", ()))
        res = iter(self.pipe.run(calls))
        extended, listed = [], {}
        for n, _ in wanted:
            p = n.ref[1]
            role, name, count = next(res), next(res), next(res)
            ifaces = known_ifaces.get(p)
            if ifaces is None:
                got = next(res)
                ifaces = frozenset(got[0]) if _ok(got) else None
            elif p in listed_before and IFACE_TABLE not in ifaces:
                listed[n] = next(res)
            if not (_ok(role) and _ok(name)):
                n.ok = False
                continue
            r = role[0]
            if 0 <= r < len(self.roles) and r != self.extended_role:
                n.role = self.roles[r]
            else:  # libatspi asks the app for such a role's name, as here
                extended.append(n)
            n.name = name[0] or ""
            n.n_children = count[0] if _ok(count) else 0
            n.ifaces = ifaces if ifaces is not None else frozenset()
            if ifaces is not None:
                seen_ifaces[p] = ifaces
        names = self.pipe.run([(n.ref[1], ACC, "GetRoleName", "", ()) for n in extended])
        for n, r in zip(extended, names, strict=True):
            if _ok(r):
                n.role = r[0]
            else:
                n.ok = False
        return listed

    def _details(self, wanted: list[tuple[Node, bool]], listed: dict) -> list[tuple[Node, bool, object]]:
        """Extents, text, value and children of the shown nodes of a level, and the states
        of the children already listed; the next level: (node, False, its state or None)."""
        calls, slots, tables = [], [], []
        shown = [(n, app) for n, app in wanted if n.ok]
        for n, app in shown:
            p = n.ref[1]
            if IFACE_COMPONENT in n.ifaces and not app:
                calls.append((p, IFACE_COMPONENT, "GetExtents", "u", (0,)))
                slots.append((n, "extents"))
            if IFACE_TEXT in n.ifaces:
                calls.append((p, IFACE_TEXT, "GetText", "ii", (0, -1)))
                slots.append((n, "text"))
            if IFACE_VALUE in n.ifaces:
                calls.append((p, PROPS, "Get", "ss", (IFACE_VALUE, "CurrentValue")))
                slots.append((n, "value"))
            if n.role in HUGE_TABLE_ROLES and n.n_children > 2000:
                tables.append(n)
            elif 0 < n.n_children <= 3000:
                self.memo.listed.add(p)
                got = listed.get(n)
                if got is not None and _ok(got):
                    n.children = [self._child(c) for c in got[0][:n.n_children]]
                    for c in n.children:
                        if c is not None:
                            calls.append((c.ref[1], ACC, "GetState", "", ()))
                            slots.append((c, "state"))
                else:
                    calls.append((p, ACC, "GetChildren", "", ()))
                    slots.append((n, "children"))
            elif n.n_children > 3000:
                calls += [(p, ACC, "GetChildAtIndex", "i", (i,)) for i in range(3000)]
                slots += [(n, "child")] * 3000
        res = self.pipe.run(calls)
        long_texts, state_of = [], {}
        for (n, what), r in zip(slots, res, strict=True):
            if what == "state":
                state_of[n] = r
            elif what == "extents":
                n.extents = tuple(r[0]) if _ok(r) else None
            elif what == "text":
                # the whole text in one question, not the old walker's two (character
                # count, then the text up to MAX_TEXT); one longer than MAX_TEXT
                # characters is cut where the app counts characters, as the old walker asks
                if not _ok(r):
                    n.text = ""
                elif len(r[0]) < MAX_TEXT:
                    n.text = r[0] or ""
                else:
                    long_texts.append(n)
            elif what == "value":
                n.value = float(r[0]) if _ok(r) else None
            elif what == "children":
                n.children = [self._child(c) for c in r[0][:min(n.n_children, 3000)]] if _ok(r) else []
            else:  # one child of a long list, in index order
                n.children.append(self._child(r[0]) if _ok(r) else None)
        counts = self.pipe.run([(n.ref[1], PROPS, "Get", "ss", (IFACE_TEXT, "CharacterCount")) for n in long_texts])
        cut = self.pipe.run([(n.ref[1], IFACE_TEXT, "GetText", "ii", (0, min(c[0] if _ok(c) else 0, MAX_TEXT)))
                             for n, c in zip(long_texts, counts, strict=True)])
        for n, c, t in zip(long_texts, counts, cut, strict=True):
            n.text = (t[0] or "") if _ok(c) and _ok(t) else ""
        for n in tables:
            n.cells = self._visible_cells(n)
        return [(c, False, state_of.get(c)) for n, _ in shown for c in n.children if c is not None]

    def _child(self, ref) -> Node | None:
        return None if not ref or ref[1] == NULL_PATH else Node((ref[0], ref[1]))

    def _visible_cells(self, table: Node) -> list[tuple[str, str]]:
        """As :meth:`Dumper._visible_cells`: the cells inside the table's visible extents."""
        run, p = self.pipe.run, table.ref[1]
        if IFACE_TABLE not in table.ifaces or IFACE_COMPONENT not in table.ifaces or table.extents is None:
            return []
        x, y, w, h = table.extents
        corners = run([(p, IFACE_COMPONENT, "GetAccessibleAtPoint", "iiu", (x + 2, y + 2, 0)),
                       (p, IFACE_COMPONENT, "GetAccessibleAtPoint", "iiu", (x + w - 3, y + h - 3, 0))])
        if not all(map(_ok, corners)) or any(c[0][1] == NULL_PATH for c in corners):
            return []
        idx = run([(c[0][1], ACC, "GetIndexInParent", "", ()) for c in corners])
        if not all(map(_ok, idx)):
            return []
        rc = run([(p, IFACE_TABLE, m, "i", (i[0],)) for i in idx for m in ("GetRowAtIndex", "GetColumnAtIndex")])
        if not all(map(_ok, rc)):
            return []
        (r0,), (c0,), (r1,), (c1,) = rc
        grid = [(r, c) for r in range(r0, min(r1, r0 + 60) + 1) for c in range(c0, min(c1, c0 + 26) + 1)]
        cells = self._cell_paths(p, grid)
        read = self._read_cells([path for _, _, path, _ in cells])
        # a kept object that does not answer was retired between its liveness check (its index) and now:
        # that cell is asked for anew, as the old walker would have
        again = [i for i, (_, _, _, kept) in enumerate(cells) if kept and read[i] is _RETIRED]
        fresh = run([(p, IFACE_TABLE, "GetAccessibleAt", "ii", cells[i][1]) for i in again])
        redo = [(i, r[0][1]) for i, r in zip(again, fresh, strict=True) if _ok(r) and r[0][1] != NULL_PATH]
        for (i, path), got in zip(redo, self._read_cells([path for _, path in redo]), strict=True):
            read[i] = got
            self.cells[cells[i][0]] = path
        return [c for c in read if c is not None and c is not _RETIRED]

    def _read_cells(self, paths: list[str]) -> list:
        """(name, text) of each cell; None for one the old walker would leave out, _RETIRED
        for one whose object does not answer."""
        run = self.pipe.run
        # name and whole text of each cell: two questions, not the old four (interfaces,
        # character count, then the text): a cell without the text interface answers
        # UnknownMethod, which the old walker's get_text_iface() == None amounts to. The
        # name of a cell object asked in the last dump is not asked again: Calc names a
        # cell object after its address, which is fixed for the object's life (a cell that
        # moves gets a new object), and keeps the name it made (ScAccessibleContextBase)
        known_names, seen_names = self.known.names, self.memo.names
        calls = []
        for cp in paths:
            if cp not in known_names:
                calls.append((cp, PROPS, "Get", "ss", (ACC, "Name")))
            calls.append((cp, IFACE_TEXT, "GetText", "ii", (0, -1)))
        info = iter(run(calls))
        out: list = []
        long_texts = []
        for cp in paths:
            name = [known_names[cp]] if cp in known_names else next(info)
            text = next(info)
            if _ok(name) and not (isinstance(text, CallFailed) and text.name not in NO_INTERFACE_ERRORS):
                seen_names[cp] = name[0]  # a retired object's name is not kept
            if not _ok(name):
                out.append(_RETIRED)
            elif _ok(text) and len(text[0]) < MAX_TEXT:
                out.append((name[0] or "", text[0]))
            elif _ok(text):  # long: cut where the app counts characters, as the old walker asks
                long_texts.append((len(out), cp))
                out.append((name[0] or "", None))
            elif text.name in NO_INTERFACE_ERRORS:
                out.append((name[0] or "", ""))
            else:
                out.append(_RETIRED)
        counts = run([(cp, PROPS, "Get", "ss", (IFACE_TEXT, "CharacterCount")) for _, cp in long_texts])
        cut = run([(cp, IFACE_TEXT, "GetText", "ii", (0, min(c[0] if _ok(c) else 0, MAX_TEXT)))
                   for (_, cp), c in zip(long_texts, counts, strict=True)])
        for (i, _), c, t in zip(long_texts, counts, cut, strict=True):
            out[i] = (out[i][0], t[0]) if _ok(c) and _ok(t) else _RETIRED
        return out

    def _cell_paths(self, table: str, grid: list[tuple[int, int]]) -> list[tuple[str, tuple[int, int], str, bool]]:
        """(key, (row, column), object path, kept from the last dump) of the cells at
        ``grid``, in order. Calc makes a new accessible object for each GetAccessibleAt and
        never frees it (6.6-7.1 MB more private memory in soffice per Calc dump, the old
        walker's too), so the objects of the last dump are asked again where they are still
        alive (not defunct: a path names one object, and a Calc cell object one cell, for
        the app's lifetime); only the others are made anew.

        Alive is asked as the index in the parent, not the state set: a disposed Calc cell
        answers -1 (ScAccessibleCellBase checks IsObjectValid first, and the ATK wrapper
        answers -1 for the exception), and a cell of a table that is showing (as this one
        is: it was walked) is defunct only when disposed (ScAccessibleCell::IsDefunc: its
        view shell and parent are dropped only by dispose, and a parent's dispose disposes
        its cells). Its state set costs Calc the table's state set and the cell's own
        (protection, background, selection, bounds): 56-70 ms of Calc's CPU for the ~1000
        kept cells of the Calc task's view, against 22-24 ms for the index (measured)."""
        run = self.pipe.run
        keys = [f"{table} {r},{c}" for r, c in grid]
        known = [(k, self.cells[k]) for k in keys if k in self.cells]
        indices = run([(path, ACC, "GetIndexInParent", "", ()) for _, path in known])
        alive = {k: path for (k, path), i in zip(known, indices, strict=True) if _ok(i) and i[0] >= 0}
        kept = set(alive)
        fresh = [(k, rc) for k, rc in zip(keys, grid, strict=True) if k not in alive]
        at = run([(table, IFACE_TABLE, "GetAccessibleAt", "ii", rc) for _, rc in fresh])
        for (k, _), r in zip(fresh, at, strict=True):
            if _ok(r) and r[0][1] != NULL_PATH:
                alive[k] = r[0][1]
        # the cells of earlier views are kept too (up to MAX_KEPT_CELLS, the least recently
        # seen dropped first): a view scrolled away and back would otherwise make every cell
        # that comes back anew, and Calc, which keeps them all, answered each call more
        # slowly the more it held (its tree took 150 ms at the first step of the Calc task,
        # 300-400 ms after 60 steps that scrolled 3 rows down and up)
        for k in keys:
            self.cells.pop(k, None)  # put back below as the most recently seen, if alive
        self.cells.update(alive)
        for k in list(itertools.islice(self.cells, max(0, len(self.cells) - MAX_KEPT_CELLS))):
            del self.cells[k]
        return [(k, rc, alive[k], k in kept) for k, rc in zip(keys, grid, strict=True) if k in alive]


def role_tables(cache: str | None) -> dict:
    """libatspi's role names (by role number) and state bit numbers. Loading the Atspi
    typelib costs a Python process 0.1-0.3 s, more than the rest of a fast dump, so the
    tables are read from libatspi once and kept in ``cache`` (a JSON file) for later dumps."""
    if cache:
        try:
            with open(cache) as f:
                tables = json.load(f)
            if isinstance(tables, dict) and {"roles", "extended", "states"} <= tables.keys():
                return tables
        except (OSError, ValueError):
            pass
    import gi

    gi.require_version("Atspi", "2.0")
    from gi.repository import Atspi

    roles = [Atspi.role_get_name(Atspi.Role(r)) or "" for r in range(int(Atspi.Role.LAST_DEFINED))]
    tables = {"roles": roles, "extended": int(Atspi.Role.EXTENDED),
              "states": {s: int(st) for s, st in _state_types(Atspi).items()}}
    _save_json(cache, tables)
    return tables


def _state_types(atspi) -> dict:
    return {s: st for s in STATES if (st := getattr(atspi.StateType, s.upper().replace("-", "_"), None)) is not None}


def _app_wire(bus: Wire, name: str, path: str, timeout: float = REPLY_TIMEOUT_S) -> tuple[Pipeline, str]:
    """A peer-to-peer connection to the app where it offers one (as libatspi uses: no bus
    daemon in between), else the app through the accessibility bus; and a key naming this
    app process (its direct address or its bus name: neither is reused by another)."""
    addr = bus.call_many([(name, path, "org.a11y.atspi.Application", "GetApplicationBusAddress", "", ())])[0]
    if _ok(addr) and addr[0]:
        try:
            return Pipeline(Wire(addr[0], bus=False, timeout=timeout), None), addr[0]
        except WireError as e:
            print(f"a11y: {name}: no direct connection ({e}); through the bus", file=sys.stderr)
    return Pipeline(bus, name), name


def _load_json(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_json(path: str | None, data: dict) -> None:
    if not path:
        return
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"a11y: could not write {path}: {e}", file=sys.stderr)


def dump_fast(max_nodes: int, seconds: float, state_dir: str | None = None,
              memo: dict[str, AppMemo] | None = None, reply_timeout: float = REPLY_TIMEOUT_S) -> str:
    """The old walker's XML, fetched with batched D-Bus calls (see :class:`FastWalker`).
    ``state_dir``: where libatspi's role table and the cell objects of the last dump are
    kept between dumps (None: nothing kept). ``memo``: app key -> :class:`AppMemo`, read
    and replaced by this dump (a long-lived caller's: the desktop server's); None: every
    question is asked. ``reply_timeout``: the longest wait for an app's next reply (an app
    asked for the first time makes its objects then: Calc takes seconds)."""
    deadline = time.monotonic() + seconds
    tables = role_tables(os.path.join(state_dir, "bunshin-a11y-tables.json") if state_dir else None)
    cells_file = os.path.join(state_dir, "bunshin-a11y-cells.json") if state_dir else None
    known_cells = _load_json(cells_file)
    kept_cells: dict[str, dict] = {}
    memos: dict[str, AppMemo] = {}
    session = Wire(os.environ["DBUS_SESSION_BUS_ADDRESS"], bus=True)
    try:
        addr = session.call_many([("org.a11y.Bus", "/org/a11y/bus", "org.a11y.Bus", "GetAddress", "", ())])[0]
    finally:
        session.close()
    if not _ok(addr):
        raise WireError(f"no accessibility bus: {addr}")
    bus = Wire(addr[0], bus=True, timeout=reply_timeout)
    try:
        apps = bus.call_many([("org.a11y.atspi.Registry", ROOT_PATH, ACC, "GetChildren", "", ())])[0]
        if not _ok(apps):
            raise WireError(f"the registry does not list applications: {apps}")
        roots = []
        for name, path in apps[0]:
            if path == NULL_PATH:
                continue
            pipe, app_key = _app_wire(bus, name, path, reply_timeout)
            walker = FastWalker(tables, pipe, dict(known_cells.get(app_key, {})),
                                memo.get(app_key) if memo is not None else None)
            try:
                roots.append(walker.fetch(path, deadline))
            finally:
                if pipe.wire is not bus:
                    pipe.wire.close()
            if walker.cells:
                kept_cells[app_key] = walker.cells
            memos[app_key] = walker.memo
        if kept_cells != known_cells:
            _save_json(cells_file, kept_cells)  # apps gone since are dropped
        if memo is not None:
            memo.clear()  # apps gone since are dropped
            memo.update(memos)
        return build_xml(roots, max_nodes)
    finally:
        bus.close()


def dump_x11() -> str:
    from Xlib import X, display

    dpy = display.Display()
    root = dpy.screen().root
    net_list = dpy.intern_atom("_NET_CLIENT_LIST")
    net_name = dpy.intern_atom("_NET_WM_NAME")
    utf8 = dpy.intern_atom("UTF8_STRING")
    prop = root.get_full_property(net_list, X.AnyPropertyType)
    out = [HEADER + ' source="x11">']
    for wid in (prop.value if prop else []):
        w = dpy.create_resource_object("window", wid)
        try:
            n = w.get_full_property(net_name, utf8)
            name = n.value.decode(errors="replace") if n else (w.get_wm_name() or "")
            cls = w.get_wm_class() or ("", "")
            g = w.get_geometry()
            pos = w.translate_coords(root, 0, 0)
        except Exception:  # noqa: BLE001
            continue
        out.append(f'  <frame name={quoteattr(str(name))} attr:class={quoteattr(cls[1])} '
                   f'cp:screencoord="({-pos.x}, {-pos.y})" cp:size="({g.width}, {g.height})"/>')
    out.append("</desktop-frame>")
    return "\n".join(out)


USAGE = ("usage: a11y_dump.py [--walker fast|old] [--max-nodes N] [--seconds S] [--call-timeout T]\n"
         "  fast (default): batched D-Bus calls; old: one libatspi call at a time; the walk stops after S s;\n"
         "  T: the old walker's per-call timeout in seconds (1.5)")


def parse_args(argv: list[str]) -> tuple[str, int, float, float]:
    """(walker, max nodes, seconds, old walker's call timeout) from the command line;
    SystemExit(2) with the usage if bad."""
    walker, max_nodes, seconds, call_timeout = "fast", 3000, 8.0, 1.5
    try:
        opts, rest = getopt.getopt(argv, "", ["walker=", "max-nodes=", "seconds=", "call-timeout="])
        for opt, value in opts:
            if opt == "--walker":
                if value not in ("fast", "old"):
                    raise ValueError(f"--walker must be fast or old, not {value!r}")
                walker = value
            elif opt == "--max-nodes":
                max_nodes = int(value)
            elif opt == "--call-timeout":
                call_timeout = float(value)
            else:
                seconds = float(value)
        if rest:
            raise ValueError(f"unexpected arguments {rest}")
    except (getopt.GetoptError, ValueError) as e:
        print(f"a11y_dump.py: {e}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from e
    return walker, max_nodes, seconds, call_timeout


def main() -> None:
    walker, max_nodes, seconds, call_timeout = parse_args(sys.argv[1:])
    text = None
    if walker == "fast":
        try:
            text = dump_fast(max_nodes, seconds, os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
        except Exception as e:  # noqa: BLE001 - any failure of the fast walker: say so, and walk the old way
            print(f"a11y: fast walker failed ({type(e).__name__}: {e}); old walker instead", file=sys.stderr)
    if text is None:
        try:
            text = dump_atspi(max_nodes, seconds, call_timeout)
        except Exception as e:  # noqa: BLE001 - fall back to the window tree, and say so
            print(f"a11y: AT-SPI unavailable ({type(e).__name__}: {e}); window tree instead", file=sys.stderr)
            text = dump_x11()
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
