"""Bunshin-OSWorld-v0: a Linux desktop workspace driven like OSWorld's ``DesktopEnv``.

The workspace (image ``osworld``) runs Xvfb, openbox, a terminal (xterm), a text editor
(mousepad), chromium and LibreOffice Calc as user ``user`` (password ``password``).
Actions go to an input server inside the workspace; screenshots are read by the host
straight from the X socket. Tasks are OSWorld task files (see :mod:`.tasks`); the
reward, given at the end of the episode, is the task evaluator's score.

Action spaces (``action_space=``):
    ``"computer_13"``: dicts ``{"action_type": "CLICK", "x": 10, "y": 20, "button": "left",
        "num_clicks": 1}``; types MOVE_TO, CLICK, MOUSE_DOWN, MOUSE_UP, RIGHT_CLICK,
        DOUBLE_CLICK, DRAG_TO, SCROLL (dx, dy), TYPING (text), PRESS (key), KEY_DOWN,
        KEY_UP, HOTKEY (keys), WAIT, FAIL, DONE.
    ``"pyautogui"``: a Python code string using ``pyautogui`` (bunshin's implementation on
        python-xlib; ``import pyautogui`` works), run against the workspace display; or
        one of the strings ``"WAIT"``, ``"FAIL"``, ``"DONE"``.
A malformed action (or one that raises) is reported in ``info["error"]``; the episode goes on.

Observation: ``screenshot`` (uint8 array, height x width x 3), ``accessibility_tree``
(XML text from AT-SPI; "" unless ``require_a11y_tree``), ``terminal`` (the terminal's
transcript; "" unless ``require_terminal``), ``instruction``.

Example:
    >>> import gymnasium as gym, bunshin_gym
    >>> env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False)
    >>> obs, info = env.reset(options={"task": "osworld/terminal-mkdir-projects"})
    >>> obs, reward, terminated, truncated, info = env.step("pyautogui.write('mkdir ~/projects\\\\n')")
    >>> obs, reward, terminated, truncated, info = env.step("DONE")   # reward 1.0
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np
from gymnasium import spaces

from bunshin_gym.config import colon_dirs
from bunshin_gym.core.env import ActionError, WorkspaceEnv, check_text
from bunshin_gym.core.spaces import PrintableText
from bunshin_gym.core.task import TaskError
from bunshin_gym.envs.osworld import desktop, tasks
from bunshin_gym.envs.osworld.tasks import ASSETS_DIR, FileCache, OSWorldTask
from bunshin_gym.envs.osworld.xclient import XScreen
from bunshin_gym.errors import AgentError, ChannelError, WorkspaceError
from bunshin_gym.workspace.protocol import MAX_HEADER, Unreachable

log = logging.getLogger(__name__)

SPECIAL = ("WAIT", "FAIL", "DONE")
ACTION_TYPES = ("MOVE_TO", "CLICK", "MOUSE_DOWN", "MOUSE_UP", "RIGHT_CLICK", "DOUBLE_CLICK", "DRAG_TO", "SCROLL",
                "TYPING", "PRESS", "KEY_DOWN", "KEY_UP", "HOTKEY", *SPECIAL)
BUTTONS = ("left", "right", "middle")
MAX_CODE = 65536
MAX_TEXT = 1 << 20
#: the largest request the input server reads: one frame's JSON header (text in it is
#: escaped, so a TYPING text of MAX_TEXT characters does not fit)
MAX_REQUEST = MAX_HEADER
#: seconds a restarted input server has to answer
RESTART_TIMEOUT = 30.0
#: the terminal transcript counts as settled once unchanged for this long (seconds)
TERMINAL_QUIET_S = 0.15


class Computer13Space(spaces.Space):
    """OSWorld's computer_13 actions: dicts with an ``action_type`` and its parameters."""

    def __init__(self, width: int, height: int, seed: int | None = None):
        super().__init__(None, None, seed)
        self.width, self.height = width, height

    def contains(self, x: Any) -> bool:
        try:
            check_computer_13(x, self.width, self.height)
            return True
        except ActionError:
            return False

    def sample(self, mask: Any = None, probability: Any = None) -> dict:
        r = self.np_random
        kind = ["MOVE_TO", "CLICK", "SCROLL", "TYPING", "PRESS", "HOTKEY", "WAIT"][r.integers(7)]
        x, y = int(r.integers(self.width)), int(r.integers(self.height))
        return {"MOVE_TO": {"action_type": kind, "x": x, "y": y},
                "CLICK": {"action_type": kind, "x": x, "y": y, "button": "left", "num_clicks": 1},
                "SCROLL": {"action_type": kind, "dx": 0, "dy": int(r.integers(-5, 6))},
                "TYPING": {"action_type": kind, "text": "hello"},
                "PRESS": {"action_type": kind, "key": "enter"},
                "HOTKEY": {"action_type": kind, "keys": ["ctrl", "a"]},
                "WAIT": {"action_type": kind}}[kind]

    def __repr__(self) -> str:
        return f"Computer13Space({self.width}x{self.height})"


def _num(a: dict, key: str, lo: float, hi: float, required: bool) -> None:
    if key not in a or a[key] is None:
        if required:
            raise ActionError(f"{a['action_type']} needs {key!r}")
        return
    v = a[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v < hi):
        raise ActionError(f"{a['action_type']}: {key}={v!r} must be a number in [{lo}, {hi})")


def check_computer_13(a: Any, width: int, height: int) -> str:
    """Validate a computer_13 action's shape; returns its type. Raises :class:`ActionError`."""
    if not isinstance(a, dict):
        raise ActionError(f"a computer_13 action is a dict, not {type(a).__name__}")
    kind = a.get("action_type")
    if kind not in ACTION_TYPES:
        raise ActionError(f"unknown action_type {kind!r} (one of {', '.join(ACTION_TYPES)})")
    if kind in ("MOVE_TO", "DRAG_TO"):
        _num(a, "x", 0, width, True)
        _num(a, "y", 0, height, True)
    elif kind in ("CLICK", "RIGHT_CLICK", "DOUBLE_CLICK"):
        if ("x" in a) != ("y" in a):
            raise ActionError(f"{kind}: give both x and y, or neither")
        _num(a, "x", 0, width, False)
        _num(a, "y", 0, height, False)
        if kind == "CLICK":
            _num(a, "num_clicks", 1, 4, False)
    elif kind == "SCROLL":
        _num(a, "dx", -1000, 1001, False)
        _num(a, "dy", -1000, 1001, False)
        if not a.get("dx") and not a.get("dy"):
            raise ActionError("SCROLL needs a non-zero dx or dy")
    elif kind == "TYPING":
        if not isinstance(a.get("text"), str):
            raise ActionError("TYPING needs a string 'text'")
        check_text(a["text"], what="TYPING text", max_bytes=4 * MAX_TEXT)
    elif kind in ("PRESS", "KEY_DOWN", "KEY_UP"):
        if not isinstance(a.get("key"), str) or not a["key"]:
            raise ActionError(f"{kind} needs a string 'key'")
    elif kind == "HOTKEY":
        keys = a.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ActionError("HOTKEY needs a non-empty list of key names 'keys'")
    if "button" in a and a["button"] not in BUTTONS and kind in ("CLICK", "MOUSE_DOWN", "MOUSE_UP"):
        raise ActionError(f"{kind}: button must be one of {BUTTONS}, not {a['button']!r}")
    for key in ("key", "keys"):  # key names travel as text too
        for name in (a.get(key) if isinstance(a.get(key), list) else [a.get(key)]):
            if isinstance(name, str):
                check_text(name, what=f"{kind} {key}", max_bytes=256)
    return kind


#: time the tree asked before the reset snapshot may take (see OSWorldEnv.snapshot)
WARM_TREE_S = 60.0


class OSWorldEnv(WorkspaceEnv):
    """The desktop env (OSWorld-compatible tasks, actions and observations).

    Args:
        task: default task (a shipped id such as ``"osworld/calc-sum-column"``, an OSWorld
            task dict, or a path to a task JSON file).
        action_space: ``"computer_13"`` or ``"pyautogui"``.
        screen_size: (width, height) of the virtual screen.
        require_a11y_tree: include the AT-SPI tree in observations (0.2-3 s per step).
        require_terminal: include the terminal transcript in observations.
        cache_dir: extra directories (searched first) that ``download`` urls resolve from;
            also ``$BUNSHIN_OSWORLD_CACHE`` (colon-separated). The shipped assets come last.
        settle: seconds to wait after an action before the screenshot (OSWorld waits 2 s).
        wait_seconds: how long ``WAIT`` sleeps.
        action_timeout: seconds an action may run in the workspace before it is stopped.
        track_damage: screenshots read only what the X server says was drawn since the last
            one (the same frame as a whole-screen read, under a server grab); False: every
            screenshot reads the whole screen.
        **kwargs: see :class:`~bunshin_gym.core.env.WorkspaceEnv` (image, memory_mode, ...).
    """

    default_image = "osworld"
    #: seconds the X server inside the workspace has for one screenshot's reply (it is not
    #: trusted: a reply is bounded as a whole). 10 s was too short for a whole 1920x1080 frame
    #: (8 MB) at the paper's size on 2 cores: at load 20 one came 7.8 of 8.3 MB in, and the
    #: episode ended on a live workspace ("the workspace failed"), its reward lost
    SCREENSHOT_TIMEOUT_S = 30.0

    def __init__(self, task: Any = None, *, action_space: str = "computer_13",
                 screen_size: tuple[int, int] = (1920, 1080), require_a11y_tree: bool = True,
                 require_terminal: bool = False, cache_dir: str | list[str] | None = None,
                 settle: float = 0.0, wait_seconds: float = 1.0, action_timeout: float = 60.0,
                 track_damage: bool = True, **kwargs: Any):
        super().__init__(task, **kwargs)
        if action_space not in ("computer_13", "pyautogui"):
            raise ValueError(f"action_space must be 'computer_13' or 'pyautogui', not {action_space!r}")
        self.action_space_name = action_space
        self.screen_size = (int(screen_size[0]), int(screen_size[1]))
        self.require_a11y_tree = require_a11y_tree
        self._tree_cold = False  # see snapshot
        self.require_terminal = require_terminal
        self.settle = settle
        self.track_damage = track_damage
        self.wait_seconds = wait_seconds
        self.action_timeout = action_timeout
        extra = [cache_dir] if isinstance(cache_dir, (str, os.PathLike)) else list(cache_dir or [])
        extra += colon_dirs("BUNSHIN_OSWORLD_CACHE")
        self.cache = FileCache([*extra, ASSETS_DIR])
        w, h = self.screen_size
        text = PrintableText(MAX_TEXT, min_length=0, controls="\n\t\r")
        self.observation_space = spaces.Dict({
            "screenshot": spaces.Box(0, 255, (h, w, 3), np.uint8),
            "accessibility_tree": text,
            "terminal": text,
            "instruction": text,
        })
        self.action_space = (Computer13Space(w, h) if action_space == "computer_13"
                             else PrintableText(MAX_CODE, min_length=1, controls="\n\t\r"))
        self._x: XScreen | None = None
        self._input: desktop.DesktopClient | None = None
        self.history: list[Any] = []
        self.setup_log: list[dict] = []
        self.eval_dir: str | None = None  # set by the evaluator while it runs

    # hooks -----------------------------------------------------------------------------
    def load_task(self, spec: Any) -> OSWorldTask:
        return tasks.load_task(spec)

    def boot_config(self) -> dict:
        return {"screen_size": self.screen_size}

    def boot(self, ws: Any) -> None:
        desktop.boot_desktop(ws, *self.screen_size)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.history, self.setup_log = [], []
        # the task's apps have not been asked for their tree yet: the reset snapshot is taken
        # after one tree (see snapshot)
        self._tree_cold = self.require_a11y_tree
        obs, info = super().reset(seed=seed, options=options)
        if self.setup_log:
            info["setup_log"] = list(self.setup_log)
        return obs, info

    def execute(self, action: Any) -> dict:
        special = self._special(action)
        self.history.append(action)
        if special is not None:
            if special == "WAIT":
                time.sleep(self.wait_seconds)
            else:
                self.done = True
            return {"action": special}
        if self.action_space_name == "pyautogui":
            if not isinstance(action, str):
                raise ActionError("a pyautogui action is a code string (or WAIT/FAIL/DONE), "
                                  f"not {type(action).__name__}")
            check_text(action, what="pyautogui code", max_bytes=4 * MAX_CODE)
            if len(action) > MAX_CODE:
                raise ActionError(f"pyautogui code is {len(action)} characters, over the limit of {MAX_CODE}")
            if not action.strip():
                raise ActionError("empty pyautogui code")
            req = {"op": "pyautogui", "code": action, "timeout": self.action_timeout}
        else:
            check_computer_13(action, *self.screen_size)
            req = {"op": "computer_13", "action": action, "timeout": self.action_timeout}
        size = len(json.dumps(req))
        if size > MAX_REQUEST:
            raise ActionError(f"the action is {size} bytes as a request, over the input server's frame of "
                              f"{MAX_REQUEST} bytes (non-ASCII text takes up to 12 bytes a character there)")
        reply = self._run_action(req)
        if self.settle:
            time.sleep(self.settle)
        self.record_timing(action_s=reply.get("duration", 0.0))
        if "error" in reply:
            raise ActionError(reply["error"])
        return {"output": reply["output"]} if reply.get("output") else {}

    def _run_action(self, req: dict) -> dict:
        """Send an action to the input server, which is restarted if it is dead or hangs. An
        action that never reached a server (it was found dead) is sent to the new one; one
        that did may have run, and is not sent again."""
        for attempt in (0, 1):
            try:
                return self._client().request(req, timeout=self.action_timeout + 10)
            except ChannelError as e:
                # no connection; a broken pipe on sending; or a reset, which a unix socket gets
                # when its peer closed with our request unread (one that read it and died
                # gives end-of-file): in each case no server read the request
                never_sent = isinstance(e.__cause__, (Unreachable, BrokenPipeError, ConnectionResetError))
                # dead (os._exit, a crash) or hung (the action ignored SIGALRM): the effects
                # so far stay; the server is replaced and the episode goes on
                why = self.input_server_postmortem()
                log.warning("%s: the desktop input server broke on %s (%s); %s", self.workspace.id,
                            req.get("op"), e, why)
                self.restart_input_server()
                if not never_sent or attempt == 1:
                    raise ActionError(f"the action broke the desktop input server ({e}; {why}); "
                                      "it was restarted") from None
                log.warning("%s: the desktop input server was gone (%s); restarted, sending the action to it",
                            self.workspace.id, e)
        raise AssertionError("unreachable")

    def input_server_postmortem(self) -> str:
        """What is known of a server that dropped a request: whether it still runs, the
        workspace's out-of-memory kills, and its log's last lines (for the error and the log)."""
        ws = self.workspace
        try:
            alive = ws.exec(["pgrep", "-f", f"^python3 {desktop.OPT}/desktop_server.py"], timeout=10).text.split()
            oom = ws.limit_state().get("oom_kill", 0)
            tail = ws.exec(["tail", "-c", "600", f"{desktop.STATE}/desktop_server.log"], timeout=10).text.strip()
        except WorkspaceError as e:
            return f"no post-mortem: {e}"
        state = f"server pid {', '.join(alive)} still runs" if alive else "the server is gone"
        return f"{state}; out-of-memory kills so far {oom}; its log ends: {tail[-400:]!r}"

    def restart_input_server(self) -> None:
        """Replace the workspace's input server (killed first if it still runs) and wait until
        the new one answers. A :class:`WorkspaceError` if the workspace itself does not."""
        ws = self.workspace
        if self._input is not None:
            self._input.close()
            self._input = None
        # by its program path, inside the workspace's own pid namespace: nothing else runs it
        ws.exec(["pkill", "-KILL", "-f", f"^python3 {desktop.OPT}/desktop_server.py"], timeout=10)
        desktop.session_spawn(ws, ["python3", f"{desktop.OPT}/desktop_server.py"],
                              log=f"{desktop.STATE}/desktop_server.log")
        client = self._client()
        deadline = time.monotonic() + RESTART_TIMEOUT
        while not client.ping():
            if time.monotonic() > deadline:
                tail = ws.exec(["tail", "-n", "20", f"{desktop.STATE}/desktop_server.log"], timeout=10).text
                raise WorkspaceError(f"{ws.id}: the desktop input server did not come back within "
                                     f"{RESTART_TIMEOUT:.0f} s; its log:\n{tail}")
            time.sleep(0.05)
        log.info("%s: desktop input server restarted", ws.id)

    def _special(self, action: Any) -> str | None:
        if isinstance(action, str) and action.strip() in SPECIAL:
            return action.strip()
        if isinstance(action, dict) and action.get("action_type") in SPECIAL \
                and self.action_space_name == "computer_13":
            return action["action_type"]
        return None

    def observe(self) -> dict:
        screenshot = self.screenshot()
        tree = ""
        if self.require_a11y_tree:
            t0 = time.perf_counter()
            tree = self.accessibility_tree()
            self.record_timing(tree_s=time.perf_counter() - t0)  # the part of a step users ask about most
        return {
            "screenshot": screenshot,
            "accessibility_tree": tree,
            "terminal": self.terminal_output() if self.require_terminal else "",
            "instruction": self.task.instruction if self.task else "",
        }

    def snapshot(self, *, keep: bool = False, **tags: Any) -> Any:
        """As :meth:`WorkspaceEnv.snapshot`; with ``require_a11y_tree``, a state whose apps
        have not been asked for their tree since the task's set-up (the reset snapshot) is
        asked once first. An app makes its accessible objects when first asked (Calc: 3-5 s
        for the Calc task, 1008 cell objects); asked before the snapshot, they are in it, and
        the first tree of the reset observation, of every rollback to it and of every clone
        of it costs what any later one does. Asking changes nothing the agent sees."""
        with self._lock:
            if self._tree_cold and self._ws is not None:
                self._tree_cold = False
                try:  # given time: an app asked for the first time answers slowly on a busy host
                    self._client().a11y_tree(WARM_TREE_S, reply_timeout=WARM_TREE_S / 2)
                except WorkspaceError as e:  # the observation will say what is wrong; the snapshot goes on
                    log.warning("%s: no tree before the snapshot: %s", self.workspace.id, e)
            return super().snapshot(keep=keep, **tags)

    def release_connections(self) -> None:
        if self._x is not None:
            self._x.close()
        if self._input is not None:
            self._input.close()

    def episode_state(self) -> dict:
        return {"history": list(self.history)}

    def restore_episode_state(self, state: dict) -> None:
        self.history = list(state.get("history", []))
        # a clone or a rolled-back env talks to its own workspace: fresh clients, lazily
        self._x, self._input = None, None

    # observations and helpers -----------------------------------------------------------
    @property
    def last_action(self) -> str | None:
        """The last action if it was WAIT/FAIL/DONE (as a string), else None."""
        return self._special(self.history[-1]) if self.history else None

    def _client(self) -> desktop.DesktopClient:
        if self._input is None or self._input.ws is not self.workspace:
            self._input = desktop.DesktopClient(self.workspace)
        return self._input

    def screenshot(self) -> np.ndarray:
        """The screen now, as an RGB uint8 array (read from the X socket)."""
        path = desktop.sock_path(self.workspace, desktop.X_SOCKET)
        if self._x is None or self._x.path != path or self._x.damage != self.track_damage:
            if self._x is not None:
                self._x.close()
            self._x = XScreen(path, damage=self.track_damage, timeout=self.SCREENSHOT_TIMEOUT_S)
        try:
            return self._x.capture()
        except OSError as e:  # XError too: the X server is inside the workspace and may misbehave
            self._x.close()
            raise ChannelError(f"{self.workspace.id}: the X display at {path}: {e}") from e

    def screenshot_damage(self, old: np.ndarray, new: np.ndarray) -> list[tuple[int, int, int, int]] | None:
        """What was drawn between two screenshots this env returned, ``old`` first: the
        rectangles ``(x, y, w, h)`` outside which ``new`` equals ``old`` (from the X server's
        damage, see :meth:`~bunshin_gym.envs.osworld.xclient.XScreen.damage_between`); None when
        that is not known (not recent, read on another connection, or whole-screen reads)."""
        return self._x.damage_between(old, new) if self._x is not None else None

    def accessibility_tree(self, walker: str = "fast", seconds: float = 8.0, process: bool = False) -> str:
        """The AT-SPI tree as XML (the X window tree if AT-SPI does not answer).

        ``walker``: "fast" (batched D-Bus calls) or "old" (one libatspi call at a time; the
        same XML, kept for comparison); ``seconds``: the walk stops after this long. The fast
        walker runs in the desktop's input server, which saves a process start a step; with
        ``process``, or if it fails there, it runs as a process of its own (which falls back
        to the old walker, then to the window tree)."""
        if walker not in ("fast", "old"):
            raise ValueError(f"walker must be 'fast' or 'old', not {walker!r}")
        self._tree_cold = False
        if walker == "fast" and not process:
            try:
                return self._client().a11y_tree(seconds)
            except WorkspaceError as e:  # ChannelError included: the next action restarts a dead server
                log.warning("%s: %s; dumping the tree as a process", self.workspace.id, e)
        res = self.workspace.exec(["python3", f"{desktop.OPT}/a11y_dump.py", "--walker", walker,
                                   "--seconds", str(float(seconds))], user=desktop.USER,
                                  env=desktop.DESKTOP_ENV, timeout=max(30.0, seconds + 20))
        return res.text

    def terminal_output(self) -> str:
        """What the terminal shows once it is quiet: its transcript, escape sequences removed
        (last 16 kB). Typed keys reach the shell, and its echo xterm's log, some milliseconds
        after the action returns: the transcript is read until it stays the same for
        TERMINAL_QUIET_S (at most 2 s), so an observation does not depend on that race."""
        try:
            raw = self.workspace.read_file(desktop.TERMINAL_LOG)
        except Exception:  # noqa: BLE001 - no terminal
            return ""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(TERMINAL_QUIET_S)
            try:
                again = self.workspace.read_file(desktop.TERMINAL_LOG)
            except AgentError:  # replaced meanwhile (by a FIFO, a device: refused): keep what was read
                break
            if again == raw:
                break
            raw = again
        return desktop.terminal_text(raw[-65536:])

    def workspace_spawn(self, cmd: str | list[str]) -> int:
        """Start a program in the desktop session (config ``launch``/``open``)."""
        return desktop.session_spawn(self.workspace, cmd, log=f"{desktop.STATE}/apps.log")

    def oracle(self) -> list:
        """The current task's scripted solution (pyautogui actions)."""
        if self.task is None or not self.task.oracle():
            raise TaskError(f"task {self.task.id if self.task else None} has no oracle")
        return list(self.task.oracle())


def shipped_task_ids() -> list[str]:
    return list(tasks.task_paths())

