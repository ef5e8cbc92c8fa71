"""BunshinFork, failures: a CRIU dump failure leaves the source running (thawed) and raises
ForkError naming the CRIU log; killing a clone never affects its siblings, its source or
its snapshot."""

from __future__ import annotations

import os
import re
import select
import signal
import time
from pathlib import Path

import pytest
from fork_programs import host
from fork_programs.host import DIR, heap, sh

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.errors import ForkError

PORT = 7200


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], timeout)[0], f"pid {pid} still alive after {timeout}s"
    finally:
        os.close(fd)


def _dump_log(err: ForkError) -> Path:
    m = re.search(r"log: ([^\s;]+)", str(err))
    assert m, f"the ForkError names no log: {err}"
    return Path(m.group(1))


def test_criu_dump_failure_leaves_source_running_and_names_the_log():
    ws = Workspace.create("base")
    logs: list[Path] = []
    snap = None
    clones = []
    try:
        host.install(ws, "undumpable_hold.py")
        host.heap_start(ws, PORT, 8, "fail")
        sh(ws, "echo kept > /root/kept")
        ws.spawn(["python3", f"{DIR}/undumpable_hold.py", "/tmp/hold.ready"], log="/tmp/hold.log")
        ready = host.wait_file(ws, "/tmp/hold.ready").split()
        assert ready[0] != "error", f"no vsock socket in the workspace (errno {ready[1]})"
        hold_pid = int(ready[0])
        assert os.readlink(f"/proc/{host.host_pid_of(ws, hold_pid)}/fd/{ready[1]}").startswith("socket:")
        before = set(os.listdir(paths().snapshots))

        for attempt in (ws.snapshot, lambda: ws.fork(2)):
            t = time.perf_counter()
            with pytest.raises(ForkError) as ei:
                attempt()
            print(f"\nfailed snapshot took {time.perf_counter() - t:.3f} s: {ei.value}")
            log = _dump_log(ei.value)
            logs.append(log)
            assert ws.id in str(ei.value) and "CRIU dump" in str(ei.value)
            assert log.is_file(), f"the named CRIU log {log} does not exist"
            assert re.search(r"[Uu]nsupported|family", log.read_text(errors="replace")), \
                "the log does not show what CRIU could not dump"
            # the source is thawed, running and unchanged
            assert not host.frozen(ws), "the source stayed frozen after the failed dump"
            assert heap(ws, PORT, "incr") == str(len(logs))
            assert ws.read_file("/root/kept") == b"kept\n"
            assert any("undumpable_hold.py" in r for r in host.proc_tree(ws))
            # nothing half-made is left in the snapshot store (ephemeral fork snapshot included)
            snap_id = log.name.removesuffix("-dump.log")
            assert not (paths().snapshots / snap_id).exists(), f"partial snapshot {snap_id} left behind"
        assert not {d for d in set(os.listdir(paths().snapshots)) - before
                    if (paths().snapshots / d / "meta.json").exists()
                    and f'"workspace": "{ws.id}"' in (paths().snapshots / d / "meta.json").read_text()}

        # without the undumpable fd, the same workspace snapshots and forks fine
        sh(ws, f"kill {hold_pid}")
        snap = ws.snapshot()
        clones = snap.fork(1)
        assert heap(clones[0], PORT, "get") == "2" and clones[0].read_file("/root/kept") == b"kept\n"
    finally:
        host.close_all(clones, ws)
        for log in logs:
            log.unlink(missing_ok=True)
        if snap is not None:
            snap.delete()


@pytest.mark.parametrize("mode", ["share", "map-anon"])
def test_killing_a_clone_never_affects_siblings_source_or_snapshot(mode):
    from conftest import leftovers

    ws = Workspace.create("base", memory_mode=mode)
    clones, snap = [], None
    try:
        host.heap_start(ws, PORT, 32, "kill")
        sh(ws, "echo src > /root/who")
        snap = ws.snapshot()
        clones = snap.fork(3)
        want = host.heap_expected(32, "kill")
        victim, *siblings = clones
        for i, c in enumerate(siblings):
            sh(c, f"echo sibling{i} > /root/who")

        # SIGKILL the victim's PID 1 from the host: its whole pid namespace dies
        os.kill(victim.pid, signal.SIGKILL)
        _wait_gone(victim.pid)
        for i, c in enumerate(siblings):
            assert heap(c, PORT, "sha") == want and c.read_file("/root/who") == f"sibling{i}\n".encode()
        assert heap(ws, PORT, "sha") == want and ws.read_file("/root/who") == b"src\n"
        assert sorted(snap.users()["clones"]) == sorted(c.id for c in siblings)
        victim.close()  # reclaiming a dead clone works and touches nothing else
        assert not leftovers([victim.id]), leftovers([victim.id])

        # an orderly close of another clone
        siblings[0].close()
        assert not leftovers([siblings[0].id])
        assert heap(siblings[1], PORT, "sha") == want

        # the snapshot still forks, and a new clone has the snapshot's state
        [late] = snap.fork(1)
        clones.append(late)
        assert heap(late, PORT, "sha") == want and late.read_file("/root/who") == b"src\n"

        # killing the SOURCE does not touch its clones either
        os.kill(ws.pid, signal.SIGKILL)
        _wait_gone(ws.pid)
        for c in (siblings[1], late):
            assert heap(c, PORT, "incr") == "1"
            assert heap(c, PORT, "sha") == want
    finally:
        host.close_all(clones, ws)
    assert not leftovers([ws.id, *(c.id for c in clones)])
    if snap is not None:
        snap.delete()


def test_a_clone_that_fails_to_start_mid_fan_out_leaves_nothing_and_the_source_runs(monkeypatch):
    """The clones of a fork start side by side (records, cgroups, files, restores): when one
    fails to start (its file system: an injected ENOSPC on the third), the restores that did
    start are stopped and reaped, every clone's record, subvolume and cgroup is gone, the
    error is raised, and the source and the snapshot are as they were (a later fork works)."""
    import threading

    from bunshin_gym.workspace import forking, records
    from bunshin_gym.workspace.cgroups import Cgroup

    ws = Workspace.create("base", memory_mode="share")
    snap = None
    try:
        ws.write_file("/root/kept", "kept\n")
        snap = ws.snapshot()
        subvols_before = set(os.listdir(paths().workspaces))
        real, calls, lock = forking.pool.snapshot_subvolume, [], threading.Lock()

        def third_fails(src, dst, readonly=False):
            with lock:
                calls.append(dst)
                n = len(calls)
            if n == 3:
                raise OSError(28, "No space left on device (injected)", str(dst))
            return real(src, dst, readonly)

        monkeypatch.setattr(forking.pool, "snapshot_subvolume", third_fails)
        with pytest.raises(ForkError, match="OSError: .*injected"):
            snap.fork(6)
        monkeypatch.undo()
        assert len(calls) == 6  # the other clones were started: they are what must be cleaned up
        left = [r.id for r in records.all_records() if r.snapshot == snap.id]
        assert not left, f"records left: {left}"
        # its clones' subvolumes (the pool's listing also shows other sessions' new workspaces)
        assert not [p.name for p in calls if p.exists()]
        assert {p.name for p in calls} & set(os.listdir(paths().workspaces)) - subvols_before == set()
        assert not [p.name for p in calls if Cgroup(p.name).exists()]
        assert ws.exec("cat /root/kept").text == "kept\n"
        [clone] = snap.fork(1)
        try:
            assert clone.exec("cat /root/kept").text == "kept\n"
        finally:
            clone.close()
    finally:
        ws.close()
        if snap is not None:
            snap.delete()


def test_an_os_error_in_a_fork_is_a_fork_error_naming_the_snapshot(monkeypatch):
    """CI once saw a fork fail on a file of the images' copy gone under it (the tmpfs mounted
    twice, since fixed): the bare FileNotFoundError reached the env, which took it for a bug in
    the action and went on with a member that had no workspace. An OSError in a fork is now a
    ForkError naming the snapshot (the cause chained); nothing of the clones is left and the
    source runs on."""
    from bunshin_gym.workspace import uffd
    from bunshin_gym.workspace.records import all_records

    ws = Workspace.create("base")
    snap = None
    try:
        snap = ws.snapshot()
        before = {r.id for r in all_records(paths())}

        def gone(*args, **kwargs):
            raise FileNotFoundError(2, "No such file or directory", "/run/bunshin/uffd-images/x/ids-1.img")

        monkeypatch.setattr(uffd, "prepare_images", gone)
        with pytest.raises(ForkError, match=f"fork of 2 from snapshot {snap.id} failed: FileNotFoundError") as ei:
            snap.fork(2, mode="share")
        assert isinstance(ei.value.__cause__, FileNotFoundError)
        assert {r.id for r in all_records(paths())} == before  # the clones' records, cgroups, layers: reclaimed
        assert sh(ws, "echo alive").strip() == "alive"
    finally:
        monkeypatch.undo()
        ws.close()
        if snap is not None:
            snap.delete()
