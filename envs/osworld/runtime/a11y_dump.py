"""Dump the desktop's accessibility tree (AT-SPI) as XML, in the shape of OSWorld's.

Run inside the workspace as a short-lived process (a live accessibility connection from
outside would block CRIU): ``python3 a11y_dump.py [--max-nodes N]``. Elements are named
after AT-SPI roles (``push-button``, ``frame``...), attributes ``name``, ``st:*`` states,
``cp:screencoord`` / ``cp:size`` and the text of text elements. Only showing elements are
kept; a table with thousands of children (a Calc sheet reports 2^31-1) is not iterated:
its visible cells are read through the table interface instead.

If AT-SPI is unavailable (no bus, no registry), it falls back to the X window tree
(``<desktop-frame source="x11">`` with each top-level window's name, class and geometry).
"""

from __future__ import annotations

import sys
import time
from xml.sax.saxutils import escape, quoteattr

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


def dump_atspi(max_nodes: int, seconds: float) -> str:
    import gi

    gi.require_version("Atspi", "2.0")
    from gi.repository import Atspi

    Atspi.set_timeout(1500, -1)
    desktop = Atspi.get_desktop(0)
    d = Dumper(Atspi, max_nodes, time.monotonic() + seconds)
    d.out.append(HEADER + ">")
    for i in range(desktop.get_child_count()):
        app = desktop.get_child_at_index(i)
        if app is not None:
            d.node(app, 1, app_level=True)
    d.out.append("</desktop-frame>")
    return "\n".join(d.out)


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


def main() -> None:
    max_nodes = int(sys.argv[sys.argv.index("--max-nodes") + 1]) if "--max-nodes" in sys.argv else 3000
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 8.0
    try:
        text = dump_atspi(max_nodes, seconds)
    except Exception as e:  # noqa: BLE001 - fall back to the window tree, and say so
        print(f"a11y: AT-SPI unavailable ({type(e).__name__}: {e}); window tree instead", file=sys.stderr)
        text = dump_x11()
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
