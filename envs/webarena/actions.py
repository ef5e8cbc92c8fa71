"""WebArena's action strings, parsed.

The grammar is WebArena's (``browser_env/actions.py``, id-based actions)::

    click [id]            hover [id]            type [id] [content] [press_enter_after=0|1]
    press [key_comb]      scroll [down|up]      new_tab    tab_focus [tab_index]    close_tab
    goto [url]            go_back               go_forward stop [answer]

``type`` presses Enter after the text unless its last argument is ``[0]`` (default 1, as in
WebArena). ``stop`` without brackets answers the empty string. One extension: an element
may also be named by its tree line instead of its id, ``click [link 'My Account']`` or,
for the k-th such line, ``click [button 'Add to Cart' #2]``; scripted oracles use it.

Example:
    >>> parse_action("type [164] [wireless headphones] [1]")
    Action(kind='type', element='164', text='wireless headphones', enter=True, ...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


USAGE = {
    "click": "click [id]", "hover": "hover [id]", "type": "type [id] [content] [press_enter_after=0|1]",
    "press": "press [key_comb]", "scroll": "scroll [down|up]", "tab_focus": "tab_focus [tab_index]",
    "goto": "goto [url]", "stop": "stop [answer]",
}


def parse_action(text: str) -> Action:
    """Parse one action string; raises :class:`ActionSyntaxError` with the expected form."""
    if not isinstance(text, str):
        raise ActionSyntaxError(f"an action is a string, not {type(text).__name__}")
    s = text.strip()
    if not s:
        raise ActionSyntaxError("empty action; expected one of: " + ", ".join(KINDS))
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
