"""Tuning ksmd up while KSM-mergeable clones run (the ``ksm`` mode, and ``share`` where KSM
serves or helps it), and restoring its settings after the last one.

Users are workspace ids kept in ``$BUNSHIN_RUN/ksm.json`` under a file lock, so that every
controller process on the host shares one count.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from bunshin_gym.config import paths

KSM = Path("/sys/kernel/mm/ksm")
KSM_TUNED = {"run": "1", "pages_to_scan": "4000", "sleep_millisecs": "10"}


@contextlib.contextmanager
def _ksm_state() -> Iterator[dict]:
    run = paths().run
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "ksm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        f = run / "ksm.json"
        before = f.read_text() if f.exists() else ""
        state = json.loads(before) if before else {"saved": None, "users": []}
        yield state
        if json.dumps(state) != before:  # every reclaim releases; most were never users
            f.write_text(json.dumps(state))


def ksm_acquire(user: str) -> None:
    """Tune ksmd up while at least one KSM clone runs (values saved for :func:`ksm_release`)."""
    if not KSM.exists():
        return
    with _ksm_state() as st:
        if not st["users"]:
            st["saved"] = {k: (KSM / k).read_text().strip() for k in KSM_TUNED}
            for k, v in KSM_TUNED.items():
                (KSM / k).write_text(v)
        if user not in st["users"]:
            st["users"].append(user)


def ksm_release(user: str, live: set[str] | None = None) -> None:
    """Drop a user (and, given ``live``, every user not in it); the last one restores ksmd."""
    if not KSM.exists():
        return
    with _ksm_state() as st:
        st["users"] = [u for u in st["users"] if u != user and (live is None or u in live)]
        if not st["users"] and st["saved"]:
            for k in ("sleep_millisecs", "pages_to_scan", "run"):
                (KSM / k).write_text(st["saved"][k])
            st["saved"] = None


def ksmd_cpu_seconds() -> float:
    """CPU time ksmd has used since boot."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat.split(" ", 2)[1] == "(ksmd)":
                fields = stat.rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0
