"""The observation: WebArena's accessibility-tree text, built from playwright's aria snapshot.

Playwright's ``page.aria_snapshot(mode="ai")`` gives a YAML tree whose element lines carry
``[ref=eN]`` handles (``locator("aria-ref=eN")`` acts on them). :func:`parse_aria` reads that
text into :class:`AriaNode` objects and :func:`render_tree` writes WebArena's format, one
line per node, indented by tabs::

    [1] RootWebArea 'One Stop Market' focused: True
    <TAB>[2] link 'My Account'
    <TAB>[3] searchbox 'Search'
    <TAB>[4] StaticText 'Items 1-12 of 2208'

(``<TAB>`` stands for a tab character.)

Ids number the lines 1, 2, ... in tree order: valid for the step they were observed in, and
the same for the same page however it was reached. :class:`Target` tells the driver what
an id acts on: an element's ref (a text line acts on its nearest element; an option of a
``<select>`` on the select).

As in WebArena, nameless structural nodes (generic, paragraph, list, ...) are left out with
their children moved up, and a text line repeating its parent's name is dropped.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

#: nameless nodes of these roles are left out (their children are kept), as in WebArena
SKIP_NAMELESS = {"generic", "paragraph", "list", "listitem", "group", "rowgroup", "strong", "emphasis", "banner",
                 "navigation", "contentinfo", "main", "region", "section", "LabelText", "Legend", "none",
                 "presentation", "img", "code", "time", "superscript", "subscript", "blockquote", "term",
                 "definition", "caption", "article", "complementary", "form", "search", "cell", "gridcell"}
ATTR_PROPS = {"checked": "checked", "disabled": "disabled", "expanded": "expanded", "selected": "selected",
              "pressed": "pressed", "active": "focused", "invalid": "invalid"}


@dataclass
class AriaNode:
    role: str
    name: str = ""
    attrs: dict[str, str] = field(default_factory=dict)
    props: dict[str, str] = field(default_factory=dict)
    children: list[AriaNode] = field(default_factory=list)
    text: str | None = None  # a text node's content (role "text")

    @property
    def ref(self) -> str | None:
        return self.attrs.get("ref")


@dataclass(frozen=True)
class Target:
    """What an id of the tree acts on: an element's ref, its role and name; for an option of a
    ``<select>``, the select's ref and the option's label."""

    ref: str | None
    role: str
    name: str
    option: str | None = None


# parsing -------------------------------------------------------------------------------
def _unquote_double(value: str) -> str:
    fixed = re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: "\\u00" + m.group(1), value)
    try:
        return json.loads(fixed)
    except json.JSONDecodeError:
        return value[1:-1]


def _value(raw: str) -> str:
    raw = raw.strip()
    if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
        return _unquote_double(raw)
    if raw.startswith("'") and raw.endswith("'") and len(raw) >= 2:
        return raw[1:-1].replace("''", "'")
    return raw


def _split_line(body: str) -> tuple[str, str | None, bool]:
    """``key[: value]`` -> (key, value or None, has_children)."""
    if body.startswith("'"):
        i = 1
        while i < len(body):
            if body[i] == "'":
                if i + 1 < len(body) and body[i + 1] == "'":
                    i += 2
                    continue
                break
            i += 1
        key, rest = body[1:i].replace("''", "'"), body[i + 1:]
    else:
        m = re.search(r":( |$)", body)
        key, rest = (body, "") if m is None else (body[:m.start()], body[m.start():])
    if rest.startswith(": "):
        return key, _value(rest[2:]), False
    return key, None, rest.startswith(":")


def _parse_key(key: str) -> AriaNode:
    role, _, rest = key.partition(" ")
    node = AriaNode(role=role)
    rest = rest.strip()
    if rest.startswith('"'):
        try:
            name, end = json.JSONDecoder().raw_decode(rest)
            node.name, rest = name, rest[end:].strip()
        except json.JSONDecodeError:
            pass
    for m in re.finditer(r"\[([^\]=]+)(?:=([^\]]*))?\]", rest):
        node.attrs[m.group(1)] = m.group(2) if m.group(2) is not None else ""
    return node


def parse_aria(text: str) -> list[AriaNode]:
    """Playwright's aria snapshot YAML -> the list of top-level nodes."""
    roots: list[AriaNode] = []
    stack: list[tuple[int, AriaNode]] = []
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if not stripped.startswith("- ") and stripped != "-":
            continue
        depth = (len(line) - len(stripped)) // 2
        body = stripped[2:]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1] if stack else None
        key, value, _ = _split_line(body)
        if key == "text" and value is not None:
            node = AriaNode(role="text", text=value)
        elif key.startswith("/") and parent is not None:
            parent.props[key[1:]] = value or ""
            continue
        else:
            node = _parse_key(key)
            if value is not None:
                node.children.append(AriaNode(role="text", text=value))
        (parent.children if parent is not None else roots).append(node)
        stack.append((depth, node))
    return roots


# rendering -----------------------------------------------------------------------------
#: roles whose name comes from their content: playwright omits such a name when the
#: children repeat it, WebArena shows it
NAME_FROM_CONTENT = {"link", "button", "heading", "tab", "menuitem", "option", "treeitem"}


def _props(node: AriaNode) -> str:
    out = []
    for attr, label in ATTR_PROPS.items():
        if attr in node.attrs:
            out.append(f"{label}: {node.attrs[attr] or 'True'}")
    return (" " + " ".join(out)) if out else ""


def _content_name(node: AriaNode) -> str:
    parts = []
    for child in node.children:
        if child.role == "text":
            parts.append((child.text or "").strip())
        else:
            parts.append(child.name.strip() or _content_name(child))
    return " ".join(p for p in parts if p)


def render_tree(nodes: list[AriaNode], title: str = "") -> tuple[str, dict[int, Target]]:
    """WebArena's tree text and the targets of its ids.

    Ids are numbered 1, 2, ... in tree order, so one page gives the same ids however it was
    reached; they are valid for the step they were observed in.
    """
    lines: list[str] = []
    targets: dict[int, Target] = {}

    def add(depth: int, target: Target, label: str) -> None:
        nid = len(lines) + 1
        targets[nid] = target
        lines.append("\t" * depth + f"[{nid}] {label}")

    top = nodes
    root = Target(None, "RootWebArea", title)
    root_attrs = ""
    if len(nodes) == 1 and nodes[0].role == "generic" and not nodes[0].name and nodes[0].ref:
        root = Target(nodes[0].ref, "RootWebArea", title)
        root_attrs = _props(nodes[0])
        top = nodes[0].children
    add(0, root, f"RootWebArea {title!r}{root_attrs}")

    def visit(node: AriaNode, depth: int, owner: Target | None, parent_name: str) -> None:
        if node.role == "text":
            text = (node.text or "").strip()
            if text and text != parent_name.strip():
                add(depth, Target(owner.ref if owner else None, "StaticText", text), f"StaticText {text!r}")
            return
        if node.role == "option" and owner is not None and owner.role in ("combobox", "listbox") and not node.ref:
            add(depth, Target(owner.ref, "option", node.name, option=node.name), f"option {node.name!r}{_props(node)}")
            return
        name = node.name or (_content_name(node) if node.role in NAME_FROM_CONTENT else "")
        here = Target(node.ref, node.role, name) if node.ref else owner
        if node.role in SKIP_NAMELESS and not name:
            for child in node.children:
                visit(child, depth, here, parent_name)
            return
        add(depth, Target(here.ref if here else None, node.role, name), f"{node.role} {name!r}{_props(node)}")
        for child in node.children:
            visit(child, depth + 1, here, name)

    for n in top:
        visit(n, 1, root, title)
    return "\n".join(lines), targets


def find_element(targets: dict[int, Target], tree: str, spec: str) -> int:
    """Resolve ``role 'name'`` (optionally ``#k``, 1-based) to the id of the k-th matching line.

    Raises:
        KeyError: no such line in the tree (the message lists near matches).
    """
    m = re.fullmatch(r"\s*(\S+)\s+(['\"])(.*)\2\s*(?:#(\d+))?\s*", spec, re.DOTALL)
    if not m:
        raise KeyError(f"{spec!r} is neither an id nor a reference like link 'My Account'")
    role, name, k = m.group(1), m.group(3), int(m.group(4) or 1)
    found = [i for i, t in _in_tree_order(targets, tree) if t.role == role and t.name == name]
    if len(found) < k:
        near = sorted({f"{t.role} {t.name!r}" for _, t in targets.items() if name.lower() in t.name.lower()})[:8]
        raise KeyError(f"no element {role} {name!r}" + (f" #{k}" if k > 1 else "") + " on the page"
                       + (f"; similar: {', '.join(near)}" if near else ""))
    return found[k - 1]


def _in_tree_order(targets: dict[int, Target], tree: str):
    for line in tree.splitlines():
        m = re.match(r"\t*\[(\d+)\]", line)
        if m and int(m.group(1)) in targets:
            yield int(m.group(1)), targets[int(m.group(1))]


def tabs_line(tabs: list[dict], active: int) -> str:
    """WebArena's tab header: ``Tab 0 (current): One Stop Market | Tab 1: ...``."""
    return " | ".join(f"Tab {i}{' (current)' if i == active else ''}: {t.get('title', '')}"
                      for i, t in enumerate(tabs))


_TREE_LINE = re.compile(r"(\t*)\[(\d+)\] (\S+) ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(.*)$")
_PROP = re.compile(r"(\w+): (\S+)")


def axtree_object(tree: str) -> dict:
    """The tree text as a Chrome DevTools accessibility tree (``{"nodes": [...]}``, each node with
    ``nodeId``, ``role``, ``name``, ``properties``, ``childIds``, ``parentId`` and
    ``browsergym_id`` = the line's id), the form of BrowserGym's ``axtree_object``: BrowserGym's
    ``flatten_axtree_to_str`` prints it back as ``[id] role 'name'`` lines."""
    nodes: list[dict] = []
    stack: list[tuple[int, dict]] = []  # (depth, node) of the open ancestors
    for line in tree.splitlines():
        m = _TREE_LINE.match(line)
        if m is None:
            continue  # not a node line (names are repr()-quoted, so a node is always one line)
        depth, nid, role = len(m.group(1)), m.group(2), m.group(3)
        name = ast.literal_eval(m.group(4))
        props = [{"name": k, "value": {"type": "booleanOrUndefined" if v == "True" else "token",
                                       "value": True if v == "True" else v}}
                 for k, v in _PROP.findall(m.group(5))]
        node = {"nodeId": nid, "ignored": False, "role": {"type": "role", "value": role},
                "name": {"type": "computedString", "value": name}, "properties": props, "childIds": [],
                "browsergym_id": nid}
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            node["parentId"] = stack[-1][1]["nodeId"]
            stack[-1][1]["childIds"].append(nid)
        stack.append((depth, node))
        nodes.append(node)
    return {"nodes": nodes}
