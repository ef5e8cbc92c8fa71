"""``bunshin bench density``: the stepping schedule (with a test double) and one real run at
the smallest size (a desktop and two share clones)."""

from __future__ import annotations

import time

from bunshin_gym.bench import density
from bunshin_gym.cli import parser
from bunshin_gym.rollout.runmemory import workspace_memory


class StepDouble:
    """Counts its steps; a step takes ``seconds``."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds
        self.times: list[float] = []

    def step(self, action: str):
        assert action in density.ACTIONS
        self.times.append(time.monotonic())
        time.sleep(self.seconds)
        return None, 0.0, False, False, {}


def test_stepper_steps_every_clone_once_a_period_and_keeps_first_steps_apart():
    stepper = density.Stepper(period_s=0.5, threads=2)
    envs = [StepDouble() for _ in range(4)]
    stepper.start()
    try:
        stepper.add(envs)
        time.sleep(1.6)
    finally:
        stepper.stop()
    for env in envs:
        assert 3 <= len(env.times) <= 5, env.times  # at 0, 0.5, 1.0, 1.5 s after its first
        gaps = [b - a for a, b in zip(env.times, env.times[1:], strict=False)]
        assert all(0.4 < g < 0.8 for g in gaps), gaps
    assert len(stepper.window(10, first=True)) == 4  # one first step per clone
    assert len(stepper.window(10)) == sum(len(e.times) for e in envs) - 4
    assert not stepper.errors


def test_stepper_counts_a_failing_step_and_goes_on():
    class Broken(StepDouble):
        def step(self, action):
            super().step(action)
            raise RuntimeError("the desktop went away")

    stepper = density.Stepper(period_s=0.2, threads=1)
    stepper.start()
    try:
        stepper.add([Broken()])
        time.sleep(0.5)
    finally:
        stepper.stop()
    assert stepper.errors and "the desktop went away" in stepper.errors[0]
    assert len(stepper.samples) >= 2  # stepped again after the failure


def test_cpu_seconds_count_new_processes_from_zero():
    hz = density.os.sysconf("SC_CLK_TCK")
    assert density._cpu_seconds({1: 100}, {1: 100 + hz, 2: 2 * hz}) == 3.0


def test_cli_parses_density():
    args = parser().parse_args(["bench", "density", "--modes", "share", "--max-desktops", "32",
                                      "--group", "8", "--period", "5"])
    assert (args.name, args.modes, args.max_desktops, args.group, args.period) == ("density", "share", 32, 8, 5.0)


def test_a_real_run_holds_two_share_desktops_and_closes_them():
    cfg = density.DensityConfig(modes=("share",), group=2, max_desktops=2, period_s=3.0, step_budget_ms=60_000)
    doc = density.run(None, cfg)
    res = doc["modes"]["share"]
    assert res["held"] == 2 and res["stopped"] == "reached --max-desktops 2", res
    (row,) = res["rows"]
    assert row["desktops"] == 2 and row["first_steps"] == 2 and row["errors"] == 0, row
    parts = row["parts_mb"]
    # two share clones of a desktop: their cgroups, the page images they map, their monitors
    assert parts["cgroups"] > 10 and parts["page_images"] > 10 and parts["monitors"] > 0, parts
    assert row["per_desktop_mb"] < 150, row  # a copy of a desktop is ~180 MB; a share clone far less
    assert workspace_memory()["workspaces"] == 0  # every desktop of the run was closed
