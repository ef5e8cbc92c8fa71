"""WebArena's action strings, parsed.

The grammar is WebArena's (``browser_env/actions.py``, id-based actions)::

    click [id]            hover [id]            type [id] [content] [press_enter_after=0|1]
    press [key_comb]      scroll [down|up]      new_tab    tab_focus [tab_index]    close_tab
    goto [url]            go_back               go_forward stop [answer]

``type`` presses Enter after the text unless its last argument is ``[0]`` (default 1, as in
WebArena). ``stop`` without brackets answers the empty string. One extension: an element
may also be named by its tree line instead of its id, ``click [link 'My Account']`` or,
for the k-th such line, ``click [button 'Add to Cart' #2]``; scripted oracles use it.

BrowserGym's high-level actions (``browsergym.core.action.functions``, written as one Python
call with literal arguments; the bid is the tree id) parse to the same :class:`Action`::

    click('12')  hover('12')  fill('12', 'text')  clear('12')  press('12', 'Enter')
    select_option('12', 'label')  keyboard_press('Enter')  scroll(0, 200)  goto('url')
    go_back()  go_forward()  new_tab()  tab_close()  tab_focus(1)  noop(500)
    send_msg_to_user('answer')  report_infeasible('reason')

``send_msg_to_user`` answers and ends the episode like ``stop [answer]``; ``report_infeasible``
like ``stop [N/A]`` (WebArena's answer for an infeasible task); ``fill`` types without Enter.

Example:
    >>> parse_action("type [164] [wireless headphones] [1]")
    Action(kind='type', element='164', text='wireless headphones', enter=True, ...)
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from bunshin_gym.envs.webarena.urlguard import origin
from bunshin_gym.errors import ActionSyntaxError, URLRefused

KINDS = ("click", "type", "hover", "press", "scroll", "new_tab", "tab_focus", "close_tab", "goto", "go_back",
         "go_forward", "stop")


@dataclass
class Action:
    """One parsed action. ``element`` is an id (digits) or a ``role 'name'`` reference."""

    kind: str
    element: str | None = None
    text: str | None = None
    enter: bool = False
    key: str | None = None
    direction: str | None = None
    url: str | None = None
    index: int | None = None
    answer: str | None = None
    raw: str = ""
    option: str | None = None  # select: the option's label
    wait_s: float | None = None  # noop: how long to wait


USAGE = {
    "click": "click [id]", "hover": "hover [id]", "type": "type [id] [content] [press_enter_after=0|1]",
    "press": "press [key_comb]", "scroll": "scroll [down|up]", "tab_focus": "tab_focus [tab_index]",
    "goto": "goto [url]", "stop": "stop [answer]",
}


def parse_action(text: str) -> Action:
    """Parse one action string, WebArena's or BrowserGym's; raises :class:`ActionSyntaxError`
    with the expected form."""
    if not isinstance(text, str):
        raise ActionSyntaxError(f"an action is a string, not {type(text).__name__}")
    s = text.strip()
    if not s:
        raise ActionSyntaxError("empty action; expected one of: " + ", ".join(KINDS))
    if _CALL.match(s):
        return parse_browsergym_action(s)
    kind = s.split("[", 1)[0].strip() if "[" in s else s.split()[0]
    kind = kind.lower()
    if kind not in KINDS:
        raise ActionSyntaxError(f"unknown action {kind!r} in {s!r}; expected one of: {', '.join(KINDS)}")

    def bad() -> ActionSyntaxError:
        return ActionSyntaxError(f"malformed {kind} action {s!r}; expected: {USAGE.get(kind, kind)}")

    if kind in ("click", "hover"):
        m = re.fullmatch(rf"{kind} ?\[(.+)\]", s, re.DOTALL)
        if not m:
            raise bad()
        return Action(kind, element=m.group(1).strip(), raw=s)
    if kind == "type":
        if not (s.endswith("[0]") or s.endswith("[1]")):
            s += " [1]"
        m = re.fullmatch(r"type ?\[([^\]]+)\] ?\[(.*)\] ?\[([01])\]", s, re.DOTALL)
        if not m:
            raise bad()
        return Action(kind, element=m.group(1).strip(), text=m.group(2), enter=m.group(3) == "1", raw=s)
    if kind == "press":
        m = re.fullmatch(r"press ?\[(.+)\]", s)
        if not m:
            raise bad()
        return Action(kind, key=m.group(1).strip(), raw=s)
    if kind == "scroll":
        m = re.fullmatch(r"scroll ?\[?(up|down)\]?", s, re.IGNORECASE)
        if not m:
            raise bad()
        return Action(kind, direction=m.group(1).lower(), raw=s)
    if kind == "goto":
        m = re.fullmatch(r"goto ?\[(.+)\]", s)
        if not m:
            raise bad()
        return Action(kind, url=m.group(1).strip(), raw=s)
    if kind == "tab_focus":
        m = re.fullmatch(r"tab_focus ?\[(\d+)\]", s)
        if not m:
            raise bad()
        return Action(kind, index=int(m.group(1)), raw=s)
    if kind == "stop":
        m = re.fullmatch(r"stop ?\[(.*)\]", s, re.DOTALL)
        if m is None and s != "stop":
            raise bad()
        return Action(kind, answer=m.group(1) if m else "", raw=s)
    if s != kind:
        raise ActionSyntaxError(f"{kind} takes no argument: {s!r}")
    return Action(kind, raw=s)


# BrowserGym's high-level action set ---------------------------------------------------------
#: function -> its parameters (BrowserGym's names, in order; ``=`` marks a default)
BROWSERGYM_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "click": ("bid", "button=left", "modifiers=()"), "hover": ("bid",), "fill": ("bid", "value"),
    "clear": ("bid",), "press": ("bid", "key_comb"), "select_option": ("bid", "options"),
    "keyboard_press": ("key",), "scroll": ("delta_x", "delta_y"), "goto": ("url",), "go_back": (),
    "go_forward": (), "new_tab": (), "tab_close": (), "tab_focus": ("index",), "noop": ("wait_ms=1000",),
    "send_msg_to_user": ("text",), "report_infeasible": ("reason",),
}
_CALL = re.compile(r"[a-z_]+\s*\(")  # WebArena never writes "(" after its word: it uses [...]


def _call_arguments(s: str) -> tuple[str, dict]:
    """(function, {parameter: literal value}) of one BrowserGym call, checked against its signature."""
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError as e:
        raise ActionSyntaxError(f"malformed BrowserGym action {s!r}: {e.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ActionSyntaxError(f"a BrowserGym action is one call such as click('12'), not {s!r}")
    name = call.func.id
    if name not in BROWSERGYM_FUNCTIONS:
        raise ActionSyntaxError(f"unknown or unsupported BrowserGym action {name!r}; supported: "
                                + ", ".join(BROWSERGYM_FUNCTIONS))
    params = [p.split("=")[0] for p in BROWSERGYM_FUNCTIONS[name]]
    usage = f"{name}({', '.join(BROWSERGYM_FUNCTIONS[name])})"
    if len(call.args) > len(params):
        raise ActionSyntaxError(f"{name} takes {len(params)} argument(s): {usage}")
    def literal(node: ast.expr) -> Any:
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise ActionSyntaxError(f"the arguments of {s!r} must be literals: {usage}") from None

    values = {p: literal(a) for p, a in zip(params, call.args, strict=False)}
    for kw in call.keywords:
        if kw.arg not in params or kw.arg in values:
            raise ActionSyntaxError(f"{name} has no argument {kw.arg!r} (or got it twice): {usage}")
        values[kw.arg] = literal(kw.value)
    for p in BROWSERGYM_FUNCTIONS[name]:
        name_, _, default = p.partition("=")
        if name_ not in values and not default:
            raise ActionSyntaxError(f"{name} is missing {name_!r}: {usage}")
    return name, values


def _text(values: dict, key: str, name: str) -> str:
    v = values[key]
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise ActionSyntaxError(f"{name}: {key} must be a string, not {type(v).__name__}")
    return str(v)


def parse_browsergym_action(text: str) -> Action:
    """One BrowserGym high-level action (see the module docs) as an :class:`Action`."""
    s = text.strip()
    name, v = _call_arguments(s)
    if "bid" in v:
        bid = _text(v, "bid", name)
    if name == "click":
        if v.get("button", "left") != "left" or v.get("modifiers"):
            raise ActionSyntaxError("click: only the left button without modifiers is supported here")
        return Action("click", element=bid, raw=s)
    if name == "hover":
        return Action("hover", element=bid, raw=s)
    if name in ("fill", "clear"):
        return Action("type", element=bid, text=_text(v, "value", name) if name == "fill" else "", raw=s)
    if name == "press":
        return Action("press", element=bid, key=_text(v, "key_comb", name), raw=s)
    if name == "keyboard_press":
        return Action("press", key=_text(v, "key", name), raw=s)
    if name == "select_option":
        options = v["options"]
        if isinstance(options, (list, tuple)):
            if len(options) != 1:
                raise ActionSyntaxError("select_option: one option at a time here")
            options = options[0]
        return Action("select", element=bid, option=_text({"options": options}, "options", name), raw=s)
    if name == "scroll":
        dy = v["delta_y"]
        if not isinstance(dy, (int, float)) or dy == 0:
            raise ActionSyntaxError("scroll(delta_x, delta_y): a non-zero vertical delta_y (pages scroll vertically)")
        return Action("scroll", direction="down" if dy > 0 else "up", raw=s)
    if name == "goto":
        return Action("goto", url=_text(v, "url", name), raw=s)
    if name in ("go_back", "go_forward", "new_tab"):
        return Action(name, raw=s)
    if name == "tab_close":
        return Action("close_tab", raw=s)
    if name == "tab_focus":
        if not isinstance(v["index"], int) or isinstance(v["index"], bool) or v["index"] < 0:
            raise ActionSyntaxError("tab_focus(index): index is a tab number, 0 or more")
        return Action("tab_focus", index=v["index"], raw=s)
    if name == "noop":
        wait = v.get("wait_ms", 1000)
        if not isinstance(wait, (int, float)) or not 0 <= wait <= 60_000:
            raise ActionSyntaxError("noop(wait_ms): a number of milliseconds from 0 to 60000")
        return Action("noop", wait_s=wait / 1000, raw=s)
    if name == "send_msg_to_user":
        return Action("stop", answer=_text(v, "text", name), raw=s)
    return Action("stop", answer="N/A", raw=s)  # report_infeasible


# where the browser may go ------------------------------------------------------------------
def check_url(url: str, site_urls: list[str] | tuple[str, ...]) -> str:
    """``url`` if the browser may open it: ``about:blank`` or a page of one of the env's sites
    (same scheme, host and port). Anything else, ``file://``, ``chrome://``, ``view-source:``,
    ``data:``, ``javascript:`` or another host or port, raises :class:`URLRefused`: a policy
    must not read the workspace's files or other local services through the browser."""
    if url == "about:blank":
        return url
    allowed = {origin(u) for u in site_urls} - {None}
    if origin(url) not in allowed:
        sites = ", ".join(sorted(site_urls)) or "none"
        raise URLRefused(f"the browser may only open the env's sites ({sites}), not {url[:200]!r}")
    return url
