"""Speculation's memory: live forks bounded by a budget, their snapshots released with them.
On real shell workspaces."""

from __future__ import annotations

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401
from bunshin_gym.errors import SnapshotError
from bunshin_gym.rollout import SpecToolSelector, Speculation, TrajectoryLog, signature
from bunshin_gym.rollout.runmemory import workspace_memory
from bunshin_gym.workspace.snapshot import SnapshotStore

SLOW = "sleep 1; echo done > /home/user/spec.txt; cat /home/user/spec.txt"
TRACE = "/home/user/trace.txt"
CHAIN = [f"sleep 0.3; echo {c} >> {TRACE}; cat {TRACE}" for c in "AB"]


def entries_for(actions: list[str]) -> list[dict]:
    """A log of five episodes of these calls: each took 1 s, DONE none (never worth a fork)."""
    return [{"task": "shell/make-dir", "episode": f"e{r}", "depth": d, "signature": signature(a), "action": a,
             "duration": 0.0 if a == "DONE" else 1.0} for r in range(5) for d, a in enumerate(actions)]


def speculation(actions: list[str], **kwargs) -> Speculation:
    entries = entries_for(actions)
    return Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                       min_duration=0.5, **kwargs)


def settle(env) -> None:
    """Wait for the wrapper's background work (chain runs, fork discards) to end."""
    for t in list(env._threads):
        t.join(60)


def test_a_fork_that_does_not_fit_the_memory_budget_is_not_launched():
    spec = speculation([SLOW, "DONE"], memory_budget=1)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        assert spec.stats.launched == 0 and spec.stats.skipped_memory == 1
        assert workspace_memory()["workspaces"] == 1  # no fork was made
        obs, _, _, _, info = env.step(SLOW)  # the call runs as it would without speculation
        assert obs["output"] == "done\n" and "speculation" not in info
    finally:
        env.close()


def test_live_forks_hold_their_measured_bytes_until_discarded_and_a_second_does_not_fit():
    spec = speculation([SLOW, "DONE"], memory_budget=10**12)
    first, second = (spec.wrap(gym.make("Bunshin-Shell-v0")) for _ in range(2))
    try:
        first.reset(options={"task": "shell/make-dir"})
        chain = first._chain
        assert spec.stats.launched == 1 and chain is not None and chain.finished.wait(60)
        held = spec.held_bytes
        # measured: the fork's cgroup, its monitor and the page images dumped for it
        assert held > 0 and spec.fork_cost() == held
        assert held >= SnapshotStore().get(chain.fork._ws.base_snapshot).size()
        spec.memory.fixed = held + held // 2  # room for one fork of that size, not two
        second.reset(options={"task": "shell/make-dir"})
        assert spec.stats.launched == 1 and spec.stats.skipped_memory == 1 and second._chain is None
        obs, _, _, _, info = first.step("echo other")  # a mismatch: the fork is dropped
        assert obs["output"] == "other\n" and spec.stats.mismatched == 1
        settle(first)
        assert chain.fork._closed and spec.held_bytes == 0  # its bytes are free again
        second.reset(options={"task": "shell/make-dir"})  # and another fork fits now
        assert spec.stats.launched == 2
    finally:
        first.close()
        second.close()
    assert spec.held_bytes == 0


def test_an_adopted_fork_is_no_longer_counted_as_speculations_memory():
    spec = speculation([SLOW, "DONE"], memory_budget=10**12)
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        assert env.wait_speculation(timeout=60)
        obs, _, _, _, info = env.step(SLOW)
        assert info.get("speculation") == "hit" and obs["output"] == "done\n"
        settle(env)
        assert spec.held_bytes == 0  # the fork's workspace is the env's own now
        assert env.unwrapped.workspace.exec("cat /home/user/spec.txt").text == "done\n"
    finally:
        env.close()


@pytest.mark.parametrize("mismatch_at", [0, 1])
def test_the_states_a_chain_recorded_are_released_with_the_chain(mismatch_at):
    spec = speculation([*CHAIN, "DONE"], depth=2, memory_budget=10**12)
    spec.min_duration = 0.0
    env = spec.wrap(gym.make("Bunshin-Shell-v0"))
    try:
        env.reset(options={"task": "shell/make-dir"})
        chain = env._chain
        assert chain is not None and chain.finished.wait(60)
        state = chain.calls[0].state.workspace  # recorded after the chain's first call
        assert SnapshotStore().get(state.id)
        for i, action in enumerate(CHAIN[:mismatch_at]):
            assert env.step(action)[4].get("speculation") == "hit", i
        env.step("echo X >> /home/user/trace.txt")  # the mismatch drops the chain
        settle(env)
        if mismatch_at == 0:  # nothing uses the state: deleted now, not when the env closes
            with pytest.raises(SnapshotError):
                SnapshotStore().get(state.id)
        else:  # the env's workspace was rolled back to it: kept while it needs it, then deleted
            assert SnapshotStore().get(state.id).meta["ephemeral"]
        assert env.unwrapped.workspace.exec(f"cat {TRACE}").text == "".join(
            f"{c}\n" for c in [*"AB"[:mismatch_at], "X"])
    finally:
        env.close()
    with pytest.raises(SnapshotError):
        SnapshotStore().get(state.id)
