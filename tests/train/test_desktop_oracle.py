"""The desktop's oracles (pyautogui code) in the trained action space (computer_13 dicts): the
tokenizer corpus and the warm start of ``bunshin train --env-id Bunshin-OSWorld-v0`` read them
(they crashed on the code strings before)."""

from __future__ import annotations

import json

from bunshin_gym.envs.osworld.tasks import load_task
from bunshin_gym.train.tiny import shell_corpus
from bunshin_gym.train.tools import DESKTOP, SHELL, adapter_for


def test_desktop_oracle_becomes_computer_13_actions():
    got = DESKTOP.env_oracle(["pyautogui.write('mkdir ~/projects\\n')", "pyautogui.press('down', presses=2)", "DONE"])
    assert got == [{"action_type": "TYPING", "text": "mkdir ~/projects\n"},
                   {"action_type": "PRESS", "key": "down"}, {"action_type": "PRESS", "key": "down"}, "DONE"]
    assert DESKTOP.from_action(got[0]) == ("action", got[0]) and DESKTOP.from_action("DONE") == ("done", {})
    assert DESKTOP.env_oracle(["pyautogui.dragTo(1, 2)"]) is None  # no computer_13 form: no oracle episode
    assert SHELL.env_oracle(["ls", "DONE"]) == ["ls", "DONE"]  # other envs' oracles are their actions


def test_the_tokenizer_corpus_of_a_desktop_task_has_its_oracle_calls():
    task = load_task("osworld/terminal-mkdir-projects")
    corpus = shell_corpus([task], adapter_for("Bunshin-OSWorld-v0"))
    calls = [json.loads(t.split("\n")[1]) for t in corpus if t.startswith("<tool_call>")]
    assert calls and calls[0]["name"] == "action" and calls[0]["arguments"]["action_type"] == "TYPING"
