"""Bunshin-Shell-v0: a terminal workspace. Actions are shell commands, observations their output.

Task format (JSON, ``envs/shell/tasks/*.json``)::

    {"id": "shell/count-files",
     "instruction": "Write the number of files in /data to /home/user/answer.txt",
     "setup": ["mkdir -p /data", "touch /data/a /data/b"],   # run as root before the episode
     "check": "test \\"$(cat /home/user/answer.txt)\\" = 2",   # exit 0 = success (reward 1)
     "max_steps": 10,
     "oracle": ["ls /data | wc -l > /home/user/answer.txt", "DONE"]}

Actions run as ``user`` in ``/home/user`` (as in OSWorld). ``DONE`` ends the episode and
``FAIL`` gives up; both are then scored by the checker.

The checker does not run inside the workspace, where a policy with sudo could have replaced
``test``, ``wc`` or ``sqlite3``: it runs on the host with the image's own binaries over a
read-only view of the workspace's files (:mod:`bunshin_gym.workspace.pristine`), in
``/home/user``, as ``nobody`` allowed to read every file, with no ``$HOME`` and no network.
A checker can compare the workspace's files with values or with the image's files
(``/usr/...`` is always the image's), but cannot use software the episode installed.

Each workspace has memory, process and disk limits (``limits=``, see
:class:`~bunshin_gym.config.Limits`); a command that hits one gets a ``[bunshin: ...]`` line
at the end of its output naming the limit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from bunshin_gym.core.env import ActionError, WorkspaceEnv, check_text, printable
from bunshin_gym.core.spaces import PRINTABLE, PrintableText
from bunshin_gym.core.task import Task, TaskError, check_max_steps, field, identify, read_task_file
from bunshin_gym.workspace import pristine
from bunshin_gym.workspace.workspace import disk_full_in, limits_hit

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"
#: printable text: every character a command or its output may carry
CHARSET = PRINTABLE + "\n\t"
_CONTROL = {c: None for c in range(32) if c not in (9, 10)} | {0x7F: None}
MAX_ACTION = 8192
#: a command of MAX_ACTION characters is at most this many bytes of UTF-8
MAX_ACTION_BYTES = 4 * MAX_ACTION
MAX_OUTPUT = 16384
SPECIAL = ("DONE", "FAIL")


def clean_text(raw: bytes, limit: int) -> str:
    """Decode command output for an observation: control characters dropped, the tail kept."""
    text = raw.decode(errors="replace").translate(_CONTROL)
    # "?" for what the observation space's charset lacks (U+FFFD, from undecodable bytes, too)
    text = "".join(c if c in _CHARS else "?" for c in text) if not text.isascii() else text
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


_CHARS = frozenset(CHARSET)


class ShellTask(Task):
    """A shell task: set-up commands and a checker command (exit 0 = success)."""

    def __init__(self, config: dict, source: str | None = None):
        config, where = identify(config, "shell", source)
        task_id = field(config, "id", str, where, required=True)
        instruction = field(config, "instruction", str, where, required=True)
        self.check: str = field(config, "check", str, where, required=True)
        self.setup_cmds: list[str] = list(field(config, "setup", list, where, default=[], items=str))
        field(config, "oracle", list, where, items=str)
        super().__init__(task_id, instruction, check_max_steps(config.get("max_steps", 10), where), config)

    def setup(self, env: ShellEnv) -> None:
        for cmd in self.setup_cmds:
            res = env.workspace.exec(cmd, timeout=60)
            if not res.ok:
                raise TaskError(f"task {self.id}: set-up command {cmd!r} failed ({res.exit_code}): "
                                f"{res.stderr.decode(errors='replace')[-500:]}")

    def validate(self, env: ShellEnv) -> float:
        """Run the checker over the workspace's files with the image's own binaries, outside the
        workspace (:mod:`bunshin_gym.workspace.pristine`): a policy with sudo may have replaced
        ``/usr/bin/wc`` or ``sqlite3`` inside, and those must not decide its reward."""
        ws = env.workspace
        if not hasattr(ws, "_rec"):  # a test double without layers: it has no binaries to replace
            return 1.0 if ws.exec(self.check, timeout=60, cwd="/home/user").exit_code == 0 else 0.0
        res = pristine.run(ws, self.check, cwd="/home/user", timeout=60)
        if res.exit_code != 0 and res.stderr:
            log.info("task %s: checker exited %d: %s", self.id, res.exit_code,
                     res.stderr.decode(errors="replace")[-300:])
        return 1.0 if res.ok else 0.0


def load_shell_task(spec: Any) -> ShellTask:
    """A task id (``shell/NAME``, looked up in ``envs/shell/tasks``), a dict, or a JSON path."""
    if isinstance(spec, ShellTask):
        return spec
    if isinstance(spec, dict):
        return ShellTask(spec)
    path = Path(str(spec))
    if not path.suffix == ".json":
        path = TASKS_DIR / f"{str(spec).removeprefix('shell/')}.json"
    if not path.exists():
        known = ", ".join(sorted(f"shell/{p.stem}" for p in TASKS_DIR.glob("*.json")))
        raise TaskError(f"no shell task {spec!r}; shipped tasks: {known}")
    return ShellTask(read_task_file(path), source=str(path))


def shipped_tasks() -> list[ShellTask]:
    return [ShellTask(read_task_file(p), source=str(p)) for p in sorted(TASKS_DIR.glob("*.json"))]


class ShellEnv(WorkspaceEnv):
    """A terminal workspace (image ``base``).

    Observation: ``{"instruction": str, "output": str (stdout+stderr, tail-truncated),
    "exit_code": int (-1 before the first command, -9 for a timeout)}``.
    Action: a shell command line, or ``DONE`` / ``FAIL``.

    Args:
        command_timeout: seconds before a command is killed (the episode goes on).
        **kwargs: see :class:`~bunshin_gym.core.env.WorkspaceEnv`.
    """

    default_image = "base"

    def __init__(self, task: Any = None, *, command_timeout: float = 30.0, **kwargs: Any):
        super().__init__(task, **kwargs)
        self.command_timeout = command_timeout
        text = PrintableText(MAX_OUTPUT, min_length=0)
        self.observation_space = spaces.Dict({
            "instruction": text,
            "output": text,
            "exit_code": spaces.Discrete(512, start=-256),
        })
        self.action_space = PrintableText(MAX_ACTION, min_length=1)
        self._output, self._exit_code = "", -1

    def load_task(self, spec: Any) -> ShellTask:
        return load_shell_task(spec)

    def execute(self, action: Any) -> dict:
        try:
            cmd = check_text(action, what="a shell command", max_bytes=MAX_ACTION_BYTES).strip()
            if len(action) > MAX_ACTION:
                raise ActionError(f"a shell command is {len(action)} characters, over the limit of {MAX_ACTION}")
        except ActionError as e:
            self._output, self._exit_code = printable(f"error: {e}", MAX_OUTPUT), -1
            raise
        if cmd in SPECIAL:
            self.done = True
            self._output, self._exit_code = "", 0
            return {"action": cmd}
        if not cmd:
            self._output, self._exit_code = "error: empty command", -1
            raise ActionError(self._output)
        ws = self.workspace
        watch = hasattr(ws, "limit_state")  # a test double may not model limits
        before = ws.limit_state(disk=False) if watch else None
        res = ws.exec(cmd, timeout=self.command_timeout, user="user", cwd="/home/user")
        out = res.stdout + res.stderr
        notes = limits_hit(before, ws.limit_state(disk=disk_full_in(out)), ws.limits, out) if watch else []
        # the notes go last, so that the tail-keeping cut never drops them
        tail = "".join(f"\n[bunshin: {n}]" for n in notes)
        self._output = clean_text(res.stdout + res.stderr, MAX_OUTPUT - len(tail)) + tail
        self._exit_code = -9 if res.timed_out else max(-256, min(255, res.exit_code))
        self.record_timing(command_s=res.duration)
        info = {"exit_code": self._exit_code, "timed_out": res.timed_out}
        if notes:
            info["limit"] = notes
        return info

    def observe(self) -> dict:
        return {
            "instruction": self.task.instruction if self.task else "",
            "output": self._output,
            "exit_code": np.int64(self._exit_code),
        }

    def error_observation(self, message: str) -> dict:
        return {"instruction": self.task.instruction if self.task else "", "output": message[-MAX_OUTPUT:],
                "exit_code": np.int64(-1)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._output, self._exit_code = "", -1
        return super().reset(seed=seed, options=options)

    def episode_state(self) -> dict:
        return {"output": self._output, "exit_code": self._exit_code}

    def restore_episode_state(self, state: dict) -> None:
        self._output, self._exit_code = state.get("output", ""), state.get("exit_code", -1)
