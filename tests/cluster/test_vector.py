"""``gym.make_vec(..., vectorization_mode="vector_entry_point", cluster=C)``: one GRPO group on a
host of a cluster (simulated hosts on local Ray), stepped and run as the local group is: the
same observations, rewards and infos for the same actions; placed where its task is cached; a
host that dies fails the group's call with HostLost and the next reset goes elsewhere."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.cluster import BunshinCluster, GroupSpec, ReplayPolicy, nodes
from bunshin_gym.cluster.vector import ClusterGroupVectorEnv, HostLost
from bunshin_gym.envs.shell.env import load_shell_task
from bunshin_gym.rollout import GroupVectorEnv

from .conftest import leftovers

ENV = "Bunshin-Shell-v0"
TASK = "shell/count-files"
HOSTS = ["cv0", "cv1"]
# per step, one action per member: a right answer, a wrong one, and a member that stops at once
STEPS = [["ls /data | wc -l > answer.txt", "echo 99 > answer.txt", "DONE"],
         ["cat answer.txt", "ls /data", "echo ignored"],
         ["DONE", "DONE", "echo ignored"]]


@pytest.fixture(scope="module", autouse=True)
def _hosts_removed():
    yield
    for name in HOSTS:
        nodes.remove(name)


def make_vec(**kwargs):
    return gym.make_vec(ENV, num_envs=3, vectorization_mode="vector_entry_point", **kwargs)


def play(envs) -> list:
    """reset and every step of STEPS: what a caller sees."""
    seen = [envs.reset(options={"task": TASK})]
    for actions in STEPS:
        obs, rewards, terms, truncs, infos = envs.step(actions)
        seen.append((obs, list(rewards), list(terms), list(truncs), infos))
    return seen


def assert_same(a, b, path="") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def workspace_niceness(host: str, ids: list[str]) -> set[int]:
    """The nice values of the processes of the host's workspaces ``ids`` (from their cgroups)."""
    found = set()
    for ws_id in ids:
        procs = nodes.layout(host).cgroup_root / "memory" / "bunshin" / ws_id / "cgroup.procs"
        pids = procs.read_text().split()
        assert pids, f"{ws_id} has no processes"
        for pid in pids:
            with contextlib.suppress(FileNotFoundError):  # one that exited meanwhile
                found.add(int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]))
    return found


def test_a_cluster_group_steps_and_runs_as_the_local_group(ray_local):
    oracle = load_shell_task(TASK).oracle()
    policy = ReplayPolicy((("ls /data", *oracle), ("echo 1 > answer.txt", "DONE"), tuple(oracle)))
    local = make_vec()
    try:
        assert isinstance(local, GroupVectorEnv)
        here = play(local)
        here_trajs = local.run_group(policy, options={"task": TASK})
    finally:
        local.close()
    with BunshinCluster(HOSTS, fresh=True) as c:
        envs = make_vec(cluster=c)
        try:
            assert isinstance(envs, ClusterGroupVectorEnv) and envs.host in HOSTS
            assert envs.single_observation_space == local.single_observation_space
            there = play(envs)
            # the three forks live on the group's host (the root's workspace is closed once they
            # are forked), none on the other
            held = {h: s["workspaces"] for h, s in c.stats().items()}
            assert len(held[envs.host]) == 3 and not any(held[h] for h in HOSTS if h != envs.host), held
            # Ray runs its workers at nice 15; the host's workspaces run at BUNSHIN_WS_NICE's 0
            assert workspace_niceness(envs.host, held[envs.host]) == {0}
            assert_same(here, there)
            assert here[-1][1] != [0.0, 0.0, 0.0] and list(envs.active) == [False, False, False]
            stepped = []
            trajs = envs.run_group(policy, options={"task": TASK}, on_step=lambda i, s: stepped.append(i))
            assert [t.reward for t in trajs] == [t.reward for t in here_trajs] == [1.0, 0.0, 1.0]
            for mine, theirs in zip(trajs, here_trajs, strict=True):
                assert mine.actions == theirs.actions and mine.error is None
                assert_same([(s.observation, s.reward, s.terminated, s.truncated, s.info) for s in mine.steps],
                            [(s.observation, s.reward, s.terminated, s.truncated, s.info) for s in theirs.steps])
            assert sorted(stepped) == sorted(t.member for t in trajs for _ in t.steps)
        finally:
            envs.close()
        assert not any(s["workspaces"] for s in c.stats().values())  # closed on the host
        with pytest.raises(RuntimeError, match="closed"):
            envs.step(STEPS[0])
    for name in HOSTS:
        assert leftovers(name) == {"records": [], "workspaces": [], "snapshots": [], "cgroups": []}, name


def test_a_cluster_group_is_placed_where_its_task_is_cached_and_survives_its_host(ray_local):
    oracle = tuple(load_shell_task(TASK).oracle())
    policy = ReplayPolicy((("sleep 0.3; ls /data", *oracle),) * 2)
    with BunshinCluster(HOSTS, fresh=True) as c:
        [first] = c.run_batch([GroupSpec(TASK, policy, 2)])
        assert first.rewards == [1.0, 1.0], first
        holder = first.host
        other = next(h for h in HOSTS if h != holder)
        envs = gym.make_vec(ENV, num_envs=2, vectorization_mode="vector_entry_point", cluster=c, prefix_cache=True)
        try:
            trajs = envs.run_group(policy, options={"task": TASK})
            assert (envs.host, envs.decision.reason) == (holder, "prefix")
            assert [t.reward for t in trajs] == [1.0, 1.0]
            assert all(s.info.get("cache") == "hit" for t in trajs for s in t.steps)  # served by the holder's cache
            c.kill_host(holder)
            with pytest.raises(HostLost, match=f"host {holder}"):
                envs.step(["DONE", "DONE"])
            assert list(c.dead) == [holder] and c.index.entries(holder) == []
            obs, info = envs.reset(options={"task": TASK})  # placed again, on the host left
            assert envs.host == other and info["task_id"] == TASK
            stepped = envs.step([oracle[0], "echo 0 > answer.txt"])
            _, rewards, _, _, infos = envs.step(["DONE", "DONE"])
            # (what each member saw, should a member's workspace have failed on the new host)
            assert list(rewards) == [1.0, 0.0], {"first step's outputs": list(stepped[0]["output"]),
                                                 "first step's infos": stepped[4], "done": infos}
        finally:
            envs.close()
        report = c.shutdown()
        assert "error" not in report[holder], report  # the dead host's workspaces reclaimed on its node
    for name in HOSTS:
        assert leftovers(name) == {"records": [], "workspaces": [], "snapshots": [], "cgroups": []}, name


def test_a_cluster_group_speculates_with_its_hosts_selector(ray_local):
    """speculation=True: the host trains a selector on its trajectory log (filled by a first
    batch) and speculates each member's next call in a fork while the caller thinks."""
    slow = ("sleep 0.8; ls /data | wc -l > answer.txt", "DONE")  # past the host's 0.5 s threshold
    nodes.remove(HOSTS[1])  # (made by the tests before)
    with BunshinCluster(HOSTS[:1], fresh=True) as c:
        # one member: a second one would be served from the cache, and its ~0 s call would halve
        # the recorded median duration the host's threshold is compared with
        [first] = c.run_batch([GroupSpec(TASK, ReplayPolicy((slow,)), 1)])
        assert first.rewards == [1.0] and first.kinds == [["executed", "executed"]], first
        envs = make_vec(cluster=c, speculation=True)
        try:
            envs.reset(options={"task": TASK})
            time.sleep(8)  # the policy's think time: the host runs the predicted call meanwhile
            _, rewards, *_, infos = envs.step([slow[0]] * 3)
            assert [i.get("speculation") for i in infos["member_info"]] == ["hit"] * 3, infos
            _, rewards, terms, *_ = envs.step(["DONE"] * 3)
            assert list(rewards) == [1.0] * 3 and terms.all()
        finally:
            envs.close()
        with pytest.raises(ValueError, match="True or False"):
            make_vec(cluster=c, speculation=object())
    assert leftovers(HOSTS[0]) == {"records": [], "workspaces": [], "snapshots": [], "cgroups": []}


def test_bad_arguments_are_refused_before_anything_is_made(ray_local):
    nodes.remove(HOSTS[1])  # (made by the tests before)
    with BunshinCluster(HOSTS[:1], fresh=True) as c:
        with pytest.raises(ValueError, match="num_envs >= 1"):
            ClusterGroupVectorEnv(c, ENV, 0)
        with pytest.raises(ValueError, match="cache= is a local object"):
            make_vec(cluster=c, cache=object())
        assert c.loads() == {HOSTS[0]: 0}  # no group was opened
    with pytest.raises(ValueError, match="pinned to no alive Ray node: cv1: f{56}"):
        BunshinCluster({HOSTS[1]: "f" * 56})
    assert not nodes.layout(HOSTS[1]).base.exists()  # refused before the host was prepared
