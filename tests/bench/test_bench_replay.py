"""``replay_group`` (what ``bunshin bench epoch`` and ``bunshin bench rollout`` run for each
group) on the real shell env: a member whose workspace is killed under it is reported with
the error, its episode ends with reward 0, and its siblings play on untouched."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from bunshin_gym.bench.rollout import replay_group
from bunshin_gym.config import paths
from bunshin_gym.envs.shell.env import load_shell_task
from bunshin_gym.workspace import records

TASK = "shell/count-files"
MARK = "home/user/whoami"


def _kill_the_marked_workspace(stop: threading.Event, killed: list[str]) -> None:
    """Kill PID 1 of the first workspace of this process whose files hold the mark (the test
    cannot reach the env's workspaces otherwise: replay_group makes and closes them)."""
    me = os.getpid()
    while not stop.is_set():
        for rec in records.all_records(paths()):
            if rec.owner == me and rec.running() and (Path(rec.subvolume) / "upper" / MARK).exists():
                os.kill(rec.pid1, signal.SIGKILL)
                killed.append(rec.id)
                return
        time.sleep(0.05)


def test_a_member_whose_workspace_is_killed_is_reported_and_its_siblings_play_on():
    oracle = list(load_shell_task(TASK).oracle())  # its calls, then DONE
    assert oracle[-1] == "DONE"
    rec = {"epoch": 0, "task": TASK, "members": [
        {"actions": oracle, "think": [0.05] * len(oracle)},
        # the mark, then time for the watcher to kill the workspace before the next call
        {"actions": [f"echo 1 > /{MARK}", *oracle], "think": [0.05, 3.0] + [0.05] * (len(oracle) - 1)},
    ]}
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_the_marked_workspace, args=(stop, killed))
    watcher.start()
    try:
        out = replay_group(rec, 2, None, None, None, env_id="Bunshin-Shell-v0", kind="shell")
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 1
    (reward0, _, kinds0, _, failure0), (reward1, _, kinds1, _, failure1) = out
    assert (reward0, failure0) == (1.0, None)
    assert kinds0 == ["executed"] * len(oracle)
    assert reward1 == 0.0 and failure1 and killed[0] in failure1 and "no longer running" in failure1, out
    assert len(kinds1) == 2  # the mark, then the call that found the workspace dead: the episode ended
    assert not [r.id for r in records.all_records(paths()) if r.owner == os.getpid()]  # nothing left
