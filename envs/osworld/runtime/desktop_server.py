"""In-workspace input server of a bunshin desktop: runs actions against the workspace display.

Started at boot as user ``user`` with ``DISPLAY=:0``; listens on the unix socket
``/tmp/.bunshin/desktop.sock``. It holds one X connection (through the ``pyautogui`` module,
bunshin's python-xlib implementation), so an action costs a socket round trip plus the X
requests, not a process start. Framing as the workspace agent: a 4-byte big-endian header
length, a JSON header, then the blobs whose lengths the header lists under ``"_blobs"``
(bunshin's one protocol module, ``/.bunshin/protocol.py`` from the runtime layer).

Requests (one reply each; a failed action answers ``{"error": ...}`` and the server goes on):
    {"op": "ping"}
    {"op": "pyautogui", "code": "pyautogui.click(10, 20)", "timeout": 30}
    {"op": "computer_13", "action": {"action_type": "CLICK", "x": 10, "y": 20}}
    {"op": "screenshot"}  -> blob: BGRX pixels of the whole screen (fallback path)
    {"op": "a11y_tree", "seconds": 8, "max_nodes": 3000, "memo": true, "reply_timeout": 5}  -> blob: the
        accessibility tree's XML (``a11y_dump.dump_fast``, run here: a dump as its own process
        pays a Python start and its imports, 150-300 ms, on every step; every connection it
        opens is closed before it answers, so nothing of it is open across a snapshot; what
        the last dump learned that never changes, ``A11Y_MEMO``, is kept in memory unless
        "memo" is false); the reply says how many objects the memo knew (``memo_known``)

Standard library + python3-xlib only. The host side drops its connection before every
snapshot, so nothing here outlives a request across a CRIU dump but the X connection
(which is inside the workspace).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, "/.bunshin")  # bunshin's wire protocol, from the runtime layer
import pyautogui  # noqa: E402 - bunshin's shim, installed beside this file and in dist-packages
from protocol import serve_unix  # noqa: E402

SOCKET_PATH = "/tmp/.bunshin/desktop.sock"


class ActionTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise ActionTimeout("the action ran past its time limit")


def _opt(action: dict, key: str, default=None):
    v = action.get(key, default)
    return default if v is None else v


def run_computer_13(action: dict) -> None:
    """One OSWorld computer_13 action (already checked for shape on the host)."""
    kind = action["action_type"]
    x, y = action.get("x"), action.get("y")
    button = _opt(action, "button", "left")
    if kind == "MOVE_TO":
        pyautogui.moveTo(x, y)
    elif kind == "CLICK":
        pyautogui.click(x, y, clicks=int(_opt(action, "num_clicks", 1)), button=button)
    elif kind == "MOUSE_DOWN":
        pyautogui.mouseDown(button=button)
    elif kind == "MOUSE_UP":
        pyautogui.mouseUp(button=button)
    elif kind == "RIGHT_CLICK":
        pyautogui.rightClick(x, y)
    elif kind == "DOUBLE_CLICK":
        pyautogui.doubleClick(x, y)
    elif kind == "DRAG_TO":
        pyautogui.dragTo(x, y, duration=0.3, button="left")
    elif kind == "SCROLL":
        if action.get("dx"):
            pyautogui.hscroll(int(action["dx"]))
        if action.get("dy"):
            pyautogui.vscroll(int(action["dy"]))
    elif kind == "TYPING":
        pyautogui.write(action["text"])
    elif kind == "PRESS":
        pyautogui.press(action["key"])
    elif kind == "KEY_DOWN":
        pyautogui.keyDown(action["key"])
    elif kind == "KEY_UP":
        pyautogui.keyUp(action["key"])
    elif kind == "HOTKEY":
        pyautogui.hotkey(*action["keys"])
    else:
        raise ValueError(f"unknown action_type {kind!r}")


def run_code(code: str) -> str:
    out = io.StringIO()
    scope = {"__name__": "__bunshin_action__", "pyautogui": pyautogui, "time": time}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        exec(compile(code, "<action>", "exec"), scope)  # noqa: S102 - running the agent's code is the point
    return out.getvalue()[-8192:]


#: what the last tree dump learned that apps' objects never change (a11y_dump.AppMemo by
#: app): kept in this process, which is forked with the workspace, so a clone's memo is its
#: source's, as exact for its apps
A11Y_MEMO: dict = {}


def a11y_tree(req: dict) -> tuple[dict, list[bytes]]:
    """The fast walker's dump; an error reply (the host then runs the dump as a process, which
    falls back to the old walker) if it fails."""
    import a11y_dump  # beside this file; imported on the first tree, kept for the next ones

    seconds = float(req.get("seconds") or 8.0)
    known = sum(len(m.ifaces) for m in A11Y_MEMO.values())  # objects the memo knows, as the dump starts
    signal.setitimer(signal.ITIMER_REAL, seconds + 10)  # past its own deadline: a hung app call
    try:
        xml = a11y_dump.dump_fast(int(req.get("max_nodes") or 3000), seconds,
                                  os.environ.get("XDG_RUNTIME_DIR") or "/tmp",
                                  A11Y_MEMO if req.get("memo", True) else None,
                                  float(req.get("reply_timeout") or a11y_dump.REPLY_TIMEOUT_S))
    except BaseException as e:  # noqa: BLE001 - reported; the host takes the other path
        return {"error": f"{type(e).__name__}: {e}"}, []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"walker": "fast", "pid": os.getpid(), "memo_known": known}, [xml.encode()]


def handle(req: dict) -> tuple[dict, list[bytes]]:
    op = req.get("op")
    if op == "ping":
        return {"pid": os.getpid()}, []
    if op == "a11y_tree":
        return a11y_tree(req)
    if op == "screenshot":
        from Xlib import X

        d = pyautogui._d()
        w, h = pyautogui.size()
        raw = d.screen().root.get_image(0, 0, w, h, X.ZPixmap, 0xFFFFFFFF)
        return {"width": w, "height": h}, [bytes(raw.data)]
    if op not in ("pyautogui", "computer_13"):
        return {"error": f"unknown operation {op!r}"}, []
    signal.setitimer(signal.ITIMER_REAL, float(req.get("timeout") or 60))
    t0 = time.monotonic()
    try:
        output = run_code(req["code"]) if op == "pyautogui" else (run_computer_13(req["action"]) or "")
        reply = {"output": output}
    except SystemExit as e:
        reply = {"output": "", "error": f"SystemExit: {e.code}"}
    except BaseException as e:  # noqa: BLE001 - any failure of the action is reported, the server goes on
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f" (line {f.lineno})" for f in reversed(tb) if f.filename == "<action>"), "")
        reply = {"error": f"{type(e).__name__}: {e}{where}"}
        if not isinstance(e, (ActionTimeout, pyautogui.PyAutoGUIException, ValueError, TypeError,
                              NameError, SyntaxError, KeyError, AttributeError, IndexError, ZeroDivisionError)):
            pyautogui._reset_display()  # an X error may leave the connection unusable
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # release anything the action left pressed only when asked; OSWorld leaves that to the agent
    reply["duration"] = time.monotonic() - t0
    return reply, []


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    serve_unix(SOCKET_PATH, lambda req, _blobs: handle(req), mode=0o666, backlog=8, name="bunshin desktop server")


if __name__ == "__main__":
    main()
