"""Bunshin-OSWorld-v0 without a workspace: task files, loader errors, metrics, action checks."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from bunshin_gym.core.env import ActionError
from bunshin_gym.core.task import TaskError
from bunshin_gym.envs.osworld import desktop, metrics, tasks
from bunshin_gym.envs.osworld.env import Computer13Space, check_computer_13

REPO = Path(__file__).resolve().parents[2]
FORMATS = Path("/work/shared/formats/osworld")
ASSETS = REPO / "envs" / "osworld" / "assets"


def test_shipped_tasks_load_with_oracles():
    shipped = tasks.shipped_tasks()
    assert len(shipped) >= 30
    domains = {t.domain for t in shipped}
    assert {"os", "editor", "chrome", "calc"} <= domains
    for t in shipped:
        assert t.oracle(), f"{t.id} has no oracle"
        assert t.oracle()[-1] in ("DONE", "FAIL"), t.id
        for step in t.steps_config:
            if step["type"] == "download":
                for f in step["parameters"]["files"]:
                    tasks.FileCache([ASSETS]).resolve(f["url"], f["path"], t.id)


@pytest.mark.skipif(not FORMATS.exists(), reason="shared format samples not present")
@pytest.mark.parametrize("name", ["calc-example.json", "chrome-example.json", "os-28cc3b7e.json", "os-5812b315.json"])
def test_real_osworld_task_files_load(name):
    task = tasks.load_task(str(FORMATS / name))
    assert task.instruction


def _task(**over):
    base = {"id": "t", "instruction": "x", "config": [],
            "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "true"},
                          "expected": {"type": "rule", "rules": {"expected": ""}}}}
    for k, v in over.items():
        if k.startswith("ev_"):
            base["evaluator"][k[3:]] = v
        else:
            base[k] = v
    return base


@pytest.mark.parametrize("spec, needle", [
    (_task(config=[{"type": "googledrive", "parameters": {}}]), "'googledrive'"),
    (_task(ev_postconfig=[{"type": "login", "parameters": {}}]), "'login'"),
    (_task(ev_func="compare_pptx_files"), "'compare_pptx_files'"),
    (_task(ev_result={"type": "cookie_data"}), "'cookie_data'"),
    (_task(ev_func=["exact_match", "fuzzy_match"]), "'fuzzy_match'"),
])
def test_unsupported_names_are_errors(spec, needle):
    with pytest.raises(TaskError, match=needle):
        tasks.load_task(spec)


def test_unknown_task_id_lists_shipped():
    with pytest.raises(TaskError, match="osworld/terminal-mkdir-projects"):
        tasks.load_task("osworld/no-such-task")


def test_cache_resolves_index_and_osworld_names(tmp_path):
    url = "https://drive.example/download?id=42"
    (tmp_path / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_data.xlsx").write_bytes(b"x")
    cache = tasks.FileCache([tmp_path, ASSETS])
    assert cache.resolve(url, "/home/user/data.xlsx").read_bytes() == b"x"
    assert cache.resolve("https://assets.bunshin-gym.local/os/app.log").name == "app.log"
    with pytest.raises(TaskError, match="https://nowhere.example/f.csv"):
        cache.resolve("https://nowhere.example/f.csv", "f.csv")


def test_compare_table_xlsx_against_csv(tmp_path):
    gold = ASSETS / "calc" / "grades-gold.csv"
    src = ASSETS / "calc" / "grades.xlsx"
    rule = {"rules": [{"type": "sheet_data", "sheet_idx0": "RI0", "sheet_idx1": "EI0"}]}
    assert metrics.compare_table(str(gold), str(gold), **rule) == 1.0
    assert metrics.compare_table(str(src), str(gold), **rule) == 0.0  # blanks not filled
    assert metrics.compare_table(str(src), None, rules=[{"type": "check_cell", "sheet_idx": 0, "coordinate": "C3",
                                                        "props": {"value": {"method": "eq", "ref": 92}}}]) == 1.0
    assert metrics.compare_table(None, str(gold), **rule) == 0.0
    with pytest.raises(ValueError, match="'sheet_print'"):
        metrics.compare_table(str(src), str(gold), rules=[{"type": "sheet_print"}])
    assert metrics.read_table(str(src))[0][0] == "Grades"


def test_text_metrics(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text('"item","n"\n"x",1\n')
    b.write_text("item,n\nx,1\n")
    assert metrics.compare_csv(str(a), str(b)) == 1.0
    assert metrics.compare_csv(str(a), None) == 0.0
    assert metrics.exact_match("100\n", {"expected": "100\n"}) == 1.0
    assert metrics.check_include_exclude("ok passed", {"include": ["passed"], "exclude": ["fail"]}) == 1.0
    assert metrics.check_include_exclude("ok failed", {"include": ["ok"], "exclude": ["fail"]}) == 0.0
    assert metrics.check_direct_json_object('{"a": 1, "b": 2}', {"expected": {"a": 1}}) == 1.0
    sub = {"type": "directory", "name": "s", "children": [{"type": "file", "name": "y"}]}
    tree = {"type": "directory", "name": "d", "children": [{"type": "file", "name": "x.md"}, sub]}
    assert metrics.check_directory_tree(tree, {"include": ["x.md", "s/", "s/y"], "exclude": ["x.txt"]}) == 1.0
    assert metrics.check_directory_tree(tree, {"include": ["x.txt"]}) == 0.0


@pytest.mark.parametrize("action, ok", [
    ({"action_type": "CLICK", "x": 10, "y": 20}, True),
    ({"action_type": "CLICK"}, True),
    ({"action_type": "CLICK", "x": 10}, False),
    ({"action_type": "CLICK", "x": 5000, "y": 1}, False),
    ({"action_type": "MOVE_TO", "x": 1, "y": 1}, True),
    ({"action_type": "MOVE_TO"}, False),
    ({"action_type": "TYPING", "text": "hi"}, True),
    ({"action_type": "TYPING"}, False),
    ({"action_type": "HOTKEY", "keys": ["ctrl", "s"]}, True),
    ({"action_type": "HOTKEY", "keys": []}, False),
    ({"action_type": "SCROLL", "dy": -3}, True),
    ({"action_type": "SCROLL"}, False),
    ({"action_type": "CLICK", "button": "side"}, False),
    ({"action_type": "JUMP"}, False),
    ("CLICK", False),
])
def test_computer_13_checks(action, ok):
    if ok:
        check_computer_13(action, 1920, 1080)
    else:
        with pytest.raises(ActionError):
            check_computer_13(action, 1920, 1080)
    assert Computer13Space(1920, 1080).contains(action) == ok


def test_computer_13_space_samples_valid_actions():
    space = Computer13Space(1920, 1080, seed=3)
    assert all(space.contains(space.sample()) for _ in range(50))


def test_terminal_text_strips_escapes():
    raw = b"\x1b]0;user@ws: ~\x07user@ws:~$ ls\r\n\x1b[0m\x1b[01;34mDesktop\x1b[0m\r\nab\bc\n"
    assert desktop.terminal_text(raw) == "user@ws:~$ ls\nDesktop\nac\n"


def test_task_files_are_osworld_shaped():
    for path in (REPO / "envs" / "osworld" / "tasks").glob("*/*.json"):
        data = json.loads(path.read_text())
        assert {"id", "snapshot", "instruction", "source", "config", "related_apps", "evaluator"} <= set(data), path
