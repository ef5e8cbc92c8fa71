"""Limits, written as the attacks: a workspace that allocates without end, fork-bombs or fills
its disk is stopped at its own limit, the step says so, and the host, the workspace itself
and its siblings keep running. Clones keep their snapshot's limits."""

from __future__ import annotations

import subprocess

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.config import Limits, parse_size
from bunshin_gym.workspace import Workspace, pool

SMALL = {"memory": "192M", "pids": 128, "disk": "64M"}


@pytest.fixture(scope="module")
def env():
    e = gym.make("Bunshin-Shell-v0", limits=SMALL)
    e.reset(options={"task": "shell/hello-file"})
    yield e
    e.close()


def test_limits_parse_and_refuse_bad_input():
    assert Limits.parse({"memory": "2G", "pids": 512}).memory == 2 << 30
    assert parse_size("max") == 0 and parse_size("1.5GiB") == 3 << 29
    with pytest.raises(ValueError, match="not a size"):
        Limits.parse({"memory": "lots"})
    with pytest.raises(ValueError, match="unknown keys"):
        Limits.parse({"memroy": "1G"})


def test_defaults_are_in_force_on_a_plain_workspace(monkeypatch):
    monkeypatch.setenv("BUNSHIN_WS_PIDS", "1000")
    with Workspace.create("base") as ws:
        cg = ws.cgroup.limits()
        assert cg == {"memory": 8 << 30, "pids": 1000}
        assert pool.disk_usage(ws.upper.parent)[1] == 8 << 30


def test_memory_hog_is_oom_killed_and_the_step_says_so(env):
    obs, reward, terminated, truncated, info = env.step(
        "python3 -c 'b = [bytearray(1 << 20) for _ in range(4096)]'; echo exit=$?")
    assert "exit=137" in obs["output"]  # SIGKILL by the kernel's OOM killer, inside the cgroup only
    assert "memory limit (192.0 MiB)" in obs["output"] and info["limit"]
    obs, *_ = env.step("echo alive")  # the workspace (agent, init) survived it
    assert obs["output"].strip() == "alive"


def test_fork_bomb_stops_at_the_pids_limit(env):
    obs, _, _, _, info = env.step("for i in $(seq 300); do sleep 5 & done 2>&1 | tail -n 1; wait")
    assert "process limit (128" in obs["output"], obs["output"]
    obs, *_ = env.step("echo alive")
    assert obs["output"].strip() == "alive"


def test_filling_the_disk_stops_at_the_quota_and_siblings_keep_writing(env):
    sibling = env.clone(1)[0]
    try:
        obs, _, _, _, info = env.step("dd if=/dev/zero of=/home/user/fill bs=1M count=200 2>&1 | tail -n 2")
        assert "Disk quota exceeded" in obs["output"]
        assert "disk quota is full" in obs["output"], obs["output"]
        used = int(env.workspace.exec("stat -c %s /home/user/fill").text)
        assert used <= parse_size("64M")
        # the sibling was forked before: same limit, its own quota, still free
        obs, *_ = sibling.step("dd if=/dev/zero of=/home/user/other bs=1M count=32 2>&1 | tail -n 1; echo ok")
        assert "quota" not in obs["output"] and obs["output"].strip().endswith("ok")
        obs, *_ = env.step("rm /home/user/fill && echo freed > /home/user/after && cat /home/user/after")
        assert obs["output"].strip() == "freed"
    finally:
        sibling.close()


def test_clones_inherit_their_snapshots_limits():
    with Workspace.create("base", limits={"memory": "300M", "pids": 99, "disk": "40M"}) as ws:
        snap = ws.snapshot()
        try:
            assert snap.meta["limits"] == {"memory": 300 << 20, "pids": 99, "disk": 40 << 20}
            (clone,) = snap.fork(1)
            with clone:
                assert clone.cgroup.limits() == {"memory": 300 << 20, "pids": 99}
                assert clone.limits.disk == 40 << 20
                assert pool.disk_usage(clone.upper.parent)[1] == 40 << 20
                clone.rollback(snap)  # a rollback keeps them too
                assert clone.cgroup.limits() == {"memory": 300 << 20, "pids": 99}
                assert pool.disk_usage(clone.upper.parent)[1] == 40 << 20
        finally:
            snap.release()


def test_gc_removes_the_quota_group_of_a_closed_workspace():
    from bunshin_gym.config import paths
    from bunshin_gym.workspace import gc

    p = paths()
    ws = Workspace.create("base", limits={"disk": "32M"})
    sid = pool.subvolume_id(ws.upper.parent)
    qgroup = pool._qgroups(p.pool) / f"0_{sid}"
    assert qgroup.is_dir()
    ws.close()
    subprocess.run(["btrfs", "subvolume", "sync", str(p.pool), str(sid)], check=True, timeout=120)  # cleaned
    gc.collect(p)
    assert not qgroup.exists()
