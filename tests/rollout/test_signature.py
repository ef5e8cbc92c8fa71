"""Tool-call signatures: two calls share one only if the env does exactly the same with both.
The unit tests need no workspace; the last test serves two shell commands that differ only
inside quotes through a real prefix cache."""

from __future__ import annotations

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache
from bunshin_gym.rollout.signature import shell_words, signature, tool_kind


def same(kind: str, a, b) -> bool:
    return signature(a, kind) == signature(b, kind)


@pytest.mark.parametrize("a, b", [
    ('echo "a  b"', 'echo "a b"'),
    ("echo 'a  b'", "echo 'a b'"),
    ('echo "$HOME"', "echo '$HOME'"),  # expands vs literal: the quotes stay in the key
    ('echo "*"', "echo *"),  # literal star vs a glob
    ("echo a\\ \\ b", "echo a\\ b"),  # escaped blanks are part of the word
    ("echo a\necho b", "echo a echo b"),  # a line break separates commands
    ('echo "a"b', 'echo "a" b'),  # one word vs two
    ("cat <<EOF\n  a  b\nEOF", "cat <<EOF\n a b\nEOF"),  # here-document bodies are verbatim
    ('echo "$(echo "a  b")"', 'echo "$(echo "a b")"'),  # nested quotes: exact text
    ('echo "unbalanced  x', 'echo "unbalanced x'),
    ("DONE", "DONE # not the special action"),
])
def test_shell_commands_that_differ_have_different_signatures(a, b):
    assert not same("shell", a, b)


@pytest.mark.parametrize("a, b", [
    ("echo a  b", "echo a b"),
    ("  ls\t-la /data  ", "ls -la /data"),
    ("echo x  >>  f;   wc -l < f", "echo x >> f; wc -l < f"),
    ("ls\n\n  pwd\n", "ls\npwd"),
    ('grep -r "a  b"   /etc', 'grep -r "a  b" /etc'),
])
def test_shell_commands_that_differ_only_in_blanks_between_words_share_one(a, b):
    assert same("shell", a, b)


def test_shell_words_keep_quoting_and_fall_back_on_what_they_cannot_follow():
    assert shell_words("echo  'a  b'  \"c\\\" d\"") == ["echo", "'a  b'", '"c\\" d"']
    assert shell_words("echo $(date)") is None
    assert shell_words("echo 'open") is None


PROGRAM = "import pyautogui\nfor i in range(3):\n    pyautogui.press('down')\npyautogui.press('enter')\n"
INDENTED = "import pyautogui\nfor i in range(3):\n    pyautogui.press('down')\n    pyautogui.press('enter')\n"


def test_pyautogui_programs_key_on_their_syntax_tree():
    assert not same("pyautogui", PROGRAM, INDENTED)  # the loop body differs
    assert same("pyautogui", PROGRAM, PROGRAM.replace("    ", "  ") + "# done\n")  # same program
    assert not same("pyautogui", "pyautogui.write('a  b')", "pyautogui.write('a b')")
    assert not same("pyautogui", "pyautogui.moveTo(1, 2)", "pyautogui.moveTo(1.0, 2)")
    assert not same("pyautogui", "x = (", "x = ( ")  # no AST: exact text
    assert not same("pyautogui", "DONE", "DONE  # comment")  # the env runs the second as code
    assert same("pyautogui", "DONE", " DONE\n")


def test_computer_13_actions_key_on_their_parsed_form():
    a = {"action_type": "CLICK", "x": 10, "y": 20, "button": "left"}
    assert same("computer_13", a, {"button": "left", "y": 20, "x": 10, "action_type": "CLICK"})
    assert not same("computer_13", {"action_type": "TYPING", "text": "a  b"}, {"action_type": "TYPING", "text": "a b"})
    assert not same("computer_13", {"action_type": "CLICK", "type": "x"}, {"action_type": "CLICK"})


def test_webarena_actions_key_on_their_parsed_form():
    assert same("webarena", "click [12]", "  click [ 12 ]")
    assert same("webarena", "type [5] [shoes]", "type [5] [shoes] [1]")  # Enter is the default
    assert not same("webarena", "type [5] [shoes]", "type [5] [shoes] [0]")
    assert not same("webarena", "type [5] [a  b]", "type [5] [a b]")
    assert not same("webarena", "click  [12]", "click [12]")  # not the grammar: exact text
    assert not same("webarena", "tab_focus [0]", "tab_focus [1]")


def test_the_kind_comes_from_the_env():
    shell = gym.make("Bunshin-Shell-v0")
    try:
        assert tool_kind(shell) == "shell"
        assert signature('echo "a  b"', shell) == signature('echo "a  b"')  # logs without an env agree
    finally:
        shell.close()
    with pytest.raises(ValueError, match="unknown action kind"):
        signature("ls", "bash")


def test_the_cache_never_serves_a_command_that_differs_inside_quotes(tmp_path):
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1)
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        assert env.step('echo "a  b"')[0]["output"] == "a  b\n"
        env.reset(options={"task": "shell/make-dir"})
        obs, _, _, _, info = env.step('echo "a b"')
        assert info["cache"] == "miss" and obs["output"] == "a b\n"
        env.reset(options={"task": "shell/make-dir"})
        obs, _, _, _, info = env.step('echo   "a  b"')  # only the blanks between words differ
        assert info["cache"] == "hit" and obs["output"] == "a  b\n"
    finally:
        env.close()
        cache.clear()
