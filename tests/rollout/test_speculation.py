"""The Spec Tool Selector and speculative execution in forks, on real workspaces."""

from __future__ import annotations

import logging
import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.rollout import SpecToolSelector, Speculation, TrajectoryLog, signature

SLOW = "sleep 1; echo done > /home/user/spec.txt; cat /home/user/spec.txt"


def log_entries(episodes: dict[str, list[str]], repeat: int = 5, duration: float = 1.0) -> list[dict]:
    out = []
    for r in range(repeat):
        for task, actions in episodes.items():
            for depth, a in enumerate(actions):
                out.append({"task": task, "episode": f"{task}-{r}", "depth": depth, "signature": signature(a),
                            "action": a, "duration": duration})
    return out


def test_selector_learns_next_calls_and_saves(tmp_path):
    entries = log_entries({
        "t/a": ["ls", "cat a.txt", "wc -l a.txt", "DONE"],
        "t/b": ["ls", "cat b.txt", "rm b.txt", "DONE"],
    })
    sel = SpecToolSelector.train(entries)
    assert sel.accuracy(entries) >= 0.95
    assert sel.predict("t/b", [signature("ls")], k=2)[0][1] == "cat b.txt"
    assert [p[1] for p in sel.predict("t/a", [signature("ls")], k=3)] == ["cat a.txt", "wc -l a.txt", "DONE"]
    sel.save(tmp_path / "sel.npz")
    again = SpecToolSelector.load(tmp_path / "sel.npz")
    assert again.predict("t/a", [], k=4) == sel.predict("t/a", [], k=4)


def speculative_env(duration: float, min_duration: float = 0.5):
    entries = log_entries({"shell/make-dir": [SLOW, "DONE"]}, duration=duration)
    spec = Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                       min_duration=min_duration)
    return spec, spec.wrap(gym.make("Bunshin-Shell-v0"))


def test_a_matching_prediction_is_served_from_the_fork_and_its_state_adopted():
    spec, env = speculative_env(duration=1.0)
    try:
        env.reset(options={"task": "shell/make-dir"})
        time.sleep(4)  # the policy "thinks" while the fork runs the predicted call
        obs, _, _, _, info = env.step(SLOW)
        assert info.get("speculation") == "hit" and obs["output"] == "done\n"
        assert spec.stats.matched == 1 and spec.stats.launched >= 1
        base = env.unwrapped
        assert base.steps == 1
        assert base.workspace.exec("cat /home/user/spec.txt").text == "done\n"  # the fork's state
        _, reward, terminated, _, _ = env.step("DONE")
        assert terminated and reward == 0.0
    finally:
        env.close()


def test_a_mismatch_discards_the_speculative_fork():
    spec, env = speculative_env(duration=1.0)
    try:
        env.reset(options={"task": "shell/make-dir"})
        time.sleep(4)
        obs, _, _, _, info = env.step("echo other")
        assert "speculation" not in info and obs["output"] == "other\n"
        assert spec.stats.mismatched == 1
        assert env.unwrapped.workspace.exec("test -e /home/user/spec.txt").exit_code == 1
    finally:
        env.close()


@pytest.mark.parametrize("duration", [0.01])
def test_fast_calls_are_not_worth_a_fork(duration):
    spec, env = speculative_env(duration=duration)
    try:
        env.reset(options={"task": "shell/make-dir"})
        env.step(SLOW)
        assert spec.stats.launched == 0 and spec.stats.skipped_fast >= 1
    finally:
        env.close()


TRACE = "/home/user/trace.txt"
CHAIN = [f"sleep 0.3; echo {c} >> {TRACE}; cat {TRACE}" for c in "ABC"]
OTHER = f"echo X >> {TRACE}; cat {TRACE}"


@pytest.mark.parametrize("k, mismatch_at", [(2, 0), (2, 1), (2, None), (3, 0), (3, 1), (3, 2), (3, None)])
def test_a_chain_of_k_calls_serves_the_matches_and_nothing_after_a_mismatch(k, mismatch_at):
    entries = log_entries({"shell/make-dir": [*CHAIN, "DONE"]})
    spec = Speculation(SpecToolSelector.train(entries), depth=k, durations=TrajectoryLog.durations(entries),
                       min_duration=0.0)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    actual = [OTHER if i == mismatch_at else a for i, a in enumerate(CHAIN[:k])]
    try:
        env.reset(options={"task": "shell/make-dir"})
        lines = []
        for i, action in enumerate(actual):
            assert env.wait_speculation(timeout=60)  # the chain ran this far in its fork
            obs, _, _, _, info = env.step(action)
            lines.append("X" if action == OTHER else "ABC"[i])
            # every observation, served or not, is that of the actual calls so far
            assert obs["output"] == "".join(f"{line}\n" for line in lines)
            if mismatch_at is None or i < mismatch_at:
                assert info.get("speculation") == "hit"
                if i < k - 1:  # one chain for all k calls: none started while it runs ahead
                    assert spec.stats.launched == 1
            elif i == mismatch_at:
                assert "speculation" not in info
                assert spec.stats.mismatched == 1
        served = k if mismatch_at is None else mismatch_at
        assert spec.stats.matched >= served
        # the workspace holds the actual calls' effects only: none of the chain's beyond a mismatch
        assert env.unwrapped.workspace.exec(f"cat {TRACE}").text == "".join(f"{line}\n" for line in lines)
        assert env.unwrapped.steps == k
    finally:
        env.close()


def test_a_mismatch_kills_the_speculative_command_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="bunshin_gym")
    slow = "sleep 30; echo late > /home/user/late.txt"
    entries = log_entries({"shell/make-dir": [slow, "DONE"]}, duration=30.0)
    spec = Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                       min_duration=0.5)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        chain = env._chain
        assert chain is not None and chain.calls[0].started.wait(60)
        time.sleep(0.5)  # the speculated `sleep 30` runs in the fork now
        t0 = time.perf_counter()
        obs, _, _, _, info = env.step("echo other")
        assert obs["output"] == "other\n" and "speculation" not in info
        assert chain.finished.wait(timeout=5)
        stopped_after = time.perf_counter() - t0
        assert stopped_after < 1.0, f"the speculative command ran on for {stopped_after:.1f} s"
        assert chain.calls[0].result is None  # killed: nothing to serve
        # killed on purpose: the fork's failed step is no failure to warn about
        assert not [r for r in caplog.records if "workspace failed" in r.getMessage()], caplog.text
        nxt = env._chain  # the next speculation does not queue behind the killed one
        assert nxt is not None and nxt is not chain and nxt.calls[0].started.wait(15)
        t1 = time.perf_counter()
        env.close()
        assert time.perf_counter() - t1 < 15  # the fork's close does not wait for the sleep either
        assert chain.fork._closed
    finally:
        env.close()


def test_the_threshold_is_lower_for_historically_slow_tasks_and_stragglers():
    entries = (log_entries({"t/fast": ["ls", "DONE"]}, duration=0.1)
               + log_entries({"t/slow": ["du -sh /", "sort big", "DONE"]}, duration=1.0))
    spec = Speculation.from_log(entries, min_duration=0.8)
    assert spec.episode_times == {"t/fast": pytest.approx(0.2), "t/slow": pytest.approx(3.0)}
    assert spec.threshold("t/fast") == 0.8  # faster than the median task: no lower
    slow = 0.8 / (3.0 / 1.6)  # 1.6 s: the median episode over both tasks
    assert spec.threshold("t/slow") == pytest.approx(slow)
    assert spec.threshold("t/slow", elapsed=2.0) == pytest.approx(slow)
    assert spec.threshold("t/slow", elapsed=3.5) == pytest.approx(slow / 2)  # a straggler now
    assert spec.threshold("t/unknown") == 0.8


def test_a_call_too_short_for_a_fork_is_speculated_in_a_historically_slow_task():
    slow_task = log_entries({"shell/make-dir": [SLOW, "DONE"]}, duration=0.5)  # 1 s episodes
    fast_task = log_entries({"shell/count-files": ["ls", "DONE"]}, duration=0.05)  # 0.1 s episodes
    launched = {}
    for name, entries in {"alone": slow_task, "among fast tasks": slow_task + fast_task}.items():
        spec = Speculation.from_log(entries, min_duration=0.8)
        env = spec.wrap(gym.make("Bunshin-Shell-v0"))
        try:
            env.reset(options={"task": "shell/make-dir"})
            launched[name] = (spec.stats.launched, spec.stats.skipped_fast)
        finally:
            env.close()
    assert launched == {"alone": (0, 1), "among fast tasks": (1, 0)}


def test_the_selector_reads_the_last_observation():
    entries = []
    for r in range(6):
        listing, follow = ("a.txt", "cat a.txt") if r % 2 else ("b.txt", "cat b.txt")
        for depth, (action, obs) in enumerate([("ls", ""), (follow, listing), ("DONE", "")]):
            entries.append({"task": "t", "episode": f"e{r}", "depth": depth, "signature": signature(action),
                            "action": action, "duration": 1.0, "observation": obs})
    sel = SpecToolSelector.train(entries)
    assert sel.predict("t", [signature("ls")], "a.txt\n")[0][1] == "cat a.txt"
    assert sel.predict("t", [signature("ls")], "b.txt\n")[0][1] == "cat b.txt"


def test_a_call_served_by_speculation_is_recorded_with_the_time_it_took_in_the_fork(tmp_path):
    from bunshin_gym.rollout import PrefixCache

    spec, env = speculative_env(duration=1.0)
    cache = PrefixCache(tmp_path / "cache", snapshot_every=1)
    env = cache.wrap(env)
    try:
        env.reset(options={"task": "shell/make-dir"})
        time.sleep(4)
        t0 = time.perf_counter()
        obs, _, _, _, info = env.step(SLOW)
        assert info.get("speculation") == "hit" and time.perf_counter() - t0 < 1.0
        # a replay of it costs the fork's second, not the instant it took to serve
        assert env.node.duration >= 1.0
    finally:
        env.close()
        cache.clear()


def test_a_speculated_call_is_never_served_for_a_call_that_differs_inside_quotes():
    predicted = 'sleep 1; echo "a  b" > /home/user/q.txt; cat /home/user/q.txt'
    spec = Speculation.from_log(log_entries({"shell/make-dir": [predicted, "DONE"]}), min_duration=0.5)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        assert env.wait_speculation(timeout=60)  # the fork ran the predicted call
        obs, _, _, _, info = env.step(predicted.replace('"a  b"', '"a b"'))
        assert "speculation" not in info and obs["output"] == "a b\n"
        assert spec.stats.mismatched == 1 and spec.stats.matched == 0
        env.reset(options={"task": "shell/make-dir"})  # blanks between words only: the same call, served
        assert env.wait_speculation(timeout=60)
        obs, _, _, _, info = env.step(predicted.replace("; echo", ";   echo"))
        assert info.get("speculation") == "hit" and obs["output"] == "a  b\n"
    finally:
        env.close()


def test_a_fork_slower_than_the_policys_turn_is_not_launched_but_retried_now_and_then():
    from bunshin_gym.rollout.speculation import RETRY_EVERY, TIMING_WARMUP

    spec = Speculation(SpecToolSelector.train(log_entries({"t/a": ["ls", "DONE"]})))
    for _ in range(TIMING_WARMUP - 1):  # not measured enough yet: launched
        spec.timing.note_fork(5.0)
        spec.timing.note_turn(1.0)
    assert spec.timing.fork_beats_policy()
    spec.timing.note_fork(5.0)
    spec.timing.note_turn(1.0)
    answers = [spec.timing.fork_beats_policy() for _ in range(2 * RETRY_EVERY)]
    assert answers.count(True) == 2 and answers[RETRY_EVERY - 1] and answers[-1]  # the retries
    for _ in range(64):  # forks got fast (the load dropped): the latest decide
        spec.timing.note_fork(0.2)
    assert spec.timing.fork_beats_policy()


def test_the_wrapper_times_the_policys_turns_and_skips_forks_that_would_come_late():
    spec, env = speculative_env(duration=1.0)
    try:
        for _ in range(5):
            spec.timing.note_fork(30.0)  # forks measured far slower than any turn here
        env.reset(options={"task": "shell/make-dir"})
        for _ in range(5):
            time.sleep(0.05)
            env.step("true")
        turns = spec.timing.turns
        assert len(turns) == 5 and all(0.05 <= t < 5.0 for t in turns)
        launched = spec.stats.launched
        env.reset(options={"task": "shell/make-dir"})  # the prediction after reset: SLOW, worth 1 s
        assert spec.stats.launched == launched and spec.stats.skipped_slow_fork >= 1
    finally:
        env.close()


def test_a_chains_recorded_states_are_held_by_the_process_and_gone_after_close():
    """The state after each of a chain's calls but the last is recorded (a member adopts it on
    a match). It was a kept snapshot that only the chain released: a crash of the process left
    it in the store for good. Now it is held by the process (`bunshin gc` releases it after a
    crash) and still released with the chain."""
    import os

    from bunshin_gym.config import paths
    from bunshin_gym.workspace.snapshot import SnapshotStore

    entries = log_entries({"shell/make-dir": [*CHAIN, "DONE"]})
    spec = Speculation(SpecToolSelector.train(entries), depth=2, durations=TrajectoryLog.durations(entries),
                       min_duration=0.0)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        assert env.wait_speculation(timeout=60)
        _, _, _, _, info = env.step(CHAIN[0])
        assert info.get("speculation") == "hit"
        adopted = env.unwrapped.workspace._rec.snapshot  # the state recorded after the call
        base = env.unwrapped
        assert adopted not in (base._reset_snap.workspace.id, base._boot_snap.id), "no chain state adopted"
        meta = SnapshotStore().get(adopted).metadata
        assert meta.holder is not None and meta.holder[0] == os.getpid(), meta
    finally:
        env.close()
    assert not (paths().snapshots / adopted).exists()
