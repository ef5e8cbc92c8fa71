"""Unit tests of what the explorer reads: trees of groups (where members diverge), the run
index (incremental reading, paging, filters), action marks, and the step log's observations
(thumbnails made once, text kept small)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from bunshin_gym.explore.marks import marks, web_marks
from bunshin_gym.explore.runs import Run, build_tree, discover
from bunshin_gym.rollout.steplog import INLINE_CHARS, StepLog, served_from


def write_group(log: StepLog, task: str, plans: list[list[str]], rewards: list[float],
                served: dict[tuple[int, int], str] | None = None) -> str:
    """A group in the step log as GroupVectorEnv writes it: member i plays plans[i]."""
    gid = log.group(task=task, members=len(plans), instruction=f"do {task}", obs={"output": ""})
    for m, plan in enumerate(plans):
        for d, action in enumerate(plan):
            last = d == len(plan) - 1
            log.step(gid, m, d, action=action, obs={"output": f"out of {action}"},
                     reward=rewards[m] if last else 0.0, terminated=last, truncated=False,
                     info={"cache": "hit"} if (served or {}).get((m, d)) == "cache" else {},
                     duration=0.1, think_s=0.01, signature=" ".join(action.split()), episode=f"e{m}")
        log.end(gid, m, reward=rewards[m], steps=len(plan), wall_s=1.0)
    return gid


def test_tree_branches_where_members_diverge(tmp_path):
    log = StepLog(tmp_path)
    plans = [["a", "b", "c"], ["a", "b", "d"], ["a", "x"], ["y"], ["a  ", "b", "c"]]  # m4 = m0 (blank)
    gid = write_group(log, "t", plans, [1.0, 0.0, 0.5, 0.0, 1.0],
                      served={(1, 0): "cache", (1, 1): "cache", (4, 0): "cache", (4, 1): "cache", (4, 2): "cache"})
    run = Run(tmp_path)
    t = build_tree(run.group(gid))
    root = t["root"]
    assert [c["action"] for c in root["children"]] == ["a", "y"]
    a = root["children"][0]
    assert a["members"] == [0, 1, 2, 4] and a["served"] == {"executed": 2, "cache": 2, "speculation": 0}
    assert [c["action"] for c in a["children"]] == ["b", "x"]
    b = a["children"][0]
    assert [c["action"] for c in b["children"]] == ["c", "d"]
    assert b["children"][0]["members"] == [0, 4] and b["children"][0]["steps"] == [[0, 2], [4, 2]]
    # nodes: a, b, c, d, x, y; divergences at the root, a and b
    assert t["nodes"] == 6
    assert sorted(t["divergences"]) == sorted(["root", a["id"], b["id"]])
    assert t["hits"] == 5
    assert root["rewards"] == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert b["children"][1]["ends"] == [{"member": 1, "reward": 0.0}]


def test_tree_of_members_that_all_agree_is_a_chain(tmp_path):
    log = StepLog(tmp_path)
    gid = write_group(log, "t", [["a", "b"]] * 3, [1.0] * 3)
    t = build_tree(Run(tmp_path).group(gid))
    assert t["nodes"] == 2 and t["divergences"] == []
    assert t["root"]["children"][0]["children"][0]["members"] == [0, 1, 2]


def test_run_reads_only_whole_appended_lines(tmp_path):
    log = StepLog(tmp_path)
    gid = write_group(log, "t", [["a"]], [1.0])
    run = Run(tmp_path)
    assert run.info()["steps"] == 1
    with open(log.path, "a") as f:  # a line still being written, then garbage, then its end
        f.write(json.dumps({"kind": "step", "group": gid, "member": 0, "depth": 1, "action": "b"})[:20])
    assert run.info()["steps"] == 1 and run.bad_lines == 0
    with open(log.path, "a") as f:
        f.write('"}\n{"kind": "step", "group": "nope", "member": 0, "depth": 0}\n')
    info = run.info()
    assert info["steps"] == 1 and info["bad_lines"] == 2  # the cut line and the unknown group


def test_paging_and_filters(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    log = StepLog(run_dir)
    ids = []
    for i in range(23):
        log.epoch = f"step {i // 10}"
        ids.append(write_group(log, "even" if i % 2 == 0 else "odd", [["a"], ["b"]], [i / 22, 0.0]))
    run = Run(run_dir)
    page = run.page(offset=20, limit=10)
    assert page["total"] == 23 and [g["group"] for g in page["items"]] == ids[20:]
    assert run.page(epoch="step 1")["total"] == 10
    assert {g["task"] for g in run.page(task="odd", limit=100)["items"]} == {"odd"}
    # reward filter: a group matches when one member's reward is in range
    high = run.page(min_reward=0.9, limit=100)
    assert [g["group"] for g in high["items"]] == [ids[i] for i in range(23) if i / 22 >= 0.9]
    assert run.page(max_reward=0.0)["total"] == 23  # every group has a member at 0
    with pytest.raises(ValueError, match="offset"):
        run.page(offset=-1)
    with pytest.raises(KeyError, match="no group"):
        run.group("missing")
    (tmp_path / "runs" / "not-a-run").mkdir()
    assert discover(run_dir) == [run_dir] and discover(tmp_path / "runs") == [run_dir]


def test_ten_thousand_steps_page_and_tree_fast(tmp_path):
    """A run of 10,000 steps: the first look (parse and index) and a page and a tree, fast."""
    log = StepLog(tmp_path)
    plans = [["ls /data", "wc -l f", "DONE"], ["ls /data", "cat f", "DONE"], ["pwd", "ls", "DONE"],
             ["ls /data", "wc -l f", "DONE"]]
    for i in range(834):  # 834 groups x 12 steps
        log.epoch = f"GRPO step {i // 12 + 1}"
        write_group(log, f"shell/task-{i % 12}", plans, [1.0, 0.0, 0.0, 1.0])
    assert sum(1 for line in open(log.path) if '"kind": "step"' in line) >= 10_000
    t0 = time.perf_counter()
    run = Run(tmp_path)
    info = run.info()
    page = run.page(offset=0, limit=50)
    tree = build_tree(run.group(page["items"][0]["group"]))
    elapsed = time.perf_counter() - t0
    assert info["steps"] == 10_008 and page["total"] == 834 and tree["nodes"] == 8
    assert elapsed < 2.0, f"opening a 10,000-step run took {elapsed:.2f} s"
    # step lines are indexed, not parsed, until their group is opened
    assert sum(g._parsed for g in run.groups.values()) == 12
    # later pages: the index, no re-reading
    read = run._offset
    t0 = time.perf_counter()
    later = run.page(offset=60, limit=50, task="shell/task-3", min_reward=1.0)
    assert time.perf_counter() - t0 < elapsed and run._offset == read == log.path.stat().st_size
    assert later["total"] == 70 and len(later["items"]) == 10


def test_marks_of_desktop_actions():
    assert marks("pyautogui.click(120, 40); pyautogui.write('hi')") == [
        {"kind": "click", "x": 120, "y": 40, "label": "click"}, {"kind": "type", "text": "hi", "label": "type"}]
    assert marks("import pyautogui\npyautogui.doubleClick(x=5, y=6)\npyautogui.hotkey('ctrl', 's')") == [
        {"kind": "click", "x": 5, "y": 6, "label": "double click"},
        {"kind": "key", "keys": ["ctrl", "s"], "label": "hotkey"}]
    assert marks("pyautogui.dragTo(10, 20)")[0]["kind"] == "drag"
    assert marks("x = 3\npyautogui.click(x, 2)") == []  # a computed point: nothing to draw
    assert marks(json.dumps({"action_type": "CLICK", "x": 300, "y": 200})) == [
        {"kind": "click", "x": 300, "y": 200, "label": "click"}]
    assert marks({"action_type": "TYPING", "text": "abc"}) == [{"kind": "type", "text": "abc", "label": "type"}]
    for none in ("ls -la /data", "click [12]", "pyautogui.click(", "", None, "{not json"):
        assert marks(none) == []


def test_marks_of_web_actions():
    tree = "[1] RootWebArea 'One Stop Market' focused: True\n\t[2] link 'My Account'\n\t[3] searchbox 'Search'"
    assert web_marks("click [2]", tree) == [{"kind": "element", "label": "click", "element": "2",
                                            "line": "link 'My Account'"}]
    assert web_marks("type [3] [wireless headphones] [1]", tree) == [
        {"kind": "element", "label": "type", "element": "3", "line": "searchbox 'Search'"},
        {"kind": "type", "text": "wireless headphones", "label": "type", "enter": True}]
    assert web_marks("fill('3', 'hi')", tree)[1] == {"kind": "type", "text": "hi", "label": "type", "enter": False}
    assert web_marks("click [9]", tree)[0]["line"] is None  # not on the page it was chosen from
    assert web_marks("click [link 'My Account']")[0]["element"] == "link 'My Account'"
    assert web_marks("scroll [down]") == [{"kind": "scroll", "direction": "down", "label": "scroll down"}]
    assert web_marks("press [ctrl+a]") == [{"kind": "key", "keys": ["ctrl", "a"], "label": "press"}]
    assert web_marks("goto [http://127.0.0.1:7770/]") == [
        {"kind": "page", "label": "goto http://127.0.0.1:7770/", "url": "http://127.0.0.1:7770/"}]
    assert web_marks("go_back") == [{"kind": "page", "label": "go back"}]
    assert web_marks("stop [40.99]") == [{"kind": "page", "label": "stop: 40.99"}]
    for none in ("ls -la /data", "pyautogui.click(1, 2)", "", None, "click [", {"action_type": "CLICK"}):
        assert web_marks(none) == []


def test_web_marks_place_an_element_at_its_recorded_box():
    """With the element's recorded box, the mark sits at the box's centre (where the click
    lands) when that lies on the screenshot; off it, or without a usable box, it names the
    element only."""
    tree = "[1] RootWebArea 'One Stop Market' focused: True\n\t[2] link 'My Account'"
    box = {"x": 1002.5, "y": 24.0, "width": 81.0, "height": 16.0}
    assert web_marks("click [2]", tree, box, [1280, 720]) == [
        {"kind": "element", "label": "click", "element": "2", "line": "link 'My Account'", "box": box,
         "x": 1043.0, "y": 32.0}]
    typed = web_marks("type [2] [hi] [0]", tree, box, [1280, 720])
    assert (typed[0]["x"], typed[0]["y"], typed[1]["kind"]) == (1043.0, 32.0, "type")
    below = web_marks("click [2]", tree, dict(box, y=1069.2), [1280, 720])[0]
    assert below["offscreen"] == "below" and "x" not in below and below["box"]["y"] == 1069.2
    assert web_marks("click [2]", tree, dict(box, y=-40), [1280, 720])[0]["offscreen"] == "above"
    assert web_marks("click [2]", tree, dict(box, x=1300), [1280, 720])[0]["offscreen"] == "right"
    no_shot = web_marks("click [2]", tree, box, None)[0]  # a run without screenshots
    assert no_shot["box"] == box and "x" not in no_shot and "offscreen" not in no_shot
    for bad in (None, {}, {"x": 1, "y": 2}, {"x": "a", "y": 1, "width": 2, "height": 3}, [1, 2, 3, 4],
                {"x": float("nan"), "y": 1, "width": 2, "height": 3}, {"x": 1, "y": 1, "width": -2, "height": 3}):
        assert web_marks("click [2]", tree, bad, [1280, 720]) == web_marks("click [2]", tree), bad


def test_step_log_observations_stay_small(tmp_path):
    log = StepLog(tmp_path)
    rng = np.random.default_rng(0)
    screen = rng.integers(0, 255, (600, 800, 3), dtype=np.uint8)
    tree = "window\n" + "  button 'OK'\n" * 500
    first = log.observation({"screenshot": screen, "accessibility_tree": tree, "terminal": "$ ", "instruction": "x"})
    again = log.observation({"screenshot": screen.copy(), "accessibility_tree": tree, "terminal": "$ "})
    assert first == again  # the same observation (a cache hit's): the same files, made once
    log.flush()  # images are written by a worker thread, which then ends
    assert not [t for t in threading.enumerate() if t.name == "step-log-media"]
    assert len(list((tmp_path / "media").iterdir())) == 3  # thumbnail, screenshot, full text
    assert first["size"] == [800, 600] and "instruction" not in first["text"]
    assert len(first["text"]["accessibility_tree"]) == INLINE_CHARS
    from PIL import Image

    thumb = Image.open(tmp_path / first["thumb"])
    assert max(thumb.size) == 320 and (tmp_path / first["thumb"]).stat().st_size < 40_000
    assert Image.open(tmp_path / first["shot"]).size == (800, 600)
    assert json.loads((tmp_path / first["full"]).read_text())["accessibility_tree"] == tree
    other = screen.copy()
    other[0, 0] = 255 - other[0, 0]
    changed = log.observation({"screenshot": other})
    log.flush()
    assert changed["thumb"] != first["thumb"] and (tmp_path / changed["thumb"]).is_file()
    # a shell observation: short text inline, no media
    assert log.observation({"output": "f1\n", "exit_code": np.int64(0)}) == {
        "text": {"output": "f1\n"}, "values": {"exit_code": 0}}
    assert served_from({"cache": "hit"}) == "cache"
    assert served_from({"cache": "miss", "speculation": "hit"}) == "speculation"
    assert served_from({"cache": "miss"}) == "executed"


def test_screenshots_go_to_pytests_temporary_folder(shots, tmp_path_factory):
    """A plain test run leaves bench/results/explore (committed) as it was."""
    from bunshin_gym import config

    if config.get("BUNSHIN_EXPLORE_SHOTS"):
        assert shots.is_dir()  # refreshing the committed screenshots on purpose
        return
    assert shots.is_relative_to(tmp_path_factory.getbasetemp()) and shots.is_dir()


def test_live_memory_survey_is_reused_while_fresh_and_retaken_for_a_new_workspace(monkeypatch):
    """The page's memory numbers (explore/live.current_survey), with a stand-in for the survey
    (the real one is tested on real clones in test_memory.py): a survey is reused for 4x what
    it took, but not once a workspace it did not see runs (past what it took)."""
    from bunshin_gym.explore import live, memory

    seen: set[str] = set()
    taken: list[memory.Survey] = []

    def survey() -> memory.Survey:
        taken.append(memory.Survey(seen=set(seen), taken=time.time(), seconds=0.25))
        return taken[-1]

    monkeypatch.setattr(live.memory, "survey", survey)
    monkeypatch.setattr(live, "_last_survey", None)
    monkeypatch.setattr(live, "SURVEY_TTL_S", 0.0)
    seen.add("ws-a")
    first = live.current_survey({"ws-a"})
    assert live.current_survey({"ws-a"}) is first and len(taken) == 1  # fresh for 4 x 0.25 s
    seen.add("ws-b")
    assert live.current_survey({"ws-a", "ws-b"}) is first  # missing ws-b, but only 0.25 s are waited
    time.sleep(0.3)
    second = live.current_survey({"ws-a", "ws-b"})
    assert second is not first and second.seen == {"ws-a", "ws-b"} and len(taken) == 2
    time.sleep(0.3)
    assert live.current_survey({"ws-a", "ws-b"}) is second  # complete: fresh for 1 s
    time.sleep(0.8)
    assert live.current_survey({"ws-a", "ws-b"}) is not second and len(taken) == 3
