"""Malformed task configs of every env family are a TaskError that names the field (or the
file, line and column of invalid JSON) when the task is loaded, never a task that
misbehaves later (a ``setup`` string run one character at a time, ``max_steps="10"``
compared with an int mid-episode). No workspace needed: loading is host-side."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core.task import TaskError
from bunshin_gym.envs.osworld import tasks as osworld_tasks
from bunshin_gym.envs.osworld.tasks import OSWorldTask
from bunshin_gym.envs.shell.env import ShellTask, load_shell_task
from bunshin_gym.envs.shell.env import shipped_tasks as shipped_shell_tasks
from bunshin_gym.envs.webarena import tasks as webarena_tasks
from bunshin_gym.envs.webarena.tasks import WebArenaTask
from bunshin_gym.testing import fake_factory

SITES = {"__SHOPPING__": "http://127.0.0.1:7770"}
SHELL = {"id": "shell/t", "instruction": "do it", "check": "true", "setup": ["mkdir -p /data"], "max_steps": 5}
OSWORLD = {"id": "osworld/t", "instruction": "do it", "config": [{"type": "sleep", "parameters": {"seconds": 0}}],
           "evaluator": {"func": "infeasible"}}
WEBARENA = {"task_id": 9999, "sites": ["shopping"], "start_url": "__SHOPPING__/", "intent": "do it",
            "eval": {"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}}}

LOADERS = {
    "shell": (SHELL, load_shell_task),
    "osworld": (OSWORLD, osworld_tasks.load_task),
    "webarena": (WEBARENA, lambda spec: webarena_tasks.load_task(spec, SITES)),
}


def with_(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    out.update(changes)
    return out


@pytest.mark.parametrize("family", LOADERS)
def test_a_good_config_of_each_family_loads(family):
    base, load = LOADERS[family]
    task = load(copy.deepcopy(base))
    assert task.instruction == "do it" and isinstance(task.max_steps, int)


@pytest.mark.parametrize("family", LOADERS)
@pytest.mark.parametrize("bad", ["10", 10.5, True, 0, -3, [10]])
def test_a_non_integer_or_non_positive_max_steps_names_the_field(family, bad):
    base, load = LOADERS[family]
    with pytest.raises(TaskError, match="'max_steps' must be a positive integer"):
        load(with_(base, max_steps=bad))


def test_shell_setup_as_a_string_names_the_field():
    with pytest.raises(TaskError, match=r"field 'setup' must be a list, not a string \('mkdir -p /data'\)"):
        load_shell_task(with_(SHELL, setup="mkdir -p /data"))


def test_shell_setup_with_a_non_string_command_names_the_element():
    with pytest.raises(TaskError, match=r"field 'setup'\[1\] must be a string, not an integer"):
        load_shell_task(with_(SHELL, setup=["true", 3]))


@pytest.mark.parametrize("key", ["id", "instruction", "check"])
def test_shell_required_fields_are_named_missing_or_of_the_wrong_type(key):
    with pytest.raises(TaskError, match=f"missing field '{key}'"):
        load_shell_task({k: v for k, v in SHELL.items() if k != key})
    with pytest.raises(TaskError, match=f"field '{key}' must be a string, not a list"):
        load_shell_task(with_(SHELL, **{key: ["x"]}))


def test_osworld_config_as_a_string_and_a_step_that_is_not_an_object_name_the_field():
    with pytest.raises(TaskError, match=r"field 'config' must be a list, not a string"):
        osworld_tasks.load_task(with_(OSWORLD, config="sleep 1"))
    with pytest.raises(TaskError, match=r"field 'config'\[0\] must be an object, not a string"):
        osworld_tasks.load_task(with_(OSWORLD, config=["sleep"]))
    with pytest.raises(TaskError, match=r"config\[0\]: field 'parameters' must be an object, not a list"):
        osworld_tasks.load_task(with_(OSWORLD, config=[{"type": "sleep", "parameters": [1]}]))
    with pytest.raises(TaskError, match=r"field 'evaluator' must be an object, not a string"):
        osworld_tasks.load_task(with_(OSWORLD, evaluator="infeasible"))


def test_webarena_fields_of_the_wrong_type_are_named():
    with pytest.raises(TaskError, match=r"field 'sites' must be a list, not a string"):
        webarena_tasks.load_task(with_(WEBARENA, sites="shopping"), SITES)
    with pytest.raises(TaskError, match=r"field 'intent' must be a string, not an object"):
        webarena_tasks.load_task(with_(WEBARENA, intent={"en": "x"}), SITES)
    with pytest.raises(TaskError, match=r"field 'eval' must be an object, not a string"):
        webarena_tasks.load_task(with_(WEBARENA, eval="string_match"), SITES)


@pytest.mark.parametrize("make", [lambda c: ShellTask(c), lambda c: OSWorldTask(c),
                                  lambda c: WebArenaTask(c, SITES)], ids=["shell", "osworld", "webarena"])
def test_a_config_that_is_not_an_object_is_refused(make):
    with pytest.raises(TaskError, match="a task is a JSON object .*, not a list"):
        make(["not", "a", "task"])


@pytest.mark.parametrize("family", LOADERS)
def test_invalid_json_names_the_file_line_and_column(family, tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "id": "x",\n  "instruction": "y",,\n}\n')
    _, load = LOADERS[family]
    with pytest.raises(TaskError, match=rf"task file {path}: invalid JSON at line 3 column 22"):
        load(str(path))


@pytest.mark.parametrize("family", LOADERS)
def test_a_json_file_holding_a_list_is_refused_naming_the_file(family, tmp_path: Path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([LOADERS[family][0]]))
    with pytest.raises(TaskError, match=rf"task file {path}: a task is a JSON object, not a list"):
        LOADERS[family][1](str(path))


def test_a_bad_shell_file_names_its_path(tmp_path: Path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(with_(SHELL, setup="mkdir /x")))
    with pytest.raises(TaskError, match=rf"\({path}\): field 'setup' must be a list"):
        load_shell_task(str(path))


def test_every_shipped_task_still_loads():
    assert len(shipped_shell_tasks()) >= 10
    assert len(osworld_tasks.shipped_tasks()) >= 10
    for tid in webarena_tasks.shipped_task_ids():
        webarena_tasks.load_task(tid, SITES)


def test_an_env_refuses_a_bad_task_at_reset_and_runs_a_good_one_after():
    env = gym.make("Bunshin-Shell-v0", workspace_factory=fake_factory)
    try:
        with pytest.raises(TaskError, match="'setup' must be a list"):
            env.reset(options={"task": with_(SHELL, setup="mkdir -p /data")})
        obs, info = env.reset(options={"task": SHELL})
        assert info["task_id"] == "shell/t"
        assert env.step("echo hi")[4].get("error") is None
    finally:
        env.close()
