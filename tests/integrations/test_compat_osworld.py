"""bunshin_gym.compat.osworld.DesktopEnv driven the way OSWorld's runner drives its DesktopEnv
(lib_run_single: reset(task_config), step(action, pause) until done, evaluate()), on a real desktop."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from bunshin_gym.compat.osworld import DesktopEnv
from bunshin_gym.core.task import TaskError
from bunshin_gym.envs.osworld import tasks

SIZE = (800, 600)


def example(task_id: str) -> dict:
    """The task as OSWorld's runner has it: the JSON file's dict."""
    return json.loads(tasks.task_paths()[task_id].read_text())


def run_single(env: DesktopEnv, task_config: dict, actions: list, max_steps: int = 15) -> tuple[float, list]:
    """OSWorld's lib_run_single.run_single_example, with a scripted agent."""
    obs = env.reset(task_config=task_config)
    infos, done, step = [], False, 0
    while not done and step < max_steps:
        obs, reward, done, info = env.step(actions[step], 0.2)
        assert reward == 0  # OSWorld's step never rewards: evaluate() does
        infos.append(info)
        step += 1
    return env.evaluate(), infos


@pytest.fixture(scope="module")
def env():
    e = DesktopEnv(action_space="pyautogui", screen_size=SIZE, require_a11y_tree=False, require_terminal=True,
                   provider_name="docker", path_to_vm=None)
    yield e
    e.close()


def test_observation_dict_is_osworlds(env):
    obs = env.reset(task_config=example("osworld/terminal-mkdir-projects"))
    assert set(obs) == {"screenshot", "accessibility_tree", "terminal", "instruction"}
    assert isinstance(obs["screenshot"], bytes) and obs["screenshot"][:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(io.BytesIO(obs["screenshot"])).size == SIZE
    assert obs["accessibility_tree"] is None  # not required: None, as OSWorld gives
    assert isinstance(obs["terminal"], str)
    assert obs["instruction"] == "Create a folder named projects in my home directory."
    assert env.render()[:4] == b"\x89PNG"


def test_an_osworld_loop_runs_unchanged_and_evaluates(env):
    task = example("osworld/terminal-mkdir-projects")
    score, infos = run_single(env, task, ["pyautogui.write('mkdir ~/projects\\n')", "WAIT", "DONE"])
    assert score == 1.0 and infos == [{}, {}, {"done": True}]
    assert env.action_history[-1] == "DONE"
    score, infos = run_single(env, task, ["FAIL"])
    assert score == 0.0 and infos == [{"fail": True}]
    # evaluate() before the end runs the evaluator on the current state
    env.reset(task_config=task)
    assert env.evaluate() == 0.0
    env.step("pyautogui.write('mkdir ~/projects\\n')", 0.5)
    assert env.evaluate() == 1.0


def test_clones_are_independent_desktop_envs(env):
    env.reset(task_config=example("osworld/terminal-mkdir-projects"))
    a, b = env.clone(2)
    try:
        a.step("pyautogui.write('mkdir ~/projects\\n')", 0.5)
        _, _, done, info = a.step("DONE", 0)
        assert done and info == {"done": True} and a.evaluate() == 1.0
        assert b.evaluate() == 0.0 and env.evaluate() == 0.0
        assert b.instruction == env.instruction
    finally:
        a.close()
        b.close()


def test_bad_task_config_is_a_clear_error(env):
    with pytest.raises(TaskError, match="evaluator|instruction"):
        env.reset(task_config={"id": "x/broken", "config": []})
    with DesktopEnv(screen_size=SIZE) as fresh, pytest.raises(ValueError, match="task_config"):
        fresh.reset()
