"""Bunshin-WebArena-v0 on real workspaces (image ``webarena``): every shipped task's oracle scores 1
and ``stop [N/A]`` scores 0 (a fast subset by default, all under ``slow``), observations and
errors, tabs, and the fork: clones keep the page and the signed-in session, carts and orders
of clones diverge, rollback restores the database and the page."""

from __future__ import annotations

import json
import re

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core.wrappers import fork_api
from bunshin_gym.envs.webarena.tasks import shipped_task_ids

FAST = ["webarena/1001", "webarena/1019", "webarena/1025", "webarena/1035", "webarena/1037"]
SLOW = [t for t in shipped_task_ids() if t not in FAST]
LINE = re.compile(r"^\t*\[\d+\] \S+ (['\"]).*\1( [a-zA-Z]+: \S+)*$")
DB = "/var/lib/shop/shop.db"


@pytest.fixture(scope="module")
def env():
    # copy mode: the fastest snapshots of restored workspaces; the share mode is covered below
    e = gym.make("Bunshin-WebArena-v0", memory_mode="copy", reset_snapshot=False)
    yield e
    e.close()


def run_oracle(env, task_id: str) -> float:
    env.reset(options={"task": task_id})
    reward, terminated = 0.0, False
    for action in env.unwrapped.task.oracle():
        assert not terminated, f"{task_id}: the episode ended before {action!r}"
        obs, reward, terminated, truncated, info = env.step(action)
        assert "error" not in info and obs["last_action_error"] == "", (task_id, action, info)
    assert terminated
    return reward


def give_up(env, task_id: str) -> float:
    env.reset(options={"task": task_id})
    _, reward, terminated, _, info = env.step("stop [N/A]")
    assert terminated and info["answer"] == "N/A"
    return reward


@pytest.mark.parametrize("task_id", FAST)
def test_oracle_scores_one_and_giving_up_scores_zero(env, task_id):
    assert run_oracle(env, task_id) == 1.0
    assert give_up(env, task_id) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("task_id", SLOW)
def test_every_shipped_task_oracle_scores_one_and_giving_up_scores_zero(env, task_id):
    assert run_oracle(env, task_id) == 1.0
    assert give_up(env, task_id) == 0.0


def test_observation_is_webarena_tree_url_and_tabs(env):
    obs, info = env.reset(options={"task": "webarena/1001"})
    assert obs["url"] == "http://127.0.0.1:7770/" and obs["tabs"] == "Tab 0 (current): One Stop Market"
    assert obs["instruction"] == info["instruction"] and obs["last_action_error"] == ""
    lines = obs["accessibility_tree"].splitlines()
    assert lines[0].startswith("[1] RootWebArea 'One Stop Market'")
    assert all(LINE.match(line) for line in lines), [ln for ln in lines if not LINE.match(ln)][:5]
    assert "StaticText 'Welcome, Emma Lopez!'" in obs["accessibility_tree"]  # require_login: signed in
    u = env.unwrapped
    u.screenshot = True
    try:
        shot = u.observe()["screenshot"]
    finally:
        u.screenshot = False
    assert shot.shape == (720, 1280, 3) and shot.dtype.name == "uint8" and shot.std() > 0
    account = next(ln for ln in lines if ln.strip().endswith("link 'My Account'"))
    obs, *_ = env.step(f"click [{account.strip()[1:account.strip().index(']')]}]")
    assert obs["url"].endswith("/customer/account/") and "heading 'My Account'" in obs["accessibility_tree"]


def _rect(env, element_js: str) -> dict:
    """The DOM's own box of an element (a JS expression), in viewport CSS pixels."""
    return json.loads(env.unwrapped.page.evaluate(f"JSON.stringify(({element_js}).getBoundingClientRect())"))


def _same_box(recorded: dict, rect: dict) -> bool:
    return all(abs(recorded[k] - rect[k]) <= 0.01 for k in ("x", "y", "width", "height"))  # kept to 0.01 px


def test_element_actions_record_where_their_element_was_before_they_ran(env):
    """info["element_box"] of an action on an element is the element's DOM box on the page the
    action was chosen on (taken before it ran: a click that leaves the page, or that first
    scrolls its element into view, still gives the box the previous observation showed), in the
    pixels of the screenshot (the viewport's); failed actions keep it, others have none, and
    the observation does not change."""
    obs, _ = env.reset(options={"task": "webarena/1001"})
    keys = set(obs)
    account = "[...document.querySelectorAll('a')].find(a => a.textContent.trim() === 'My Account')"
    rect = _rect(env, account)
    assert rect["width"] > 0 and 0 <= rect["y"] < 720
    # where a click at the box's centre lands is the link itself
    assert env.unwrapped.page.evaluate(f"document.elementFromPoint({rect['x'] + rect['width'] / 2}, "
                                       f"{rect['y'] + rect['height'] / 2}).closest('a') === {account}") == "true"
    _, _, _, _, info = env.step("select_option('4', 'x')")  # id 4 is that link: no <select>, fails
    assert "not a <select>" in info["error"] and _same_box(info["element_box"], rect), info
    obs, _, _, _, info = env.step("click [link 'My Account']")
    assert obs["url"].endswith("/customer/account/") and _same_box(info["element_box"], rect), info
    assert set(obs) == keys and "element_box" not in str(obs)

    env.step("go_back")
    search = _rect(env, "document.querySelector('#search')")
    _, _, _, _, info = env.step("type [searchbox 'Search'] [headphones] [0]")
    assert _same_box(info["element_box"], search), (info, search)
    button = _rect(env, "document.querySelector('form.search button')")
    _, _, _, _, info = env.step("hover [button 'Search']")
    assert _same_box(info["element_box"], button), (info, button)

    # below the fold: the box lies below the screenshot; the click scrolled it into view
    footer = "[...document.querySelectorAll('a')].find(a => a.textContent.trim() === 'Contact Us')"
    rect = _rect(env, footer)
    assert rect["y"] > 720
    obs, _, _, _, info = env.step("click [link 'Contact Us']")
    assert obs["url"].endswith("/contact/") and _same_box(info["element_box"], rect), info
    # after a scroll: the box is where the element is in the scrolled viewport
    env.step("go_back")
    _, _, _, _, info = env.step("scroll [down]")
    assert "element_box" not in info
    rect = _rect(env, footer)
    assert 0 <= rect["y"] < 720
    _, _, _, _, info = env.step("click [link 'Contact Us']")
    assert _same_box(info["element_box"], rect), (info, rect)
    for action in ("goto [__SHOPPING__/]", "click [99999]", "stop [N/A]"):
        _, _, _, _, info = env.step(action)
        assert "element_box" not in info, (action, info)


def test_bad_actions_leave_an_error_and_the_episode_goes_on(env):
    env.reset(options={"task": "webarena/1001"})
    for action, why in [("fly [3]", "unknown action"), ("click [99999]", "no element with id"),
                        ("type [3]", "expected: type"), ("tab_focus [5]", "no tab 5"),
                        ("click [link 'No Such Link']", "no element link"), ("goto [http://127.0.0.1:1/]", "goto")]:
        obs, reward, terminated, truncated, info = env.step(action)
        assert why in info["error"] and obs["last_action_error"] == info["error"], (action, info)
        assert not terminated and reward == 0.0
    obs, *_ = env.step("goto [__SHOPPING__/contact/]")
    assert obs["last_action_error"] == "" and obs["url"].endswith("/contact/")


def test_tabs_history_and_keys(env):
    env.reset(options={"task": "webarena/1001"})
    env.step("click [link 'Electronics']")
    env.step("click [link 'Headphones']")
    obs, *_ = env.step("go_back")
    assert obs["url"].endswith("/electronics.html")
    obs, *_ = env.step("go_forward")
    assert obs["url"].endswith("/electronics/headphones.html")
    obs, *_ = env.step("new_tab")
    assert obs["tabs"].endswith("Tab 1 (current): ") and obs["url"] == "about:blank"
    obs, *_ = env.step("goto [__SHOPPING__/contact/]")
    assert obs["tabs"] == "Tab 0: Headphones | Tab 1 (current): Contact Us"
    obs, *_ = env.step("tab_focus [0]")
    assert obs["url"].endswith("/electronics/headphones.html")
    obs, *_ = env.step("close_tab")
    assert obs["tabs"] == "Tab 0 (current): Contact Us"
    env.step("type [textbox 'What’s on your mind?'] [hello] [0]")
    obs, *_ = env.step("press [Control+a]")
    assert obs["last_action_error"] == ""
    obs, *_ = env.step("scroll [down]")
    assert obs["last_action_error"] == ""


def _cart(e) -> str:
    return next(ln.strip() for ln in e.observe()["accessibility_tree"].splitlines() if "link 'My Cart (" in ln)


def _db(e, sql: str) -> str:
    return e.unwrapped.workspace.exec(["sqlite3", DB, sql], check=True).text.strip()


def test_browser_runs_one_chromium_process_without_zygotes_gpu_or_network_processes(env, check_chromium_processes):
    env.reset(options={"task": "webarena/1001"})
    check_chromium_processes(env.unwrapped.workspace)


def test_clone_mid_episode_keeps_page_history_and_session():
    env = gym.make("Bunshin-WebArena-v0")  # the default memory mode ("share")
    clones = []
    try:
        env.reset(options={"task": "webarena/1001"})
        env.step("click [link 'Electronics']")
        obs, *_ = env.step("click [link 'My Account']")
        clones = fork_api(env).clone(2)
        for c in clones:
            o = c.observe()
            assert o["url"] == obs["url"] and o["accessibility_tree"] == obs["accessibility_tree"]
            assert "Welcome, Emma Lopez!" in o["accessibility_tree"]
            assert c.steps == 2
            o, *_ = c.step("go_back")  # the page's history came along
            assert o["url"].endswith("/electronics.html")
            o, *_ = c.step("goto [__SHOPPING__/sales/order/history/]")  # so did the session cookie
            assert o["url"].endswith("/sales/order/history/") and "000000311" in o["accessibility_tree"]
        assert env.observe()["url"] == obs["url"]
    finally:
        for c in clones:
            c.close()
        env.close()


def test_a_fork_of_the_reset_clicks_the_ids_of_the_reset_observation_as_its_source_does():
    """A lazy clone made right after reset forks the reset snapshot: it must hold what the
    reset's observation did to the page (the accessibility snapshot numbers its elements,
    and an action names them by those numbers), as must a rollback to the reset. Taken before
    the observation, the fork's click found no element: no ``element_box``, another page."""
    env = gym.make("Bunshin-WebArena-v0")
    twin = None
    try:
        obs, _ = env.reset(options={"task": "webarena/1001"})
        element = re.search(r"\[(\d+)\] link 'My Account'", obs["accessibility_tree"])[1]
        (twin,) = env.unwrapped.clone(1, lazy=True)
        mine = env.step(f"click [{element}]")
        theirs = twin.step(f"click [{element}]")
        for o, _, _, _, info in (mine, theirs):
            assert o["url"].endswith("/customer/account/") and "error" not in info and info.get("element_box"), info
        assert theirs[0]["accessibility_tree"] == mine[0]["accessibility_tree"]
        assert theirs[4]["element_box"] == mine[4]["element_box"]
        env.unwrapped.rollback()
        o, _, _, _, info = env.step(f"click [{element}]")
        assert o["url"].endswith("/customer/account/") and info["element_box"] == mine[4]["element_box"], info
    finally:
        if twin is not None:
            twin.close()
        env.close()


def test_carts_and_orders_of_clones_diverge(env):
    env.reset(options={"task": "webarena/1030"})
    source_orders = _db(env, "SELECT count(*) FROM orders")
    a, b = fork_api(env).clone(2)
    try:
        for action in env.unwrapped.task.oracle()[:-1]:  # a buys (3 items, express)
            assert "error" not in a.step(action)[4]
        b.step("goto [__SHOPPING__/electronics/headphones.html]")
        b.step("click [button 'Add to Cart' #2]")
        assert _cart(b) == _cart(env).replace("(2 items)", "(3 items)")
        assert _cart(a).endswith("'My Cart (0 items)'")
        assert int(_db(a, "SELECT count(*) FROM orders")) == int(source_orders) + 1
        assert _db(b, "SELECT count(*) FROM orders") == source_orders == _db(env, "SELECT count(*) FROM orders")
        assert _db(b, "SELECT count(*) FROM cart_items WHERE owner = 'customer:1'") == "3"
        assert _db(env, "SELECT count(*) FROM cart_items WHERE owner = 'customer:1'") == "2"
        _, reward, *_ = a.step("stop []")
        assert reward == 1.0
        _, reward, *_ = b.step("stop []")
        assert reward == 0.0
    finally:
        a.close()
        b.close()


def test_rollback_restores_the_database_and_the_page():
    env = gym.make("Bunshin-WebArena-v0", memory_mode="copy")
    try:
        obs0, _ = env.reset(options={"task": "webarena/1026"})
        before = _db(env, "SELECT count(*) FROM cart_items")
        for action in env.unwrapped.task.oracle()[:-1]:
            env.step(action)
        env.step("goto [__SHOPPING__/checkout/cart/]")
        assert _db(env, "SELECT count(*) FROM cart_items") != before
        obs = env.rollback()
        assert obs["url"] == obs0["url"] and obs["accessibility_tree"] == obs0["accessibility_tree"]
        assert _db(env, "SELECT count(*) FROM cart_items") == before and env.unwrapped.steps == 0
        obs, *_ = env.step("go_back")  # the history is the snapshot's: the blank page the task opened
        assert obs["url"] == "about:blank"
        obs, *_ = env.step("go_forward")
        assert obs["url"] == obs0["url"]
    finally:
        env.close()
