"""``gc.collect()`` reclaims what a controller killed with SIGKILL left behind.

Never ``all_workspaces=True`` here: other sessions' workspaces may be running on this host.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import alive, cgroup_pids, leftovers

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, WorkspaceClosed, gc, pool, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.workspace import reclaim


def test_gc_reclaims_a_sigkilled_controllers_workspace(orphan):
    rec = orphan.rec
    assert rec is not None and rec.running() and rec.owner == orphan.proc.pid and rec.owner_alive()
    procs = {pid: records.proc_start_time(pid) for pid in Cgroup(rec.cgroup).pids()}
    assert len(procs) >= 5  # init, agent, sleep, sh, sleeps
    # while its controller lives, gc leaves it alone
    assert orphan.id not in gc.collect().workspaces
    assert records.load(orphan.id).running()

    orphan.kill_controller()
    # the controller's death alone stops nothing: the workspace keeps running until gc
    rec = records.load(orphan.id)
    assert rec is not None and rec.running() and not rec.owner_alive()
    assert all(alive(pid, start) for pid, start in procs.items())
    assert Path(rec.subvolume).is_dir() and Cgroup(rec.cgroup).exists()

    # (another session's gc may get there first: then only the result below is ours to check)
    present = records.load(orphan.id) is not None
    report = gc.collect()
    assert orphan.id in report.workspaces or not present
    assert leftovers([orphan.id]) == {}
    assert records.load(orphan.id) is None
    assert not Path(rec.subvolume).exists() and not Cgroup(rec.cgroup).exists()
    assert not [pid for pid, start in procs.items() if alive(pid, start)]
    assert cgroup_pids(orphan.id) == set()
    # a second pass has nothing of ours left to do
    again = gc.collect()
    assert orphan.id not in again.workspaces + again.subvolumes + again.cgroups


def test_gc_reclaims_a_workspace_whose_pid1_died():
    ws = Workspace.create("base", detached=True)
    try:
        pid1 = ws.pid
        os.kill(pid1, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while records.load(ws.id).running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        present = records.load(ws.id) is not None
        assert ws.id in gc.collect().workspaces or not present
        assert leftovers([ws.id]) == {}
    finally:
        ws.close()  # idempotent with what gc did
    assert leftovers([ws.id]) == {}


def test_gc_keeps_live_workspaces(ws):
    detached = Workspace.create("base", detached=True)
    try:
        rep = gc.collect()
        assert ws.id not in rep.workspaces and detached.id not in rep.workspaces
        assert ws.id not in rep.subvolumes + rep.cgroups
        assert ws.exec("echo alive", check=True).text == "alive\n"
        assert detached.exec("echo alive", check=True).text == "alive\n"
    finally:
        detached.close()


def _stray(name: str, sleeper: subprocess.Popen) -> Cgroup:
    pool.create_subvolume(paths().workspaces / name)
    (paths().workspaces / name / "upper").mkdir()
    cg = Cgroup.create(name)
    for f in cg.procs_files:
        Path(f).write_text(str(sleeper.pid))
    return cg


def test_gc_sweeps_a_subvolume_and_cgroup_no_record_names():
    for _attempt in range(5):
        name = f"ws-stray-{secrets.token_hex(3)}"
        sub = paths().workspaces / name
        sleeper = subprocess.Popen(["sleep", "1000"])
        try:
            try:
                cg = _stray(name, sleeper)
            except OSError:
                continue  # another session's gc swept it while we built it: try again
            present = sub.exists(), cg.exists()
            rep = gc.collect()
            assert (name in rep.subvolumes or not present[0]) and (name in rep.cgroups or not present[1])
            assert not sub.exists() and not cg.exists()
            assert sleeper.wait(5) == -signal.SIGKILL  # the stray cgroup's process was killed
            break
        finally:
            if sleeper.poll() is None:
                sleeper.kill()
                sleeper.wait()
            if Cgroup(name).exists():
                Cgroup(name).remove()
            pool.delete_subvolume(sub)
            assert leftovers([name]) == {}
    else:
        pytest.fail("could not build a stray workspace: swept each time by a concurrent gc")


REAPERLESS = textwrap.dedent("""
    import ctypes, sys, time
    from bunshin_gym.workspace import Workspace
    # become the child subreaper and never reap: like a container whose PID 1 reaps nothing,
    # the workspace's PID 1 (orphaned by its launcher) stays a zombie once it dies
    assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    ws = Workspace.create("base", detached=True)
    print(ws.id, ws.pid, flush=True)
    time.sleep(1000)
""")


def test_a_zombie_pid1_counts_as_dead():
    proc = subprocess.Popen([sys.executable, "-c", REAPERLESS], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    ws_id = None
    try:
        ws_id, pid1 = proc.stdout.readline().split()
        pid1 = int(pid1)
        assert records.load(ws_id).running()
        os.kill(pid1, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{pid1}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "PID 1 did not die"
            time.sleep(0.01)
        # the workspace is gone although its pid still names a (zombie) process
        assert not records.load(ws_id).running()
        with pytest.raises(WorkspaceClosed, match=ws_id):
            Workspace.attach(ws_id)
        present = records.load(ws_id) is not None
        assert ws_id in gc.collect().workspaces or not present
        assert leftovers([ws_id]) == {}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        rec = records.load(ws_id) if ws_id else None
        if rec is not None:
            reclaim(rec)


def test_concurrent_reclaims_of_one_workspace():
    """Two gc runs (or a gc and a close) may reclaim the same workspace at once: both succeed."""
    import threading

    for _ in range(5):
        ws = Workspace.create("base", detached=True)
        rec = records.load(ws.id)
        barrier = threading.Barrier(4)
        errors = []

        def reclaim_it(rec=rec, barrier=barrier, errors=errors):
            barrier.wait()
            try:
                reclaim(rec)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=reclaim_it) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ws.close()
        assert not errors, errors
        assert leftovers([ws.id]) == {}


def test_gc_removes_criu_caches_of_other_boots_and_builds_only():
    """CRIU's kernel-feature cache (criu/patches/0015) is named by boot and build: gc removes
    the ones of other boots or builds and keeps the current one, which the next dump uses."""
    from bunshin_gym.config import criu_env

    p = paths()
    current = Path(criu_env(p)["CRIU_KDAT_CACHE"])
    stale = p.run / "criu-00000000-000000000000.kdat"
    stale.write_bytes(b"stale")
    ws = Workspace.create("base")
    try:
        snap = ws.snapshot()
        snap.delete()
    finally:
        ws.close()
    assert current.exists(), "the dump did not keep CRIU's kernel-feature cache"
    rep = gc.collect()
    assert stale.name in rep.caches and not stale.exists()
    assert current.exists() and current.name not in rep.caches


_CRASHING_ENV = textwrap.dedent("""
    import json, os, signal
    import gymnasium as gym
    import bunshin_gym  # noqa: F401

    env = gym.make("Bunshin-Shell-v0").unwrapped
    env.reset(options={"task": "shell/make-dir"})
    env.step("mkdir -p /home/user/projects")
    mine = env.snapshot()  # the env's own: released when it closes
    kept = env.snapshot(keep=True)  # the caller's: outlives the env and the process
    print(json.dumps({"boot": env._boot_snap.id, "reset": env._reset_snap.id, "mine": mine.id,
                      "kept": kept.id}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close: the crash of a training process
""")


def test_gc_releases_the_snapshots_a_crashed_env_held():
    """An env's boot, reset and own snapshots are deleted when it closes; a process killed
    before that left them in the store for good (measured: a 200 MB boot image and a 90 MB
    task start per crashed web-env process). They are held by the process that took them, and
    gc releases them once it is gone; a snapshot the caller kept stays (and, if its pages are
    a delta over the boot image, that stays while it is needed)."""
    from bunshin_gym.workspace.snapshot import SnapshotStore

    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_ENV], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    ids = json.loads(out.strip().splitlines()[-1])
    p = paths()
    store = SnapshotStore()
    for name in ("boot", "reset", "mine"):
        assert store.get(ids[name]).metadata.holder is not None, name
    assert store.get(ids["kept"]).metadata.holder is None
    # `bunshin snap ls` says whose they are, and that their holder is gone
    listing = subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "snap", "ls"], capture_output=True, text=True,
                             timeout=60).stdout
    rows = {line.split()[0]: line for line in listing.splitlines()[1:] if line.strip()}
    for name in ("boot", "reset", "mine"):
        assert f"pid {proc.pid} (gone)" in rows[ids[name]], rows[ids[name]]
    assert f"pid {proc.pid}" not in rows[ids["kept"]]
    old = time.time() - 120  # past gc's grace for a fork that is registering its clones
    for snap_id in ids.values():
        os.utime(p.snapshots / snap_id, (old, old))

    needed = set(store.get(ids["kept"]).may_need())
    report = gc.collect()
    try:
        for name in ("boot", "reset", "mine"):
            if ids[name] in needed:  # released: deleted as soon as the kept snapshot goes
                assert store.get(ids[name]).metadata.ephemeral, name
            else:
                assert not (p.snapshots / ids[name]).exists() and ids[name] in report.snapshots, name
        assert store.get(ids["kept"]).metadata.holder is None
        # the crashed process's workspaces went too
        assert not [r for r in records.all_records() if r.owner == proc.pid]
    finally:
        store.get(ids["kept"]).delete()
    assert not [i for i in ids.values() if (p.snapshots / i).exists()]
