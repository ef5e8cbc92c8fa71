"""Tool-call signatures: what makes two tool calls "the same call".

The prefix cache serves a call's recorded result to every call with the same signature,
and speculation adopts a fork's state when the actual call's signature equals the
predicted one. Two calls may therefore share a signature only if the env does exactly
the same with both, so each action kind is normalised by its own grammar, and anything
the grammar cannot vouch for keys on its exact text:

- **shell** (``Bunshin-Shell-v0``): the command's words as the shell splits them, quotes
  and escapes kept verbatim; only the blanks between words are normalised (``echo a  b``
  equals ``echo a b``; ``echo "a  b"`` does not equal ``echo "a b"``). Text the splitter
  does not fully understand (unbalanced quotes, here-documents, ``$(...)``, backquotes,
  ``${...}``, whose nested quotes it cannot follow) keys on its exact text.
- **pyautogui** (OSWorld's code actions): the Python AST (``ast.dump``), so layout and
  comments do not matter but indentation that changes the program does; code that does not
  parse keys on its exact text. ``WAIT``/``FAIL``/``DONE`` are the env's special actions.
- **computer_13** (OSWorld's action dicts): the dict as canonical JSON (sorted keys).
- **webarena** (WebArena action strings): the action as WebArena's parser reads it
  (:func:`bunshin_gym.envs.webarena.actions.parse_action`); an unparsable string keys on
  its exact text.
- anything else: the exact value.

An env may define ``tool_signature(action) -> str`` to replace all of this.

Example:
    >>> signature("echo a   b", "shell") == signature("echo a b", "shell")
    True
    >>> signature('echo "a  b"', "shell") == signature('echo "a b"', "shell")
    False
"""

from __future__ import annotations

import ast
import json
import shlex
import sys
from typing import Any

#: the action kinds :func:`signature` knows (``tool_kind`` of an env is one of these)
KINDS = ("shell", "pyautogui", "computer_13", "webarena", "exact")
# special actions that end or pause an episode (the envs compare the stripped text)
_SHELL_SPECIAL = ("DONE", "FAIL")
_DESKTOP_SPECIAL = ("WAIT", "FAIL", "DONE")
# shell constructs whose nested quoting or verbatim bodies the word splitter below does not follow
_OPAQUE_SHELL = ("<<", "$(", "`", "${")
# env classes by module, looked up in sys.modules so that no env is imported here
_ENV_CLASSES = (("bunshin_gym.envs.webarena.env", "WebArenaEnv", "webarena"),
                ("bunshin_gym.envs.shell.env", "ShellEnv", "shell"))


def tool_kind(env: Any) -> str:
    """The action kind of an env (or ``env`` itself when it is already a kind's name)."""
    if isinstance(env, str):
        if env not in KINDS:
            raise ValueError(f"unknown action kind {env!r}; one of {', '.join(KINDS)}")
        return env
    base = getattr(env, "unwrapped", env)
    space = getattr(base, "action_space_name", None)  # OSWorld's two action spaces
    if space in ("pyautogui", "computer_13"):
        return space
    for module, cls_name, kind in _ENV_CLASSES:
        cls = getattr(sys.modules.get(module), cls_name, None)
        if isinstance(cls, type) and isinstance(base, cls):
            return kind
    return "exact"


def signature(action: Any, env: Any = None) -> str:
    """Canonical signature of one tool call (see the module docs).

    Args:
        action: the action as given to ``env.step``.
        env: the env it is for, or the name of its action kind (one of :data:`KINDS`).
            Without it a string is read as a shell command and a dict as a computer_13
            action (the rollout wrappers always pass their env).
    """
    custom = getattr(getattr(env, "unwrapped", env), "tool_signature", None) if env is not None else None
    if custom is not None:
        return custom(action)
    if env is None:
        kind = "computer_13" if isinstance(action, dict) else "shell" if isinstance(action, str) else "exact"
    else:
        kind = tool_kind(env)
    if kind == "shell" and isinstance(action, str):
        return _shell(action)
    if kind == "pyautogui" and isinstance(action, str):
        return _python(action)
    if kind == "webarena" and isinstance(action, str):
        return _webarena(action)
    if kind in ("computer_13", "pyautogui") and isinstance(action, dict):
        return _canonical_json("c13", action)
    return _exact(action)


def _exact(action: Any) -> str:
    if isinstance(action, str):
        return f"exact({action})"
    return _canonical_json(f"exact-{type(action).__name__}", action)


def _canonical_json(tag: str, value: Any) -> str:
    try:
        return f"{tag}({json.dumps(value, sort_keys=True, separators=(',', ':'), ensure_ascii=False)})"
    except (TypeError, ValueError):  # not JSON (a set, an object): its repr, which is exact enough
        return f"{tag}!({value!r})"


# shell -----------------------------------------------------------------------------------
def _shell(command: str) -> str:
    text = command.strip()  # the shell env strips the command before running it
    if text in _SHELL_SPECIAL:
        return f"special({text})"
    words = shell_words(text)
    if words is None:
        return f"sh-exact({text})"
    return f"sh({' '.join(words)})"


def shell_words(text: str) -> list[str] | None:
    """The words of a command line with their quoting kept verbatim, and ``"\\n"`` for each
    run of unquoted line breaks (a command separator); None when only the exact text is
    a safe key (see the module docs)."""
    if any(c in text for c in _OPAQUE_SHELL):
        return None
    try:
        shlex.split(text)  # rejects unbalanced quotes and a trailing escape
    except ValueError:
        return None
    words: list[str] = []
    word: list[str] = []

    def end_word() -> None:
        if word:
            words.append("".join(word))
            word.clear()

    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if quote == "'":  # nothing is special inside single quotes but the closing quote
            word.append(c)
            quote = "" if c == "'" else quote
        elif quote == '"':
            word.append(c)
            if c == "\\" and i + 1 < len(text):
                word.append(text[i + 1])
                i += 1
            elif c == '"':
                quote = ""
        elif c == "\\" and i + 1 < len(text):
            word.append(text[i:i + 2])
            i += 1
        elif c in "'\"":
            quote = c
            word.append(c)
        elif c == "\n":
            end_word()
            if words and words[-1] != "\n":
                words.append("\n")
        elif c in " \t":
            end_word()
        else:
            word.append(c)
        i += 1
    end_word()
    while words and words[-1] == "\n":
        words.pop()
    return words


# pyautogui -------------------------------------------------------------------------------
def _python(code: str) -> str:
    if code.strip() in _DESKTOP_SPECIAL:  # the desktop env compares the stripped text
        return f"special({code.strip()})"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return f"py-exact({code})"
    return f"py({ast.dump(tree)})"


# WebArena --------------------------------------------------------------------------------
def _webarena(text: str) -> str:
    from bunshin_gym.envs.webarena.actions import ActionSyntaxError, parse_action

    try:
        act = parse_action(text)
    except ActionSyntaxError:
        return f"wa-exact({text})"
    fields = {k: v for k, v in vars(act).items() if k != "raw"}
    return _canonical_json("wa", fields)
