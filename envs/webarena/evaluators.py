"""WebArena's evaluators, without an LLM judge: string_match, url_match, program_html.

They follow WebArena's ``evaluation_harness/evaluators.py``: the score is the product of
every evaluator named in ``eval_types`` and of every check inside one.

- ``string_match`` (on the answer of ``stop [answer]``): ``exact_match`` compares the cleaned
  strings (surrounding quotes dropped, lower case); ``must_include`` wants each reference
  as a substring (a single one-character reference must be a whole token, as WebArena's
  tokenised check); ``fuzzy_match`` is deterministic here (WebArena asks an LLM), see
  :func:`fuzzy_match`.
- ``url_match`` ("GOLD in PRED", WebArena's rule): some reference's host+path is a substring
  of the page's, and every query parameter of the references has one of its values in the
  page's query. References are split on `` |OR| ``.
- ``program_html``: for each ``{url, locator, required_contents}``, read the page ("last":
  the agent's current page; another URL: loaded in a temporary tab) and evaluate the
  locator there (a ``document.`` JavaScript expression, or "" for the whole HTML), then check
  ``exact_match`` or ``must_include`` (each item may list alternatives with `` |OR| ``).
  ``func:shopping_get_latest_order_url()`` as url is supported (the newest order of the
  signed-in customer, read from the order history page).

Reward integrity: every comparison runs here, on the host. What the browser supplies (the
current URL, a locator's value, a page's HTML) is read through the driver inside the
workspace, because it is the very state being scored (the shop's pages and database). A
web policy cannot tamper with that reading: its actions are browser actions only (no shell,
so no way to replace the driver, chromium or the shop's python3), and its browser cannot
open local files or other local services (``driver.py``, ``actions.check_url``).
"""

from __future__ import annotations

import html
import re
import urllib.parse
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from bunshin_gym.core.task import TaskError

STOPWORDS = {"a", "an", "the", "of", "and", "or", "is", "are", "to", "in", "on", "for", "with", "it", "its", "at",
             "by", "be", "this", "that", "was", "i", "my", "me", "you", "your"}


class Page(Protocol):
    """What the evaluators need from the browser (the env's driver client provides it)."""

    def current_url(self) -> str: ...

    def evaluate(self, js: str | None, url: str | None = None) -> str: ...


def clean_answer(answer: str) -> str:
    answer = answer.strip()
    if len(answer) >= 2 and answer[0] == answer[-1] and answer[0] in "'\"":
        answer = answer[1:-1]
    return answer.lower()


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def exact_match(ref: str, pred: str) -> float:
    return float(clean_answer(ref) == clean_answer(pred))


def must_include(ref: str, pred: str, tokenize: bool = False) -> float:
    r, p = clean_answer(ref), clean_answer(pred)
    if tokenize and len(r) == 1 and len(_tokens(r)) == 1:
        return float(r in _tokens(p))
    return float(r in p)


def _norm_tokens(text: str) -> list[str]:
    """Lower-case words and numbers; numbers canonical ("$1,234.50" -> "1234.5"), stop words out."""
    out = []
    for tok in re.findall(r"\d[\d,]*(?:\.\d+)?|[a-z0-9]+(?:['’][a-z]+)?", text.lower()):
        if tok[0].isdigit():
            num = float(tok.replace(",", ""))
            tok = f"{num:g}" if num != int(num) else str(int(num))
        if tok not in STOPWORDS:
            out.append(tok)
    return out


def fuzzy_match(ref: str, pred: str) -> float:
    """Deterministic stand-in for WebArena's LLM judge: 1.0 when every content word and number
    of the reference (stop words out, numbers compared by value, case ignored) occurs in the
    prediction; "N/A" references want a prediction that starts with "N/A"."""
    if clean_answer(ref) == "n/a":
        return float(clean_answer(pred).startswith("n/a"))
    have = set(_norm_tokens(pred))
    need = _norm_tokens(ref)
    return float(bool(need) and all(t in have for t in need))


def string_match(answers: dict, pred: str) -> float:
    score = 1.0
    for approach, value in answers.items():
        if approach == "exact_match":
            score *= exact_match(value, pred)
        elif approach == "must_include":
            if not isinstance(value, list):
                raise TaskError(f"string_match must_include wants a list, got {value!r}")
            for v in value:
                score *= must_include(v, pred, tokenize=len(value) == 1)
        elif approach == "fuzzy_match":
            refs = [value] if isinstance(value, str) else list(value)
            for v in refs:
                score *= fuzzy_match(v, pred)
        else:
            raise TaskError(f"unknown reference_answers kind {approach!r}")
    return score


def _clean_url(url: str) -> str:
    return str(url).rstrip("/")


def _parse_url(url: str) -> tuple[str, dict[str, list[str]]]:
    parts = urllib.parse.urlparse(url)
    return parts.netloc + parts.path, urllib.parse.parse_qs(parts.query)


def url_match(reference_url: str, pred_url: str, rule: str = "GOLD in PRED") -> float:
    if rule != "GOLD in PRED":
        raise TaskError(f"unknown url_note {rule!r} (WebArena defines 'GOLD in PRED')")
    refs = [_clean_url(u) for u in reference_url.split(" |OR| ")]
    pred_base, pred_query = _parse_url(_clean_url(pred_url))
    ref_bases, ref_queries = [], defaultdict(set)
    for u in refs:
        base, query = _parse_url(u)
        ref_bases.append(base)
        for k, v in query.items():
            ref_queries[k].update(v)
    base_score = float(any(b in pred_base for b in ref_bases))
    query_score = 1.0
    for k, values in ref_queries.items():
        query_score *= float(any(v in pred_query.get(k, []) for v in values))
    return base_score * query_score


def program_html(targets: list[dict], page: Page, resolve: Callable[[str], str],
                 helpers: dict[str, Callable[[], str]] | None = None) -> float:
    """Score WebArena's ``program_html`` checks against the live browser.

    Args:
        targets: the ``program_html`` list of a task config.
        page: the browser (current url; JS evaluation on the current page or a URL).
        resolve: substitutes the site placeholders (``__SHOPPING__``) in a URL.
        helpers: ``func:`` URL helpers by name (e.g. ``shopping_get_latest_order_url``).
    """
    score = 1.0
    for t in targets:
        url = t.get("url", "last")
        if url.startswith("func:"):
            name = re.fullmatch(r"func:\s*(\w+)\(\)\s*", url)
            fn = (helpers or {}).get(name.group(1)) if name else None
            if fn is None:
                raise TaskError(f"program_html url {url!r}: unsupported helper (known: {sorted(helpers or {})})")
            url = fn()
        target_url = None if url == "last" else resolve(url)
        locator = (t.get("locator") or "").strip()
        if not locator:
            value = page.evaluate(None, target_url)
        elif locator.startswith(("document.", "[...document.")):
            for prep in t.get("prep_actions") or []:
                page.evaluate(prep, target_url)
            try:
                value = page.evaluate(locator, target_url)
            except RuntimeError:
                value = ""  # WebArena: a failing locator selects nothing
        else:
            raise TaskError(f"program_html locator {locator[:60]!r}: only document.* expressions and '' are "
                            "supported")
        value = html.unescape(value or "")
        required = t.get("required_contents") or {}
        if "exact_match" in required:
            score *= exact_match(required["exact_match"], value)
        elif "must_include" in required:
            for content in required["must_include"]:
                score *= float(any(must_include(c, value) for c in content.split(" |OR| ")))
        else:
            raise TaskError(f"program_html required_contents {required!r}: want exact_match or must_include")
    return score


def evaluate(config: dict, answer: str | None, page: Page, resolve: Callable[[str], str],
             helpers: dict[str, Callable[[], str]] | None = None) -> float:
    """The score (0.0-1.0) of an episode under a WebArena config's ``eval`` block."""
    ev = config.get("eval") or {}
    types = ev.get("eval_types") or []
    if not types:
        raise TaskError(f"task {config.get('task_id')}: eval.eval_types is empty")
    score = 1.0
    for kind in types:
        if kind == "string_match":
            score *= string_match(ev.get("reference_answers") or {}, answer or "")
        elif kind == "url_match":
            score *= url_match(resolve(ev.get("reference_url") or ""), page.current_url(),
                               ev.get("url_note") or "GOLD in PRED")
        elif kind == "program_html":
            score *= program_html(ev.get("program_html") or [], page, resolve, helpers)
        else:
            raise TaskError(f"task {config.get('task_id')}: unsupported eval type {kind!r} "
                            "(supported: string_match, url_match, program_html)")
        if score == 0.0:
            break
    return score
