"""What an action does on the screen, to draw on its screenshot: click points, drags, scrolls,
typed text and keys, read from the action's text without running it.

Desktop actions come as pyautogui code (read with :mod:`ast`: only calls on ``pyautogui``
with literal arguments count) or as computer_13 dicts (JSON); anything else (a shell command)
has no marks. A WebArena (or BrowserGym) action names an element, not a point:
:func:`web_marks` reads it with the web env's own parser, names the element by its line in
the accessibility tree the action was chosen from and, when the step recorded where that
element was (the web env's ``info["element_box"]``, taken before the action ran), puts the
mark at the box's centre (where a click lands) on the screenshot the action was chosen on.

Example:
    >>> marks("pyautogui.click(120, 40); pyautogui.write('hi')")
    [{'kind': 'click', 'x': 120, 'y': 40, 'label': 'click'}, {'kind': 'type', 'text': 'hi', 'label': 'type'}]
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from bunshin_gym.envs.webarena.actions import parse_action
from bunshin_gym.envs.webarena.observation import axtree_object
from bunshin_gym.errors import ActionSyntaxError

_POINT_CALLS = {"click": "click", "doubleClick": "double click", "tripleClick": "triple click",
                "rightClick": "right click", "middleClick": "middle click", "moveTo": "move",
                "mouseDown": "mouse down", "mouseUp": "mouse up"}
_C13_POINTS = {"CLICK": "click", "DOUBLE_CLICK": "double click", "RIGHT_CLICK": "right click",
               "MOVE_TO": "move", "MOUSE_DOWN": "mouse down", "MOUSE_UP": "mouse up"}


def marks(action: Any) -> list[dict]:
    """The marks of one action (see the module docs); [] when it has none."""
    if isinstance(action, dict):
        return _computer13(action)
    if not isinstance(action, str) or not action.strip():
        return []
    text = action.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return []
        return _computer13(parsed) if isinstance(parsed, dict) else []
    if "pyautogui" not in text:
        return []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out: list[dict] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            mark = _pyautogui_call(node)
            if mark is not None:
                out.append(mark)
    # ast.walk is breadth-first: put the marks back in source order
    return [m for _, m in sorted(((m.pop("_pos"), m) for m in out), key=lambda p: p[0])]


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _args(call: ast.Call, names: list[str]) -> dict[str, Any]:
    vals = {name: _literal(a) for name, a in zip(names, call.args, strict=False)}
    for kw in call.keywords:
        if kw.arg:
            vals[kw.arg] = _literal(kw.value)
    return vals


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _pyautogui_call(call: ast.Call) -> dict | None:
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "pyautogui"):
        return None
    pos = (call.lineno, call.col_offset)
    name = f.attr
    if name in _POINT_CALLS or name in ("dragTo", "scroll", "hscroll", "vscroll"):
        a = _args(call, ["clicks", "x", "y"] if "scroll" in name else ["x", "y"])
        x, y = a.get("x"), a.get("y")
        if isinstance(x, tuple | list) and len(x) == 2:  # click((x, y))
            x, y = x
        if name.endswith("scroll"):
            m = {"kind": "scroll", "amount": a.get("clicks"), "label": f"scroll {a.get('clicks')}"}
            if _number(x) and _number(y):
                m.update(x=x, y=y)
            return dict(m, _pos=pos)
        if not (_number(x) and _number(y)):
            return None  # a computed point: nothing to draw
        kind = "drag" if name == "dragTo" else "move" if name == "moveTo" else "click"
        return {"kind": kind, "x": x, "y": y, "label": _POINT_CALLS.get(name, "drag to"), "_pos": pos}
    if name in ("write", "typewrite"):
        text = _args(call, ["message"]).get("message")
        if isinstance(text, list):
            text = " ".join(map(str, text))
        return {"kind": "type", "text": str(text), "label": "type", "_pos": pos} if text is not None else None
    if name in ("press", "hotkey", "keyDown", "keyUp"):
        keys = [_literal(a) for a in call.args]
        if len(keys) == 1 and isinstance(keys[0], list):
            keys = keys[0]
        return {"kind": "key", "keys": [str(k) for k in keys], "label": name, "_pos": pos}
    return None


def _computer13(action: dict) -> list[dict]:
    kind = str(action.get("action_type", "")).upper()
    p = action.get("parameters") if isinstance(action.get("parameters"), dict) else action
    x, y = p.get("x"), p.get("y")
    if kind in _C13_POINTS and _number(x) and _number(y):
        return [{"kind": "click" if "CLICK" in kind else "move", "x": x, "y": y, "label": _C13_POINTS[kind]}]
    if kind == "DRAG_TO" and _number(x) and _number(y):
        return [{"kind": "drag", "x": x, "y": y, "label": "drag to"}]
    if kind == "SCROLL":
        return [{"kind": "scroll", "amount": p.get("dy") or p.get("dx"), "label": "scroll"}]
    if kind == "TYPING":
        return [{"kind": "type", "text": str(p.get("text", "")), "label": "type"}]
    if kind in ("PRESS", "KEY_DOWN", "KEY_UP"):
        return [{"kind": "key", "keys": [str(p.get("key", ""))], "label": kind.lower()}]
    if kind == "HOTKEY":
        return [{"kind": "key", "keys": [str(k) for k in p.get("keys") or []], "label": "hotkey"}]
    return []


def web_marks(action: Any, tree: str = "", box: Any = None, size: Any = None) -> list[dict]:
    """The marks of one WebArena or BrowserGym action (``click [12]``, ``fill('12', 'hi')``):
    the element it acts on (``element``: its id or ``role 'name'`` reference; ``line``: its
    line in ``tree``, the accessibility tree the action was chosen from, when found there),
    typed text, keys, a scroll, a page change (``goto``, back, tabs) or the answer; [] when
    the text is not such an action.

    ``box`` is the element's recorded box (``x``, ``y``, ``width``, ``height`` in the pixels of
    the screenshot the action was chosen on, ``size`` = [width, height]): the element's mark
    then has it and, when its centre lies on that screenshot, ``x`` and ``y`` (the centre), to
    be drawn there; a centre off it (the element was scrolled out of view; the action
    scrolled it in) gives ``offscreen`` (``above``, ``below``, ``left`` or ``right``) instead.
    Without a usable box the mark names the element only."""
    if not isinstance(action, str):
        return []
    try:
        act = parse_action(action)
    except ActionSyntaxError:
        return []
    out: list[dict] = []
    if act.element is not None:
        label = "choose" if act.option is not None else act.kind
        mark = {"kind": "element", "label": label, "element": act.element, "line": _tree_line(tree, act.element)}
        mark.update(_placed(box, size))
        out.append(mark)
    if act.kind == "type":
        out.append({"kind": "type", "text": act.text or "", "label": "type", "enter": act.enter})
    elif act.option is not None:
        out.append({"kind": "type", "text": act.option, "label": "choose"})
    elif act.kind == "press":
        out.append({"kind": "key", "keys": (act.key or "").split("+"), "label": "press"})
    elif act.kind == "scroll":
        out.append({"kind": "scroll", "direction": act.direction, "label": f"scroll {act.direction}"})
    elif act.kind == "goto":
        out.append({"kind": "page", "label": f"goto {act.url}", "url": act.url})
    elif act.kind in ("go_back", "go_forward", "new_tab", "close_tab", "tab_focus"):
        out.append({"kind": "page", "label": act.kind.replace("_", " ")
                    + ("" if act.index is None else f" {act.index}")})
    elif act.kind == "stop":
        out.append({"kind": "page", "label": f"stop: {act.answer}"})
    return out


def _placed(box: Any, size: Any) -> dict:
    """``box``, and the centre's ``x``/``y`` or ``offscreen`` (see :func:`web_marks`); {} for a
    missing or malformed box (a step line is read from a file)."""
    try:
        x, y, w, h = (float(box[k]) for k in ("x", "y", "width", "height"))
    except (KeyError, TypeError, ValueError):
        return {}
    if not all(math.isfinite(v) for v in (x, y, w, h)) or w < 0 or h < 0:
        return {}
    out: dict[str, Any] = {"box": {"x": x, "y": y, "width": w, "height": h}}
    cx, cy = round(x + w / 2, 2), round(y + h / 2, 2)
    try:
        sw, sh = float(size[0]), float(size[1])
    except (IndexError, TypeError, ValueError):
        return out  # no screenshot to place it on
    if cy < 0:
        out["offscreen"] = "above"
    elif cy >= sh:
        out["offscreen"] = "below"
    elif cx < 0:
        out["offscreen"] = "left"
    elif cx >= sw:
        out["offscreen"] = "right"
    else:
        out.update(x=cx, y=cy)
    return out


def _tree_line(tree: str, element: str) -> str | None:
    """``role 'name'`` of the tree line with id ``element`` (None: not in the tree, or the
    element is already named by reference)."""
    if not tree or not element.isdigit():
        return None
    for node in axtree_object(tree)["nodes"]:
        if str(node.get("browsergym_id")) == element:
            return f"{node['role']['value']} {node['name']['value']!r}"
    return None
