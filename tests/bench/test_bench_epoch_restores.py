"""``bunshin bench epoch``'s hot and cold restores: the phases are timed by wrapping the
functions in place and put back after, and the target compares medians."""

from __future__ import annotations

import time

from bunshin_gym.bench import epoch as E
from bunshin_gym.workspace import uffd


class Env:
    def observe(self) -> str:
        time.sleep(0.05)
        return "frame"


def test_the_phase_timer_times_the_wrapped_phases_and_puts_every_function_back():
    prepare, env = uffd.prepare_images, Env()
    with E._PhaseTimer({"observe": (env, "observe")}) as timer:
        assert uffd.prepare_images is not prepare  # wrapped while it measures
        assert env.observe() == "frame"
    assert uffd.prepare_images is prepare and "observe" not in vars(env)
    assert set(timer.seconds) == {"observe"} and 0.05 <= timer.seconds["observe"] < 1.0
    assert set(E._median_phases([{"tmpfs_copy": 0.1, "rest": 0.2}, {"tmpfs_copy": 0.3, "rest": 0.4}])) == \
        {*E.RESTORE_PHASES, "observe", "rest"}
    # every phase is found where this tree defines it (a moved function would count in 'rest')
    with E._PhaseTimer() as timer:
        assert len(timer._saved) == len(E.RESTORE_PHASES)


def _restores(hot: list[float], cold: list[float]) -> dict:
    def side(v: list[float]) -> dict:
        return {"times_s": v, "mean_s": sum(v) / len(v), "median_s": sorted(v)[len(v) // 2],
                "phases_median_s": {"tmpfs_copy": 0.0, "rest": 0.1}, "phases_s": []}
    return {"hot": side(hot), "cold": side(cold), "images_mb": [10.0]}


def test_the_restore_target_compares_medians_so_one_stalled_restore_does_not_decide_it():
    one = {"share-base": {"epochs": [{"wall_s": 1.0, "memory": {"peak_mb": 1.0}, "rewards": [1.0]}]}}
    res = {"modes": one, "restores": _restores([0.9, 0.9, 4.0], [1.0, 1.1, 1.0])}  # hot mean 1.93 s
    target = next(t for t in E.evaluate_targets(res) if t["figure"] == "restores")
    assert target["ok"] and "median hot 0.9 s, cold 1.0 s" in target["measured"]
    res["restores"] = _restores([1.2, 1.2, 1.2], [1.0, 1.1, 1.0])
    assert not next(t for t in E.evaluate_targets(res) if t["figure"] == "restores")["ok"]
