"""BrowserGym compatibility of the web env: BrowserGym's high-level action strings parse to the
env's actions (beside WebArena's), and a BrowserGym-style agent loop, reading the tree with
BrowserGym's own flatten_axtree_to_str, solves a shop task under browsergym/bunshin.shop.<n>."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
from browsergym.utils.obs import flatten_axtree_to_str

import bunshin_gym.compat.browsergym as bgc
from bunshin_gym.envs.webarena.actions import Action, ActionSyntaxError, parse_action
from bunshin_gym.envs.webarena.observation import axtree_object


@pytest.mark.parametrize("text, expected", [
    ("click('a51')", Action("click", element="a51")),
    ("fill('b12', 'wireless headphones')", Action("type", element="b12", text="wireless headphones")),
    ("fill(bid='7', value=\"it's\")", Action("type", element="7", text="it's")),
    ("clear('7')", Action("type", element="7", text="")),
    ("press('7', 'Enter')", Action("press", element="7", key="Enter")),
    ("keyboard_press('Control+a')", Action("press", key="Control+a")),
    ("select_option('9', 'Express')", Action("select", element="9", option="Express")),
    ("select_option('9', ['Express'])", Action("select", element="9", option="Express")),
    ("scroll(0, 200)", Action("scroll", direction="down")),
    ("scroll(0, -200.5)", Action("scroll", direction="up")),
    ("goto('http://127.0.0.1:7770/')", Action("goto", url="http://127.0.0.1:7770/")),
    ("go_back()", Action("go_back")), ("new_tab()", Action("new_tab")), ("tab_close()", Action("close_tab")),
    ("tab_focus(1)", Action("tab_focus", index=1)),
    ("noop()", Action("noop", wait_s=1.0)), ("noop(250)", Action("noop", wait_s=0.25)),
    ("send_msg_to_user('$40.99')", Action("stop", answer="$40.99")),
    ("report_infeasible('no such product')", Action("stop", answer="N/A")),
])
def test_browsergym_actions_parse_to_the_env_actions(text, expected):
    act = parse_action(text)
    expected.raw = text
    assert act == expected


@pytest.mark.parametrize("text, fragment", [
    ("click(", "malformed"), ("dblclick('1')", "unsupported"), ("click('1', 'right')", "left button"),
    ("click(bid)", "literals"), ("fill('1')", "missing 'value'"), ("click('1', foo=2)", "no argument 'foo'"),
    ("scroll(100, 0)", "vertical"), ("noop(1e9)", "milliseconds"), ("tab_focus(-1)", "tab number"),
    ("click('1'); goto('x')", "malformed"), ("__import__('os')", "unknown"),
])
def test_bad_browsergym_actions_are_clear_errors(text, fragment):
    with pytest.raises(ActionSyntaxError, match=re.escape(fragment)):
        parse_action(text)


def test_webarena_actions_still_parse():
    assert parse_action("click [12]") == Action("click", element="12", raw="click [12]")
    assert parse_action("go_back").kind == "go_back"


def test_axtree_object_flattens_back_with_browsergyms_helper():
    tree = ("[1] RootWebArea 'One Stop Market' focused: True\n\t[2] link 'My Account'\n"
            "\t[3] searchbox 'Search' required: True\n\t\t[4] StaticText \"it's 'quoted'\"\n\t[5] button 'Go'")
    ax = axtree_object(tree)
    assert [n["browsergym_id"] for n in ax["nodes"]] == ["1", "2", "3", "4", "5"]
    assert ax["nodes"][0]["childIds"] == ["2", "3", "5"] and ax["nodes"][3]["parentId"] == "3"
    flat = flatten_axtree_to_str(ax)
    assert flat.splitlines() == ["[1] RootWebArea 'One Stop Market', focused", "\t[2] link 'My Account'",
                                 "\t[3] searchbox 'Search', required", "\t\t[4] StaticText \"it's 'quoted'\"",
                                 "\t[5] button 'Go'"]


def bid(obs: dict, role: str, name: str) -> str:
    """What a BrowserGym agent does: find the element's bid in the flattened tree."""
    flat = flatten_axtree_to_str(obs["axtree_object"])
    m = re.search(rf"\[(\w+)\] {role} {re.escape(repr(name))}", flat)
    assert m, f"no {role} {name!r} in:\n{flat[:2000]}"
    return m.group(1)


def test_a_browsergym_agent_loop_solves_a_shop_task():
    assert "browsergym/bunshin.shop.1001" in bgc.IDS
    env = gym.make("browsergym/bunshin.shop.1001")
    try:
        obs, info = env.reset()
        assert info["task_id"] == "webarena/1001"
        assert {"chat_messages", "goal", "goal_object", "open_pages_urls", "open_pages_titles", "active_page_index",
                "url", "screenshot", "dom_object", "axtree_object", "extra_element_properties",
                "focused_element_bid", "last_action", "last_action_error", "elapsed_time"} <= set(obs)
        assert obs["goal_object"] == [{"type": "text", "text": obs["goal"]}] and "Voltix" in obs["goal"]
        assert obs["chat_messages"][-1] == {**obs["chat_messages"][-1], "role": "user", "message": obs["goal"]}
        assert obs["open_pages_urls"] == (obs["url"],) and obs["active_page_index"].tolist() == [0]
        assert isinstance(obs["screenshot"], np.ndarray) and obs["screenshot"].ndim == 3
        box = bid(obs, "searchbox", "Search")
        obs, *_ = env.step(f"fill('{box}', 'Voltix Pro Wireless Over-Ear Headphones')")
        assert obs["last_action_error"] == "" and obs["last_action"].startswith("fill(")
        obs, *_ = env.step(f"press('{bid(obs, 'searchbox', 'Search')}', 'Enter')")
        assert "q=Voltix" in obs["url"] or "Voltix" in obs["url"], obs["url"]
        obs, reward, terminated, *_ = env.step("click('99999')")  # a bid that is not there
        assert "99999" in obs["last_action_error"] and not terminated and reward == 0.0
        obs, *_ = env.step("noop(10)")
        assert obs["last_action_error"] == ""
        obs, *_ = env.step(f"click('{bid(obs, 'link', 'Voltix Pro Wireless Over-Ear Headphones, Set of 3, Black')}')")
        obs, reward, terminated, truncated, info = env.step("send_msg_to_user('It costs $40.99')")
        assert terminated and reward == 1.0
        assert obs["chat_messages"][-1]["message"] == "It costs $40.99"
    finally:
        env.close()
