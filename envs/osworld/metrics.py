"""OSWorld evaluator metrics: ``func(result, expected=None, **options) -> float``.

Each takes what the getters returned (a local file path, a string, a dict) and scores it
1.0 or 0.0 (some may give fractions). A metric whose input is missing (``None``: the
file was not there) scores 0. Names follow OSWorld's ``desktop_env.evaluators.metrics``;
``check_directory_tree`` is bunshin's own (for ``list_directory``).

Reward integrity: the metrics run in this process, on the host. Their inputs come from the
getters (``tasks.py``) either as the bytes of the workspace's files (the policy's data, which
it controls anyway) or from commands run with the image's pristine binaries outside the
workspace (:mod:`bunshin_gym.workspace.pristine`), never from the workspace's own binaries,
which a policy with sudo can replace.

Example:
    >>> exact_match("100\\n", {"expected": "100\\n"})
    1.0
"""

from __future__ import annotations

import csv
import json
import math
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

METRICS: dict[str, Callable[..., float]] = {}


def metric(fn: Callable[..., float]) -> Callable[..., float]:
    METRICS[fn.__name__] = fn
    return fn


# text ------------------------------------------------------------------------------------
@metric
def exact_match(result: Any, rules: dict, **_: Any) -> float:
    """``result == rules["expected"]``."""
    if result is None:
        return 0.0
    return float(result == rules["expected"])


@metric
def check_include_exclude(result: Any, rules: dict, **_: Any) -> float:
    """Every string of ``rules["include"]`` is in ``result`` and none of ``rules["exclude"]``."""
    if result is None:
        return 0.0
    text = result if isinstance(result, str) else json.dumps(result)
    return float(all(s in text for s in rules.get("include", [])) and
                 not any(s in text for s in rules.get("exclude", [])))


@metric
def match_in_list(result: Any, rules: dict, **_: Any) -> float:
    """``result`` is one of ``rules["expected"]``."""
    return float(result is not None and result in rules["expected"])


@metric
def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """``result == expected`` (strings compared case-insensitively with ``ignore_case``)."""
    if result is None:
        return 0.0
    if options.get("ignore_case") and isinstance(result, str) and isinstance(expected, str):
        return float(result.lower() == expected.lower())
    return float(result == expected)


@metric
def check_direct_json_object(result: Any, rules: dict, **_: Any) -> float:
    """Every key of ``rules["expected"]`` has that value in the ``result`` dict (a JSON string
    or a dict); ``rules["relativeTime"]`` is not supported."""
    if result is None:
        return 0.0
    if isinstance(result, str):
        try:
            result = json.loads(result)
        except json.JSONDecodeError:
            return 0.0
    if not isinstance(result, dict):
        return 0.0
    return float(all(result.get(k) == v for k, v in rules["expected"].items()))


def _read_text(path: str | None) -> str | None:
    if path is None or not Path(path).exists():
        return None
    return Path(path).read_text(errors="replace")


@metric
def compare_text_file(result: str | None, expected: str | None, **options: Any) -> float:
    """Two text files are equal (options ``ignore_blanks``: whitespace runs are equal and
    leading/trailing space ignored; ``ignore_case``)."""
    a, b = _read_text(result), _read_text(expected)
    if a is None or b is None:
        return 0.0
    if options.get("ignore_blanks"):
        a, b = re.sub(r"\s+", " ", a).strip(), re.sub(r"\s+", " ", b).strip()
    if options.get("ignore_case"):
        a, b = a.lower(), b.lower()
    return float(a == b)


@metric
def compare_csv(result: str | None, expected: str | None, **options: Any) -> float:
    """Two CSV files hold the same rows (parsed: quoting and line endings do not matter;
    ``strict=False`` also ignores case and surrounding spaces in cells)."""
    a, b = _read_text(result), _read_text(expected)
    if a is None or b is None:
        return 0.0
    ra = [r for r in csv.reader(a.splitlines()) if r]
    rb = [r for r in csv.reader(b.splitlines()) if r]
    if not options.get("strict", True):
        ra = [[c.strip().lower() for c in r] for r in ra]
        rb = [[c.strip().lower() for c in r] for r in rb]
    return float(ra == rb)


# chromium ----------------------------------------------------------------------------------
def _norm_url(url: str) -> str:
    return url.rstrip("/")


@metric
def is_expected_tabs(open_tabs: list | None, rule: dict, **_: Any) -> float:
    """``rule = {"type": "url", "urls": [...]}``: the open tabs' urls, in order."""
    if open_tabs is None:
        return 0.0
    if rule.get("type") != "url":
        raise ValueError(f"is_expected_tabs: unsupported rule type {rule.get('type')!r}")
    return float([_norm_url(t["url"]) for t in open_tabs] == [_norm_url(u) for u in rule["urls"]])


@metric
def is_expected_active_tab(active_tab_info: dict | None, rule: dict, **_: Any) -> float:
    """``rule = {"type": "url", "url": ...}``: the active tab's url."""
    if not active_tab_info:
        return 0.0
    if rule.get("type") != "url":
        raise ValueError(f"is_expected_active_tab: unsupported rule type {rule.get('type')!r}")
    return float(_norm_url(active_tab_info["url"]) == _norm_url(rule["url"]))


@metric
def is_expected_bookmarks(bookmarks: dict | None, rule: dict, **_: Any) -> float:
    """``rule`` types ``bookmark_bar_folders_names`` (``names``) and
    ``bookmark_bar_websites_urls`` (``urls``), as OSWorld's."""
    if not bookmarks:
        return 0.0
    bar = bookmarks.get("bookmark_bar", {}).get("children", [])
    if rule["type"] == "bookmark_bar_folders_names":
        return float({b["name"] for b in bar if b.get("type") == "folder"} == set(rule["names"]))
    if rule["type"] == "bookmark_bar_websites_urls":
        return float({_norm_url(b["url"]) for b in bar if b.get("type") == "url"} ==
                     {_norm_url(u) for u in rule["urls"]})
    raise ValueError(f"is_expected_bookmarks: unsupported rule type {rule['type']!r}")


# files -------------------------------------------------------------------------------------
def _tree_paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for child in tree.get("children", []):
        path = f"{prefix}{child['name']}"
        out.add(path + ("/" if child["type"] == "directory" else ""))
        if child["type"] == "directory":
            out |= _tree_paths(child, path + "/")
    return out


@metric
def check_directory_tree(result: dict | None, rules: dict, **_: Any) -> float:
    """``result`` from the ``list_directory`` getter; ``rules["include"]`` / ``rules["exclude"]``
    list paths relative to the listed directory (a trailing ``/`` names a directory)."""
    if not result:
        return 0.0
    paths = _tree_paths(result)
    return float(all(p in paths for p in rules.get("include", [])) and
                 not any(p in paths for p in rules.get("exclude", [])))


# tables --------------------------------------------------------------------------------------
_NS = {"m": "http://schemas.openxmlformats.org/spreadsheetml/2006/main",
       "r": "http://schemas.openxmlformats.org/officeDocument/2006/relationships"}


def _col_index(ref: str) -> tuple[int, int]:
    m = re.fullmatch(r"([A-Z]+)(\d+)", ref)
    if not m:
        raise ValueError(f"bad cell reference {ref!r}")
    col = 0
    for ch in m.group(1):
        col = col * 26 + ord(ch) - 64
    return int(m.group(2)) - 1, col - 1


def read_xlsx(path: str) -> list[tuple[str, list[list[Any]]]]:
    """Sheets of an .xlsx file as ``[(name, rows)]`` with the cells' cached values (numbers
    as float, text as str, booleans as bool, empty as None). Standard library only."""
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        shared: list[str] = []
        if "xl/sharedStrings.xml" in names:
            for si in ElementTree.fromstring(z.read("xl/sharedStrings.xml")).findall("m:si", _NS):
                shared.append("".join(t.text or "" for t in si.iter(f"{{{_NS['m']}}}t")))
        wb = ElementTree.fromstring(z.read("xl/workbook.xml"))
        rels = ElementTree.fromstring(z.read("xl/_rels/workbook.xml.rels"))
        targets = {r.get("Id"): r.get("Target") for r in rels}
        sheets = []
        for s in wb.find("m:sheets", _NS):
            target = targets[s.get(f"{{{_NS['r']}}}id")].lstrip("/")
            target = target if target.startswith("xl/") else "xl/" + target
            root = ElementTree.fromstring(z.read(target))
            cells: dict[tuple[int, int], Any] = {}
            for c in root.iter(f"{{{_NS['m']}}}c"):
                r, col = _col_index(c.get("r"))
                t = c.get("t", "n")
                v = c.find("m:v", _NS)
                if t == "inlineStr":
                    val = "".join(x.text or "" for x in c.iter(f"{{{_NS['m']}}}t"))
                elif v is None or v.text is None:
                    continue
                elif t == "s":
                    val = shared[int(v.text)]
                elif t == "b":
                    val = v.text == "1"
                elif t in ("str", "e"):
                    val = v.text
                else:
                    val = float(v.text)
                cells[(r, col)] = val
            sheets.append((s.get("name"), _grid(cells)))
    return sheets


def _grid(cells: dict[tuple[int, int], Any]) -> list[list[Any]]:
    cells = {k: v for k, v in cells.items() if v not in (None, "")}
    if not cells:
        return []
    nrows = max(r for r, _ in cells) + 1
    ncols = max(c for _, c in cells) + 1
    return [[cells.get((r, c)) for c in range(ncols)] for r in range(nrows)]


def read_csv_table(path: str) -> list[tuple[str, list[list[Any]]]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    cells = {(r, c): v for r, row in enumerate(rows) for c, v in enumerate(row)}
    return [(Path(path).stem, _grid(cells))]


def read_table(path: str) -> list[tuple[str, list[list[Any]]]]:
    """Sheets of an .xlsx or .csv file (see :func:`read_xlsx`)."""
    if str(path).lower().endswith(".csv"):
        return read_csv_table(path)
    return read_xlsx(path)


def _norm_cell(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, str):
        s = v.strip()
        try:
            return float(s.replace(",", "")) if s and re.fullmatch(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?", s, re.I) else s
        except ValueError:
            return s
    return float(v)


def _cells_equal(a: Any, b: Any, tol: float = 1e-6) -> bool:
    a, b = _norm_cell(a), _norm_cell(b)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    return a == b


def _sheets_equal(s1: list[list[Any]], s2: list[list[Any]]) -> bool:
    width = max([len(r) for r in s1 + s2] or [0])
    pad = lambda rows: [list(r) + [None] * (width - len(r)) for r in rows]  # noqa: E731
    p1, p2 = pad(s1), pad(s2)
    while p1 and all(v in (None, "") for v in p1[-1]):
        p1.pop()
    while p2 and all(v in (None, "") for v in p2[-1]):
        p2.pop()
    return len(p1) == len(p2) and all(_cells_equal(a, b) for r1, r2 in zip(p1, p2, strict=True)
                                      for a, b in zip(r1, r2, strict=True))


def _pick(idx: Any, result: list, expected: list | None) -> list[list[Any]]:
    """OSWorld's sheet index: an int (result), "RI0"/"EI0" (result/expected by index),
    "RNname"/"ENname" (by name)."""
    if isinstance(idx, int):
        return result[idx][1]
    book = result if idx[0] == "R" else expected
    if book is None:
        raise ValueError(f"sheet index {idx!r} needs an expected file")
    if idx[1] == "I":
        return book[int(idx[2:])][1]
    for name, rows in book:
        if name == idx[2:]:
            return rows
    raise KeyError(f"no sheet named {idx[2:]!r}")


def _match_rule(value: Any, rule: dict) -> bool:
    method, ref = rule["method"], rule.get("ref")
    if method == "eq":
        return _cells_equal(value, ref)
    if method == "ne":
        return not _cells_equal(value, ref)
    if method.startswith("approx"):
        tol = float(method.split(":")[1]) if ":" in method else 1e-6
        v, r = _norm_cell(value), _norm_cell(ref)
        return isinstance(v, float) and isinstance(r, float) and abs(v - r) <= tol
    if method in ("lt", "le", "gt", "ge"):
        v, r = _norm_cell(value), _norm_cell(ref)
        if not (isinstance(v, float) and isinstance(r, float)):
            return False
        return {"lt": v < r, "le": v <= r, "gt": v > r, "ge": v >= r}[method]
    if method == "str_eq":
        return str(value) == str(ref)
    if method == "str_in":
        return str(ref) in str(value)
    raise ValueError(f"compare_table: unsupported check_cell method {method!r}")


@metric
def compare_table(result: str | None, expected: str | None = None, **options: Any) -> float:
    """Compare spreadsheets (.xlsx or .csv, any mix) by ``options["rules"]``, each one of:
    ``sheet_name`` (same sheet names), ``sheet_data`` (``sheet_idx0`` and ``sheet_idx1`` hold
    the same values; numbers compared with a tolerance, numeric text equals the number),
    ``check_cell`` (``sheet_idx``, ``coordinate``, ``props.value = {method, ref}``).
    Without rules: every sheet equal. A rule type that is not listed is an error."""
    if result is None or not Path(result).exists():
        return 0.0
    try:
        rbook = read_table(result)
    except (zipfile.BadZipFile, KeyError, ElementTree.ParseError, UnicodeDecodeError):
        return 0.0
    ebook = read_table(expected) if expected is not None else None
    rules = options.get("rules") or [{"type": "sheet_data", "sheet_idx0": f"RI{i}", "sheet_idx1": f"EI{i}"}
                                     for i in range(len(ebook or []))]
    if ebook is not None and not options.get("rules") and len(rbook) != len(ebook):
        return 0.0
    for r in rules:
        kind = r["type"]
        if kind == "sheet_name":
            ok = ebook is not None and [n for n, _ in rbook] == [n for n, _ in ebook]
        elif kind == "sheet_data":
            try:
                ok = _sheets_equal(_pick(r["sheet_idx0"], rbook, ebook), _pick(r["sheet_idx1"], rbook, ebook))
            except (IndexError, KeyError):
                ok = False
        elif kind == "check_cell":
            try:
                rows = _pick(r["sheet_idx"], rbook, ebook)
                row, col = _col_index(r["coordinate"])
                value = rows[row][col] if row < len(rows) and col < len(rows[row]) else None
            except (IndexError, KeyError):
                return 0.0
            props = r["props"]
            unsupported = set(props) - {"value"}
            if unsupported:
                raise ValueError(f"compare_table: unsupported check_cell props {sorted(unsupported)}")
            ok = _match_rule(value, props["value"])
        else:
            raise ValueError(f"compare_table: unsupported rule type {kind!r}")
        if not ok:
            return 0.0
    return 1.0


@metric
def infeasible(*_: Any, **__: Any) -> float:
    """Scored by the evaluator itself (1 when the agent's last action is FAIL)."""
    raise AssertionError("infeasible is decided by the evaluator, not called")
