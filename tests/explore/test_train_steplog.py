"""``bunshin train`` records its rollouts in the step log: every group of the warm start, the
evaluations and the GRPO steps, labelled by epoch, and the explorer reads the run (slow: a
real, if short, training run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bunshin_gym.explore.runs import Run, build_tree


@pytest.mark.slow
def test_train_writes_a_step_log_the_explorer_reads(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "train", "--steps", "1", "--tasks", "shell/count-files",
                    "--num-generations", "2", "--eval-episodes", "2", "--warm-start-steps", "2", "--out-dir",
                    str(out), "--quiet"], check=True, timeout=900)
    run = Run(out)
    info = run.info()
    assert info["epochs"] == ["warm start (oracle)", "eval before", "GRPO step 1", "eval after"]
    assert info["tasks"] == ["shell/count-files"] and info["bad_lines"] == 0
    groups = run.page(limit=100)["items"]
    assert [g["members"] for g in groups] == [2, 2, 2, 2]  # G=2; evaluations of 2 episodes per task
    assert groups[0]["rewards"] == [1.0, 1.0]  # the warm start plays the oracle: it solves its task
    for g in groups:
        tree = build_tree(run.group(g["group"]))
        assert tree["nodes"] >= 1 and all(r is not None for r in tree["root"]["rewards"])
    curves = run.curves()
    assert [s["step"] for s in curves["report_steps"]] == [1]
