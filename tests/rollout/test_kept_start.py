"""A group whose cache keeps its task's start (an earlier group's set-up) starts there: no
set-up runs, its reset answers the recorded observation, and its members behave as the
members of a group that set the task up would."""

from __future__ import annotations

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.errors import SnapshotError
from bunshin_gym.rollout import PrefixCache
from bunshin_gym.rollout.prefix_cache import _delete_snapshot
from bunshin_gym.workspace.snapshot import SnapshotStore

# a set-up whose result differs each time it runs: which set-up a member sees is readable
TASK = {"id": "shell/stamped", "instruction": "Write the stamp's length to /home/user/answer.txt.",
        "setup": ["head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /home/user/stamp"],
        "check": "test \"$(cat /home/user/answer.txt)\" = 24", "max_steps": 5}
ANSWER = "tr -d '\\n' < /home/user/stamp | wc -c > /home/user/answer.txt"


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(tmp_path / "cache", snapshot_every=1)
    yield c
    c.clear()


def group(cache, **kwargs):
    return gym.make_vec("Bunshin-Shell-v0", num_envs=2, vectorization_mode="vector_entry_point", cache=cache,
                        **kwargs)


def stamp_and_answer(envs, label: str) -> tuple[list[str], list[float]]:
    """Each member reads the stamp (a call nobody made before: executed in its own fork),
    then answers and ends."""
    obs, *_ = envs.step([f"cat /home/user/stamp; echo ' {label} {i}'" for i in range(envs.num_envs)])
    stamps = [o.split()[0] for o in obs["output"]]
    envs.step([ANSWER] * envs.num_envs)
    _, rewards, *_ = envs.step(["DONE"] * envs.num_envs)
    return stamps, list(rewards)


def test_a_later_group_starts_at_the_kept_start_without_a_set_up(cache):
    first = group(cache)
    try:
        obs1, info1 = first.reset(options={"task": TASK})
        assert first.root.unwrapped._boot_snap is not None  # booted, set up in its own workspace
        stamps1, rewards1 = stamp_and_answer(first, "first")
    finally:
        first.close()
    assert cache.stats.starts_served == 0 and stamps1[0] == stamps1[1] and rewards1 == [1.0, 1.0]

    later = group(cache)
    try:
        obs2, info2 = later.reset(options={"task": TASK})
        assert cache.stats.starts_served == 1
        assert later.root.unwrapped._boot_snap is None  # nothing booted: no set-up, no dump
        assert (later.task_id, info2) == ("shell/stamped", info1)
        for k in obs1:
            assert list(obs2[k]) == list(obs1[k])
        stamps2, rewards2 = stamp_and_answer(later, "later")
    finally:
        later.close()
    # the members forked the first group's start: its set-up's stamp, and the same rewards
    assert stamps2 == stamps1 and rewards2 == rewards1


def test_a_start_that_is_gone_or_options_beyond_the_task_set_the_task_up_again(cache):
    first = group(cache)
    try:
        first.reset(options={"task": TASK})
        stamps1, _ = stamp_and_answer(first, "first")
    finally:
        first.close()
    root = next(iter(cache.tree.roots.values()))
    kept = root.start

    other = group(cache)
    try:
        other.reset(options={"task": TASK, "note": "an option the kept start may not reflect"})
        assert other.root.unwrapped._boot_snap is not None and cache.stats.starts_served == 0
    finally:
        other.close()

    # gone (deleted by hand, say): the snapshots cached below it first, then the start
    for node in sorted(cache.tree.nodes(), key=lambda n: -n.depth):
        if node.snapshot:
            _delete_snapshot(node.snapshot)
    _delete_snapshot(kept)
    with pytest.raises(SnapshotError):
        SnapshotStore().get(kept)
    again = group(cache)
    try:
        again.reset(options={"task": TASK})
        assert again.root.unwrapped._boot_snap is not None and cache.stats.starts_served == 0
        stamps2, rewards2 = stamp_and_answer(again, "again")
    finally:
        again.close()
    assert stamps2[0] == stamps2[1] != stamps1[0] and rewards2 == [1.0, 1.0]  # a set-up of its own
    assert root.start not in (None, kept)  # ... which is the task's kept start from now on

    last = group(cache)
    try:
        last.reset(options={"task": TASK})
        assert cache.stats.starts_served == 1
        stamps3, _ = stamp_and_answer(last, "last")
    finally:
        last.close()
    assert stamps3 == stamps2
