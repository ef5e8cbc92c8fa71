"""Bunshin-WebArena-v0 without a workspace: action grammar, tree rendering, evaluators, task
loading, and the shop's database generator (deterministic)."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import sys
from pathlib import Path

import pytest

from bunshin_gym.core.task import TaskError
from bunshin_gym.envs.webarena import evaluators
from bunshin_gym.envs.webarena.actions import ActionSyntaxError, parse_action
from bunshin_gym.envs.webarena.observation import find_element, parse_aria, render_tree, tabs_line
from bunshin_gym.envs.webarena.tasks import TASKS_DIR, load_config, load_task, shipped_task_ids

REPO = Path(__file__).resolve().parents[2]
FORMATS = REPO.parent / "shared" / "formats" / "webarena"
SITES = {"__SHOPPING__": "http://127.0.0.1:7770"}


# actions ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expect", [
    ("click [12]", dict(kind="click", element="12")),
    ("hover [7]", dict(kind="hover", element="7")),
    ("type [164] [wireless headphones] [0]", dict(kind="type", element="164", text="wireless headphones",
                                                   enter=False)),
    ("type [164] [a [bracketed] text]", dict(kind="type", element="164", text="a [bracketed] text", enter=True)),
    ("press [Ctrl+Enter]", dict(kind="press", key="Ctrl+Enter")),
    ("scroll [down]", dict(kind="scroll", direction="down")),
    ("scroll up", dict(kind="scroll", direction="up")),
    ("new_tab", dict(kind="new_tab")),
    ("tab_focus [2]", dict(kind="tab_focus", index=2)),
    ("close_tab", dict(kind="close_tab")),
    ("goto [http://127.0.0.1:7770/contact]", dict(kind="goto", url="http://127.0.0.1:7770/contact")),
    ("go_back", dict(kind="go_back")),
    ("go_forward", dict(kind="go_forward")),
    ("stop [$12.99]", dict(kind="stop", answer="$12.99")),
    ("stop", dict(kind="stop", answer="")),
    ("click [link 'My Account']", dict(kind="click", element="link 'My Account'")),
])
def test_webarena_action_strings_parse(text, expect):
    action = parse_action(text)
    for key, value in expect.items():
        assert getattr(action, key) == value, (text, key)


@pytest.mark.parametrize("text", ["", "fly [3]", "click", "click []", "type [3]", "tab_focus [x]", "scroll [left]",
                                  "go_back [1]", "goto", 42])
def test_malformed_actions_raise_with_the_expected_form(text):
    with pytest.raises(ActionSyntaxError):
        parse_action(text)


# observation --------------------------------------------------------------------------
ARIA = """- generic [active] [ref=e1]:
  - navigation "Main" [ref=e2]:
    - link "My Account" [ref=e3] [cursor=pointer]:
      - /url: /customer/account/
  - 'heading "Price: $5" [level=1] [ref=e4]'
  - paragraph [ref=e5]: Some text
  - link [ref=e6] [cursor=pointer]:
    - img "Blue kettle" [ref=e7]
  - generic [ref=e8]:
    - text: Search
    - searchbox "Search" [ref=e9]: kettles
    - combobox [ref=e10]:
      - option "Name"
      - option "Price" [selected]
    - checkbox "news" [checked] [ref=e11]
    - button "Go" [disabled] [ref=e12]
  - listitem [ref=e13]: "- dash: quoted"
"""


def test_aria_snapshot_renders_in_webarena_format():
    tree, targets = render_tree(parse_aria(ARIA), "Shop")
    lines = tree.splitlines()
    assert lines[0] == "[1] RootWebArea 'Shop' focused: True"
    for line in lines[1:]:
        assert line.startswith("\t"), line
        head = line.strip()
        assert head.startswith(f"[{int(head[1:head.index(']')])}] ")
    text = "\n".join(line.strip().split("] ", 1)[1] for line in lines)
    for expected in ["navigation 'Main'", "link 'My Account'", "heading 'Price: $5'", "StaticText 'Some text'",
                     "link 'Blue kettle'", "img 'Blue kettle'", "StaticText 'Search'", "searchbox 'Search'",
                     "StaticText 'kettles'", "combobox ''", "option 'Price' selected: True",
                     "checkbox 'news' checked: True", "button 'Go' disabled: True", "StaticText '- dash: quoted'"]:
        assert expected in text.splitlines(), (expected, text)
    ids = [int(line.strip()[1:line.strip().index("]")]) for line in lines]
    assert ids == list(range(1, len(lines) + 1))  # numbered in tree order
    link = find_element(targets, tree, "link 'My Account'")
    assert targets[link].ref == "e3"
    static = find_element(targets, tree, "StaticText 'Some text'")
    assert targets[static].ref == "e5"  # a text line acts on its element
    option = find_element(targets, tree, "option 'Price'")
    assert targets[option].ref == "e10" and targets[option].option == "Price"
    with pytest.raises(KeyError, match="similar"):
        find_element(targets, tree, "link 'Account'")
    assert tabs_line([{"title": "A"}, {"title": "B"}], 1) == "Tab 0: A | Tab 1 (current): B"


def test_same_page_gives_the_same_ids():
    a = render_tree(parse_aria(ARIA), "Shop")
    b = render_tree(parse_aria(re.sub(r"\[ref=e(\d+)\]", r"[ref=f2e\1]", ARIA)), "Shop")
    assert b[1][2].ref == "f2e2"
    assert a[0] == b[0]


# evaluators ---------------------------------------------------------------------------
def test_string_match_follows_webarena():
    sm = evaluators.string_match
    assert sm({"must_include": ["Catso", "Dibbins"]}, "catso, DIBBINS and others") == 1.0
    assert sm({"must_include": ["Catso", "Dibbins"]}, "catso") == 0.0
    assert sm({"must_include": ["2"]}, "12 items") == 0.0  # a one-character reference is a token
    assert sm({"must_include": ["2"]}, "there are 2 items") == 1.0
    assert sm({"exact_match": "Complete"}, "'complete'") == 1.0
    assert sm({"exact_match": "Complete"}, "complete order") == 0.0


def test_fuzzy_match_is_a_documented_deterministic_rule():
    fm = evaluators.fuzzy_match
    assert fm("May 29, 2022", "It was placed on May 29 2022.") == 1.0
    assert fm("May 29, 2022", "5/29/22") == 0.0
    assert fm("$1,234.50", "the total was 1234.5 dollars") == 1.0
    assert fm("N/A", "N/A: no such order") == 1.0 and fm("N/A", "12") == 0.0
    assert evaluators.string_match({"fuzzy_match": ["red", "blue"]}, "red and blue") == 1.0


def test_url_match_is_gold_in_pred():
    um = evaluators.url_match
    ref = "http://h:1/catalogsearch/result/?q=french+press&product_list_order=price_asc"
    assert um(ref, "http://h:1/catalogsearch/result/?product_list_order=price_asc&q=french+press&p=2") == 1.0
    assert um(ref, "http://h:1/catalogsearch/result/?q=french+press") == 0.0
    assert um("http://h:1/a |OR| http://h:1/b/", "http://h:1/b") == 1.0
    assert um("http://h:1/wishlist/", "http://h:1/customer/account/login/?referer=/wishlist/") == 0.0


class FakePage:
    def __init__(self, url: str, values: dict):
        self.url, self.values, self.calls = url, values, []

    def current_url(self) -> str:
        return self.url

    def evaluate(self, js, url=None) -> str:
        self.calls.append((js, url))
        if js and "boom" in js:
            raise RuntimeError("TypeError: null")
        return self.values.get((js, url), "")


def test_program_html_reads_pages_and_locators():
    page = FakePage("http://h/cart", {
        (None, None): "<p>Blue &amp; Kettle</p>", ("document.querySelector('#q').value", "http://h/x"): "3",
        (None, "http://h/order/9"): "Express Shipping"})
    resolve = lambda u: u.replace("__SHOPPING__", "http://h")  # noqa: E731
    ph = evaluators.program_html
    assert ph([{"url": "last", "locator": "", "required_contents": {"must_include": ["blue & kettle"]}}],
              page, resolve) == 1.0
    assert ph([{"url": "__SHOPPING__/x", "locator": "document.querySelector('#q').value",
                "required_contents": {"exact_match": "3"}}], page, resolve) == 1.0
    assert ph([{"url": "last", "locator": "document.boom", "required_contents": {"exact_match": "3"}}],
              page, resolve) == 0.0
    assert ph([{"url": "func:shopping_get_latest_order_url()", "locator": "",
                "required_contents": {"must_include": ["Flat Rate |OR| Express Shipping"]}}], page, resolve,
              {"shopping_get_latest_order_url": lambda: "http://h/order/9"}) == 1.0
    with pytest.raises(TaskError):
        ph([{"url": "func:unknown()", "locator": "", "required_contents": {"must_include": ["x"]}}], page, resolve)


# tasks --------------------------------------------------------------------------------
def test_shipped_tasks_are_webarena_configs_with_oracles():
    ids = shipped_task_ids()
    assert len(ids) >= 30
    kinds = set()
    for tid in ids:
        task = load_task(tid, SITES)
        cfg = task.config
        assert cfg["sites"] == ["shopping"] and cfg["intent"] == task.instruction
        kinds.update(cfg["eval"]["eval_types"])
        oracle = task.oracle()
        assert oracle and oracle[-1].startswith("stop") and all("__SHOPPING__" not in a for a in oracle)
        for action in oracle:
            parse_action(action)
        assert cfg["eval"].get("reference_answers") != {"must_include": ["N/A"]}  # none is infeasible
    assert kinds == {"string_match", "url_match", "program_html"}
    assert len(list(TASKS_DIR.glob("*.json"))) == len(ids)


@pytest.mark.skipif(not FORMATS.exists(), reason="shared/formats is not beside the repo")
def test_real_webarena_configs_load_as_they_are():
    for path in sorted(FORMATS.glob("*.json")):
        task = load_task(str(path), SITES)
        assert task.id == f"webarena/{json.loads(path.read_text())['task_id']}"
        assert all(u.startswith("http://127.0.0.1:7770") for u in task.start_urls())
        assert task.require_login


def test_unknown_tasks_and_sites_are_explained():
    with pytest.raises(TaskError, match="shipped ids"):
        load_config("webarena/999999")
    cfg = dict(load_config("webarena/1001"), sites=["gitlab"])
    with pytest.raises(TaskError, match="__GITLAB__"):
        load_task(cfg, SITES)


# the shop's data ----------------------------------------------------------------------
def test_catalog_is_deterministic_and_large_enough(tmp_path):
    sys.path.insert(0, str(REPO / "envs" / "webarena" / "shop"))
    try:
        import catalog
    finally:
        sys.path.pop(0)
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    catalog.generate(str(a))
    catalog.generate(str(b))
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    db = sqlite3.connect(a)
    products, reviewed, categories = db.execute(
        "SELECT count(*), count(DISTINCT r.product_id), (SELECT count(*) FROM categories) FROM products p "
        "LEFT JOIN reviews r ON r.product_id = p.id").fetchone()
    assert products >= 2000 and categories >= 12
    assert db.execute("SELECT count(DISTINCT nickname) FROM reviews").fetchone()[0] > 500
    assert db.execute("SELECT count(*) FROM orders WHERE customer_id = 1").fetchone()[0] >= 20
