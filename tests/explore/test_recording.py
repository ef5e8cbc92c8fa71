"""The step log written by the real rollout engine: what it records matches what the groups did
(members, actions, rewards, steps served by the prefix cache), and it links to the trajectory
log by episode."""

from __future__ import annotations

import json
from collections import Counter

import gymnasium as gym

from bunshin_gym.explore.runs import Run, build_tree
from bunshin_gym.rollout import StepLog, TrajectoryLog

from .conftest import SHELL_GROUPS


def lines(run_dir, kind):
    return [r for r in map(json.loads, open(run_dir / "steps.jsonl")) if r["kind"] == kind]


def test_shell_groups_are_recorded_as_they_ran(shell_run):
    run_dir, trajs = shell_run
    groups = lines(run_dir, "group")
    steps = lines(run_dir, "step")
    ends = lines(run_dir, "end")
    assert [(g["epoch"], g["task"], g["members"]) for g in groups] == [(e, t, 4) for e, t, *_ in SHELL_GROUPS]
    run = Run(run_dir)
    for g, (_epoch, _task, plans, nodes, hits, rewards), group_trajs in zip(groups, SHELL_GROUPS, trajs, strict=True):
        assert [t.reward for t in group_trajs] == rewards  # the real outcome, as the fixture expects
        mine = [s for s in steps if s["group"] == g["group"]]
        for m, traj in enumerate(group_trajs):
            rec = sorted((s for s in mine if s["member"] == m), key=lambda s: s["depth"])
            assert [s["action"] for s in rec] == [s.action for s in traj.steps] == plans[m]
            assert [s["depth"] for s in rec] == list(range(len(plans[m])))
            assert rec[-1]["terminated"] and rec[-1]["reward"] == traj.reward
            assert all(s["duration"] > 0 for s in rec)
            assert [e["reward"] for e in ends if e["group"] == g["group"] and e["member"] == m] == [traj.reward]
        served = Counter(s["served"] for s in mine)
        assert served["cache"] == hits and served["executed"] == len(mine) - hits
        tree = build_tree(run.group(g["group"]))
        assert (tree["nodes"], tree["hits"]) == (nodes, hits)
    # the shell's observations are text: inline, no media files
    assert "f1.txt" in next(s for s in steps if s["action"] == "ls /data")["obs"]["text"]["output"]
    assert not list((run_dir / "media").iterdir())


def test_step_log_links_to_the_trajectory_log(shell_run):
    """Each step names its member's cache episode: the trajectory log's calls of that episode are
    the member's actions, by signature."""
    run_dir, _ = shell_run
    calls: dict[str, list[str]] = {}
    for e in TrajectoryLog.load(run_dir / "trajectories.jsonl"):
        calls.setdefault(e["episode"], []).append(e["signature"])
    by_episode: dict[str, list[str]] = {}
    for s in sorted(lines(run_dir, "step"), key=lambda s: s["depth"]):
        by_episode.setdefault(s["episode"], []).append(s["signature"])
    assert len(by_episode) == 12
    assert by_episode == calls


def test_vector_step_records_too(tmp_path):
    """Stepping the group env directly (no run_group) records each member's step as well."""
    log = StepLog(tmp_path)
    envs = gym.make_vec("Bunshin-Shell-v0", num_envs=2, vectorization_mode="vector_entry_point", step_log=log)
    try:
        envs.reset(options={"task": "shell/count-files"})
        envs.step(["ls /data", "pwd"])
        envs.step(["DONE", "DONE"])
    finally:
        envs.close()
    steps = lines(tmp_path, "step")
    assert [(s["member"], s["depth"], s["action"], s["served"]) for s in steps] == [
        (0, 0, "ls /data", "executed"), (1, 0, "pwd", "executed"), (0, 1, "DONE", "executed"),
        (1, 1, "DONE", "executed")]
    assert steps[1]["obs"]["text"]["output"].strip() == "/home/user"
    assert all(s["duration"] > 0 and s["think_s"] is None for s in steps)


def test_a_call_adopted_from_speculation_is_recorded_as_such(speculation_run):
    run_dir, trajs = speculation_run
    steps = lines(run_dir, "step")
    assert [(s["action"], s["served"]) for s in steps] == [(trajs[0].steps[0].action, "speculation"),
                                                           ("DONE", "executed")]
    assert trajs[0].steps[0].info.get("speculation") == "hit"
    assert steps[0]["obs"]["text"]["output"] == "done\n"
    # what the call took in the fork (its second of sleep), besides what the member waited for it
    assert steps[0]["fork_s"] >= 1.0 and steps[1]["fork_s"] is None
    tree = build_tree(Run(run_dir).group(steps[0]["group"]))
    assert tree["served"] == {"executed": 1, "cache": 0, "speculation": 1}
