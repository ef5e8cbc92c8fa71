"""WebArena actions drawn on the page's screenshots: a real web group (G=2, the shop of
webarena/1001, screenshots on) recorded by the rollout engine, opened in the explorer in a real
browser. A click names its element by the line of the tree it was chosen from; a scroll, a
goto and the answer are written on the screenshot."""

from __future__ import annotations

import re

import gymnasium as gym
import pytest

from bunshin_gym.rollout import StepLog

START = "http://127.0.0.1:7770/"


def _id_of(tree: str, line: str) -> str:
    m = re.search(r"\[(\d+)\] " + re.escape(line) + "$", tree, re.M)
    assert m, f"{line!r} not in the tree"
    return m[1]


def policy(member: int, obs: dict, hist: list) -> str:
    """m0: click 'My Account' (by its id on the page), scroll, go back to the start by URL,
    answer; m1: answer at once."""
    account = "link 'My Account'"
    plan = [lambda: f"click [{_id_of(obs['accessibility_tree'], account)}]",
            lambda: "scroll [down]", lambda: f"goto [{START}]", lambda: "stop [N/A]"]
    return plan[len(hist)]() if member == 0 else "stop [N/A]"


@pytest.fixture(scope="module")
def web_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "web-run"
    steps = StepLog(run_dir)
    envs = gym.make_vec("Bunshin-WebArena-v0", num_envs=2, vectorization_mode="vector_entry_point",
                        step_log=steps, screenshot=True, memory_mode="copy")
    try:
        trajs = envs.run_group(policy, options={"task": "webarena/1001"})
        steps.flush()
    finally:
        envs.close()
    return run_dir, trajs


def test_web_actions_are_drawn_on_the_screenshot(web_run, explorer, page, shots):
    run_dir, trajs = web_run
    assert [len(t.steps) for t in trajs] == [4, 1] and all(t.error is None for t in trajs), trajs
    clicked = trajs[0].steps[0].action
    srv = explorer(run=run_dir)
    page.goto(srv.url + "/")
    page.wait_for_selector("#tree .node[data-node=n1]")

    page.locator("#tree .node", has_text=clicked).click()
    page.wait_for_function("document.querySelector('#step-shot')?.complete && "
                           "document.querySelector('#step-shot').naturalWidth > 0")
    assert page.locator("#step-shot").evaluate("i => i.naturalWidth") == 1280
    element = page.locator("#step-marks text.mark-element")
    assert element.text_content() == f"{clicked} link 'My Account'"
    page.screenshot(path=shots / "web-step-click.png", full_page=True)

    page.locator("#tree .node", has_text="scroll [down]").click()
    page.wait_for_selector("#step-marks text.mark-scroll")
    assert page.locator("#step-marks text.mark-scroll").text_content() == "scroll down ↓"
    page.locator("#tree .node", has_text="goto").click()
    page.wait_for_selector("#step-marks text.mark-page")
    assert page.locator("#step-marks text.mark-page").text_content() == f"goto {START}"
    assert page.locator("#step pre.obs-url").inner_text().strip() == START
    page.screenshot(path=shots / "web-step-goto.png", full_page=True)
