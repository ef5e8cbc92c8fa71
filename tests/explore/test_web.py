"""WebArena actions drawn on the page's screenshots: a real web group (G=2, the shop of
webarena/1001, screenshots on) recorded by the rollout engine, opened in the explorer in a real
browser. A click is drawn where its element was, from the box the web env recorded before the
action ran, on the screenshot the action was chosen on; a run without boxes names the element
by its tree line instead; a scroll, a goto and the answer are written on the screenshot."""

from __future__ import annotations

import json
import re

import gymnasium as gym
import pytest

from bunshin_gym.rollout import StepLog

from .conftest import copy_run

START = "http://127.0.0.1:7770/"
ACCOUNT = "[...document.querySelectorAll('a')].find(a => a.textContent.trim() === 'My Account')"


def _id_of(tree: str, line: str) -> str:
    m = re.search(r"\[(\d+)\] " + re.escape(line) + "$", tree, re.M)
    assert m, f"{line!r} not in the tree"
    return m[1]


@pytest.fixture(scope="module")
def web_run(tmp_path_factory):
    """m0: click 'My Account' (by its id on the page), scroll, go back to the start by URL,
    answer; m1: answer at once. Also returns the DOM's own box of 'My Account', read from m0's
    page when it chose the click."""
    run_dir = tmp_path_factory.mktemp("runs") / "web-run"
    steps = StepLog(run_dir)
    envs = gym.make_vec("Bunshin-WebArena-v0", num_envs=2, vectorization_mode="vector_entry_point",
                        step_log=steps, screenshot=True, memory_mode="copy")
    dom: dict = {}

    def policy(member: int, obs: dict, hist: list) -> str:
        if member == 1:
            return "stop [N/A]"
        if not hist:
            page = envs.members[0].unwrapped.page
            dom.update(json.loads(page.evaluate(f"JSON.stringify({ACCOUNT}.getBoundingClientRect())")))
        account = "link 'My Account'"
        plan = [lambda: f"click [{_id_of(obs['accessibility_tree'], account)}]",
                lambda: "scroll [down]", lambda: f"goto [{START}]", lambda: "stop [N/A]"]
        return plan[len(hist)]()

    try:
        trajs = envs.run_group(policy, options={"task": "webarena/1001"})
        steps.flush()
    finally:
        envs.close()
    return run_dir, trajs, dom


def _wait_image(page, sel: str) -> None:
    page.wait_for_function(f"document.querySelector('{sel}')?.complete && "
                           f"document.querySelector('{sel}').naturalWidth > 0")


def test_a_click_is_drawn_where_its_element_was(web_run, explorer, page, shots):
    run_dir, trajs, dom = web_run
    assert [len(t.steps) for t in trajs] == [4, 1] and all(t.error is None for t in trajs), trajs
    clicked = trajs[0].steps[0].action
    box = trajs[0].steps[0].info["element_box"]
    assert all(abs(box[k] - dom[k]) <= 0.01 for k in ("x", "y", "width", "height")), (box, dom)
    srv = explorer(run=run_dir)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")

    page.locator("#tree .node", has_text=clicked).click()
    _wait_image(page, "#step-before-shot")
    _wait_image(page, "#step-shot")
    assert page.locator("#step-before-shot").evaluate("i => i.naturalWidth") == 1280
    # the marker: at the box's centre, drawn on the start page (where the link was)
    point = page.locator("#step-before-marks circle.mark-point")
    cx, cy = float(point.get_attribute("cx")), float(point.get_attribute("cy"))
    assert (cx, cy) == pytest.approx((dom["x"] + dom["width"] / 2, dom["y"] + dom["height"] / 2), abs=0.1)
    rect = page.locator("#step-before-marks rect.mark-box")
    assert [float(rect.get_attribute(k)) for k in ("x", "y", "width", "height")] == pytest.approx(
        [dom["x"], dom["y"], dom["width"], dom["height"]], abs=0.1)
    assert page.locator("#step-before-marks text.mark-element-at").text_content() == f"{clicked} link 'My Account'"
    # where the marker shows on the explorer's page, in the screenshot's pixels: inside the link
    x, y = page.evaluate("""() => {
        const img = document.querySelector('#step-before-shot').getBoundingClientRect();
        const c = document.querySelector('#step-before-marks circle.mark-point').getBoundingClientRect();
        return [(c.x + c.width / 2 - img.x) * 1280 / img.width, (c.y + c.height / 2 - img.y) * 720 / img.height];
    }""")
    assert dom["x"] <= x <= dom["x"] + dom["width"] and dom["y"] <= y <= dom["y"] + dom["height"], (x, y, dom)
    # the result (the account page) is shown too, with no point of the start page's on it
    assert page.locator("#step-marks circle").count() == 0
    assert page.locator("#step pre.obs-url").inner_text().strip().endswith("/customer/account/")
    page.screenshot(path=shots / "web-step-click.png", full_page=True)

    page.locator("#tree .node", has_text="scroll [down]").click()
    page.wait_for_selector("#step-marks text.mark-scroll")
    assert page.locator("#step-marks text.mark-scroll").text_content() == "scroll down ↓"
    assert page.locator("#step-before-shot").count() == 0  # nothing placed: the result only
    page.locator("#tree .node", has_text="goto").click()
    page.wait_for_selector("#step-marks text.mark-page")
    assert page.locator("#step-marks text.mark-page").text_content() == f"goto {START}"
    assert page.locator("#step pre.obs-url").inner_text().strip() == START
    page.screenshot(path=shots / "web-step-goto.png", full_page=True)


def test_a_click_without_a_recorded_box_names_its_element(web_run, explorer, page, tmp_path):
    """A step line without ``element_box`` (a run recorded before the env kept boxes): the
    click is written as its element's tree line on the result's screenshot, not placed."""
    run_dir, trajs, _ = web_run
    old = copy_run(run_dir, tmp_path / "web-run-without-boxes")
    records = [json.loads(line) for line in open(old / "steps.jsonl")]
    assert sum("element_box" in r for r in records) == 1  # the click; scroll, goto and stop have none
    (old / "steps.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "element_box"}) + "\n"
                                             for r in records))
    clicked = trajs[0].steps[0].action
    srv = explorer(run=old)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")
    page.locator("#tree .node", has_text=clicked).click()
    page.wait_for_selector("#step-marks text.mark-element")
    assert page.locator("#step-marks text.mark-element").text_content() == f"{clicked} link 'My Account'"
    assert page.locator("#step-before-shot").count() == 0 and page.locator("#step-marks circle").count() == 0
