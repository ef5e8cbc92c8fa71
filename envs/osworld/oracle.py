"""The shipped oracles (scripted solutions, pyautogui code) in the other action space."""

from __future__ import annotations

import ast

__all__ = ["to_computer_13"]


def to_computer_13(action: str) -> list[dict]:
    """A shipped pyautogui oracle action as computer_13 actions (one call of ``write``,
    ``hotkey``, ``press``, ``click`` or a sleep; ``WAIT``/``DONE``/``FAIL`` as they are).
    Raises ValueError for anything else."""
    if action in ("WAIT", "DONE", "FAIL"):
        return [{"action_type": action}]
    body = ast.parse(action).body
    if len(body) == 2 and isinstance(body[0], ast.Import) and "time.sleep" in ast.unparse(body[1]):
        return [{"action_type": "WAIT"}]  # the oracle's pause for an app: the env's WAIT
    if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        raise ValueError(f"not one pyautogui call: {action!r}")
    call = body[0].value
    name = ast.unparse(call.func)
    args = [ast.literal_eval(a) for a in call.args]
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    if name == "pyautogui.write" and len(args) == 1:
        return [{"action_type": "TYPING", "text": args[0]}]
    if name == "pyautogui.hotkey":
        return [{"action_type": "HOTKEY", "keys": list(args)}]
    if name == "pyautogui.press" and len(args) == 1:
        return [{"action_type": "PRESS", "key": args[0]}] * int(kw.get("presses", 1))
    if name == "pyautogui.click" and len(args) == 2 and not kw:
        return [{"action_type": "CLICK", "x": args[0], "y": args[1], "button": "left", "num_clicks": 1}]
    raise ValueError(f"no computer_13 form for {action!r}")
