"""A workspace runs at ``BUNSHIN_WS_NICE`` (default 0), whatever the niceness of the thread that
makes it: a Ray worker runs at nice 15, and a cluster host's workspaces (their init, agent and
every program an action started) used to run their whole lives at 15, losing the CPU to any work
at 0 beside them. Clones keep their snapshot's niceness (CRIU restores it), so what counts is
what a workspace is launched with."""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

import pytest
from conftest import leftovers

from bunshin_gym import config
from bunshin_gym.workspace import Workspace, records


def nice_of(pid: int | str) -> int:
    # /proc/PID/stat: the 19th field; the name (2nd) may hold spaces, so split after its ')'
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def niceness(ws: Workspace) -> set[int]:
    """The nice values of every process of ``ws``, of one an action starts, and of the uffd
    monitor serving its faults or tracking its writes (a clone's)."""
    started = int(ws.exec("cut -d' ' -f19 /proc/self/stat", check=True).text)
    monitor = records.load(ws.id).uffd
    helpers = {nice_of(monitor.guard), nice_of(monitor.worker)} if monitor is not None else set()
    return {nice_of(pid) for pid in ws.pids()} | {started} | helpers


def in_thread_at(nice: int, fn):
    """``fn()`` in a thread running at ``nice`` (niceness is per thread on Linux, as Ray's are)."""
    out: dict = {}

    def run():
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # 0: the calling thread
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def make_and_fork(mode: str):
    ws = Workspace.create("base")
    try:
        ws.spawn("sleep 1000")
        snap = ws.snapshot()
        return ws, snap, snap.fork(1, mode=mode)[0]
    except BaseException:
        ws.close()
        raise


@pytest.mark.parametrize("mode", ["share", "copy"])
def test_a_niced_maker_still_makes_workspaces_and_clones_at_nice_0(mode):
    ws, snap, clone = in_thread_at(12, lambda: make_and_fork(mode))
    try:
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # this thread was never niced
        assert niceness(ws) == {0}
        assert niceness(clone) == {0}
        assert records.load(clone.id).uffd is not None  # its monitor was counted (share: faults; copy: writes)
        # a clone forked by a thread at 0 keeps its snapshot's niceness, not its maker's
        again = snap.fork(1, mode=mode)[0]
        try:
            assert niceness(again) == {0}
        finally:
            again.close()
    finally:
        clone.close()
        snap.delete()
        ws.close()


def test_the_setting_is_applied_and_kept_by_clones(monkeypatch):
    monkeypatch.setenv("BUNSHIN_WS_NICE", "5")
    ws, snap, clone = make_and_fork("share")
    try:
        assert niceness(ws) == {5} and niceness(clone) == {5}
    finally:
        clone.close()
        snap.delete()
        ws.close()


@pytest.mark.parametrize("bad", ["high", "20", "-21", "1.5"])
def test_a_bad_setting_is_a_clear_error_and_leaves_nothing(monkeypatch, bad):
    monkeypatch.setenv("BUNSHIN_WS_NICE", bad)
    with pytest.raises(ValueError, match="BUNSHIN_WS_NICE"):
        config.workspace_nice()
    ws_id = f"ws-test-{secrets.token_hex(3)}"
    with pytest.raises(ValueError, match=f"BUNSHIN_WS_NICE={bad!r}"):
        Workspace.create("base", ws_id=ws_id)
    assert leftovers([ws_id]) == {}


def dumping_criu(pid1: int) -> int | None:
    """The pid of a running ``criu dump -t pid1``, if any."""
    want = f"dump\0-t\0{pid1}\0".encode()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if want in cmdline and os.path.basename(cmdline.split(b"\0", 1)[0]) == b"criu":
                return int(d)
    return None


def test_a_niced_maker_dumps_at_the_workspaces_niceness(fresh_ws):
    """The workspace is frozen while CRIU dumps it: CRIU runs at the workspace's niceness."""
    fresh_ws.exec("head -c 200M /dev/zero | tr '\\0' x > /dev/shm/fill", check=True)  # a dump worth catching
    seen: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            criu = dumping_criu(fresh_ws.pid)
            if criu is not None:
                try:
                    seen.append(nice_of(criu))
                except OSError:
                    pass
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        snap = in_thread_at(12, fresh_ws.snapshot)
    finally:
        done.set()
        watcher.join()
    snap.delete()
    assert seen and set(seen) == {0}, seen
