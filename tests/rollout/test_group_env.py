"""GroupVectorEnv: one task set up once, G forked members stepping independently."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import GroupVectorEnv


@pytest.fixture
def group():
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=3, vectorization_mode="vector_entry_point")
    yield envs
    envs.close()


def test_make_vec_builds_a_group_of_forks_of_one_workspace(group):
    assert isinstance(group, GroupVectorEnv) and group.num_envs == 3
    obs, info = group.reset(options={"task": "shell/count-files"})
    assert info["task_id"] == "shell/count-files" and len(obs["output"]) == 3
    workspaces = [m.unwrapped.workspace for m in group.members]
    assert len({w.id for w in workspaces}) == 3
    # the task was set up once, in the root, whose workspace is closed now that the members
    # run: its state is the one snapshot they were all forked from
    root = group.root.unwrapped
    assert not root.materialized and {w.base_snapshot for w in workspaces} == {root._pending.id}


def test_members_step_independently_and_finished_members_stay_finished(group):
    group.reset(options={"task": "shell/hello-file"})
    obs, rewards, terms, truncs, infos = group.step(
        ["echo hello world > hello.txt", "echo nope > hello.txt", "DONE"])
    assert list(terms) == [False, False, True] and list(infos["active"]) == [True, True, False]
    assert rewards[2] == 0.0
    obs, rewards, terms, truncs, infos = group.step(["DONE", "cat hello.txt", "echo ignored"])
    assert rewards[0] == 1.0 and list(terms) == [True, False, True]
    assert obs["output"][1] == "nope\n"
    assert list(group.active) == [False, True, False]
    assert obs["output"][2] == ""  # the finished member was not stepped again
    assert group.members[2].unwrapped.steps == 1


def test_run_group_runs_every_member_against_a_policy(group):
    def policy(member, obs, history):
        if not history:
            return "ls /data | wc -l > answer.txt" if member != 1 else "echo 3 > answer.txt"
        return "DONE"

    trajs = group.run_group(policy, options={"task": "shell/count-files"})
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]
    assert all(len(t.steps) == 2 and t.steps[-1].terminated for t in trajs)
    assert not group.active.any()
    assert all(s.tool_s >= 0 and s.think_s >= 0 for t in trajs for s in t.steps)


def test_observations_are_batched_in_the_vector_space(group):
    obs, _ = group.reset(options={"task": "shell/make-dir"})
    assert obs in group.observation_space
    assert isinstance(obs["exit_code"], np.ndarray) and obs["exit_code"].shape == (3,)



def test_a_lazy_groups_reset_dumps_the_task_state_once():
    from bunshin_gym.workspace.snapshot import SnapshotStore

    def taken(ws_id: str) -> set[str]:  # snapshots of this workspace (other sessions share the store)
        return {s.id for s in SnapshotStore().list() if s.meta.get("workspace") == ws_id}

    envs = GroupVectorEnv("Bunshin-Shell-v0", 3, lazy=True)
    try:
        envs.reset(options={"task": "shell/make-dir"})
        root = envs.root.unwrapped
        # the booted workspace's snapshot and the reset snapshot, which every lazy member
        # forks: no second dump of the same state
        booted = root._boot_snap.meta["workspace"]
        assert taken(booted) == {root._boot_snap.id, root._reset_snap.workspace.id}
        assert {m.unwrapped._pending.workspace.id for m in envs.members} == {root._reset_snap.workspace.id}
        # a later group of the task: the parked root forks its boot snapshot, and one dump again
        envs.reset(options={"task": "shell/make-dir"})
        again = root._reset_snap.workspace.meta["workspace"]
        assert again != booted and taken(again) == {root._reset_snap.workspace.id}
        obs, _, _, _, infos = envs.step(["echo member"] * 3)  # each member forks the reset snapshot
        assert list(obs["output"]) == ["member\n"] * 3, obs
    finally:
        envs.close()
