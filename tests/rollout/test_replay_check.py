"""Checked replays: when the prefix cache replays a recorded call and the observation differs
from the recorded one, the call is marked non-deterministic, its subtree is no longer
served and the episode goes on without the cache; deterministic calls still hit."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import PrefixCache
from bunshin_gym.rollout.observation import same_observation

TASK = {"task": "shell/make-dir"}
NONDETERMINISTIC = {"clock": "date +%s%N", "urandom": "head -c 16 /dev/urandom | od -An -tx1"}


@pytest.fixture
def cache(tmp_path):
    # no snapshots: every way back to a position replays the calls recorded on the path
    c = PrefixCache(tmp_path / "cache", snapshot_every=100, overlap=False)
    yield c
    c.clear()


@pytest.mark.parametrize("name", sorted(NONDETERMINISTIC))
def test_a_replay_that_differs_marks_the_call_and_drops_what_follows_it(cache, name):
    random_call = NONDETERMINISTIC[name]
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options=TASK)
        env.step("echo hi")
        recorded = env.step(random_call)[0]["output"]
        env.step("echo after")
        assert cache.stats.misses == 3 and cache.stats.nondeterministic == 0

        # the second episode is served the recorded calls; the live workspace follows by
        # replaying them, and the replay of the random call differs from its record
        env.reset(options=TASK)
        assert env.step("echo hi")[4]["cache"] == "hit"
        obs, _, _, _, info = env.step(random_call)
        assert info["cache"] == "hit" and obs["output"] == recorded  # what the episode was told
        assert cache.stats.nondeterministic == 1 and cache.stats.off_tree == 1
        assert env.off_tree
        obs, _, _, _, info = env.step("echo after")  # off the tree: executed, not served
        assert info["cache"] == "miss" and obs["output"] == "after\n"

        # later episodes: the deterministic call still hits, the marked one always executes
        # and nothing below it is served
        env.reset(options=TASK)
        assert env.step("echo hi")[4]["cache"] == "hit"
        obs, _, _, _, info = env.step(random_call)
        assert info["cache"] == "miss" and obs["output"] != recorded
        assert env.step("echo after")[4]["cache"] == "miss"
        assert cache.stats.nondeterministic == 1  # counted once
        assert cache.stats.hits == 3
    finally:
        env.close()


def test_the_mark_persists_with_the_tree(cache, tmp_path):
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options=TASK)
        env.step("echo hi")
        env.step(NONDETERMINISTIC["clock"])
        env.reset(options=TASK)
        env.step("echo hi")
        env.step(NONDETERMINISTIC["clock"])  # served, then replayed: differs
        assert cache.stats.nondeterministic == 1
    finally:
        env.close()  # saves the tree
    again = PrefixCache(cache.tree.dir, snapshot_every=100, overlap=False)
    env = again.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options=TASK)
        assert env.step("echo hi")[4]["cache"] == "hit"
        assert env.step(NONDETERMINISTIC["clock"])[4]["cache"] == "miss"
    finally:
        env.close()


def test_deterministic_replays_keep_the_episode_on_the_tree(cache):
    env = cache.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        for _ in range(2):
            env.reset(options=TASK)
            env.step("echo one > /home/user/f; cat /home/user/f")
            env.step("echo two >> /home/user/f; cat /home/user/f")
        assert env.step("cat /home/user/f")[0]["output"] == "one\ntwo\n"
        assert cache.stats.replays >= 2 and cache.stats.nondeterministic == 0 and not env.off_tree
    finally:
        env.close()


def test_observations_compare_text_exactly_and_images_up_to_a_blinking_cursor():
    shot = np.zeros((100, 100, 3), np.uint8)
    cursor = shot.copy()
    cursor[10:20, 10:12] = 255  # 20 pixels of 10000: a text cursor
    changed = shot.copy()
    changed[:, :10] = 255  # a tenth of the screen
    assert same_observation({"output": "a", "screenshot": shot}, {"output": "a", "screenshot": cursor})
    assert not same_observation({"output": "a", "screenshot": shot}, {"output": "a", "screenshot": changed})
    assert not same_observation({"output": "a  b"}, {"output": "a b"})
    assert not same_observation({"exit_code": np.int64(0)}, {"exit_code": np.int64(1)})
    assert not same_observation({"output": "a"}, {"output": "a", "url": ""})
