"""The pure parts of ``bunshin bench containment``: figures read from the sub-benchmarks' output,
the before/after comparison and its table, the worktree of the old revision. No workspace
runs here; the bench itself is run by hand (bench/results/containment.*)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin_gym.bench import containment as c
from bunshin_gym.cli import parser


def _fork_doc(fanout_copy: float = 3.0, share_restore: float = 385.0, copy_restore: float = 5000.0) -> dict:
    def mode(fanout: float, frozen: float, restore: float, activity: float) -> dict:
        return {"first_snapshot": {"frozen_ms": frozen},
                "by_n": {"16": {"fanout_s": fanout, "after_restore": {"unique": restore, "pss": 1.0},
                                "after_activity": {"unique": activity, "pss": 1.0},
                                "delta_snapshot": {"frozen_ms": frozen / 3},
                                "rollback": {"median_ms": 150.0}}}}
    return {"modes": {"copy": mode(fanout_copy, 420.0, copy_restore, 5050.0),
                      "share": mode(1.0, 400.0, share_restore, 620.0)}}


def _figures(**kw) -> dict:
    return {**c.fork_figures(_fork_doc(**kw)), **c.step_figures({"step_s": [0.010] * 40 + [0.020] * 10})}


def test_fork_figures_reads_n16_of_copy_and_share():
    f = c.fork_figures(_fork_doc())
    assert f["fanout_copy_s"] == 3.0 and f["fanout_share_s"] == 1.0
    assert f["frozen_first_copy_ms"] == 420.0 and f["frozen_delta_share_ms"] == pytest.approx(133.333, abs=1e-3)
    assert f["rollback_share_ms"] == 150.0
    assert f["ratio_restore"] == round(385 / 5000, 4) and f["ratio_activity"] == round(620 / 5050, 4)


def test_step_figures_median_and_p90():
    f = c.step_figures({"step_s": [0.010] * 40 + [0.020] * 10})
    assert f == {"step_median_ms": 10.0, "step_p90_ms": 20.0}
    with pytest.raises(ValueError):
        c.step_figures({"step_s": []})


def test_compare_times_take_the_best_round_and_judge_the_goal():
    before = [_figures(fanout_copy=3.0), _figures(fanout_copy=4.0)]
    after = [_figures(fanout_copy=3.2), _figures(fanout_copy=3.6)]  # best 3.2 / best 3.0
    rows = c.compare(before, after)
    r = rows["fanout_copy_s"]
    assert (r["before"], r["after"], r["ratio"], r["ok"]) == (3.0, 3.2, 1.067, True)
    assert r["before_rounds"] == [3.0, 4.0] and r["after_rounds"] == [3.2, 3.6]
    slow = c.compare(before, [_figures(fanout_copy=3.4)])["fanout_copy_s"]
    assert slow["ratio"] == 1.133 and slow["ok"] is False
    assert rows["unique_restore_copy_mb"]["ok"] is None  # memory in MB is shown, not judged
    with pytest.raises(ValueError):
        c.compare(before, [])


def test_compare_memory_ratio_unchanged_within_noise():
    before = [_figures(share_restore=385.0), _figures(share_restore=390.0)]
    same = c.compare(before, [_figures(share_restore=395.0)])["ratio_restore"]
    assert same["ok"] is True  # 0.079 vs 0.0775: within 5%
    doubled = c.compare(before, [_figures(share_restore=770.0)])["ratio_restore"]
    assert doubled["ok"] is False and doubled["ratio"] == pytest.approx(1.987, abs=1e-3)


def test_render_has_every_metric_and_the_verdicts():
    rows = c.compare([_figures(fanout_copy=3.0)], [_figures(fanout_copy=3.6)])
    text = c.render(rows)
    for m in c.METRICS:
        assert m.label in text
    line = next(x for x in text.splitlines() if x.startswith("fan-out 16 clones, copy"))
    assert "1.200x" in line and "NO" in line


def test_worktree_of_a_revision_links_envs(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "bunshin_gym").mkdir(parents=True)
    (repo / "envs").mkdir()
    (repo / "bunshin_gym" / "__init__.py").write_text("")
    (repo / "envs" / "__init__.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    tree = c.worktree(sha, repo)
    try:
        assert tree != repo and (tree / "bunshin_gym" / "__init__.py").exists()
        assert (tree / "bunshin_gym" / "envs").resolve() == (tree / "envs").resolve()
        assert c.worktree(sha, repo) == tree  # reused, not made again
        with pytest.raises(ValueError, match="not a commit"):
            c.worktree("no-such-rev", repo)
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=True)


def test_cli_parses_containment():
    args = parser().parse_args(["bench", "containment", "--before", "abc123", "--rounds", "1", "--json", "x.json"])
    assert (args.name, args.before, args.rounds, args.json) == ("containment", "abc123", 1, "x.json")


def test_paired_steps_take_turns_and_check_each_side_runs_its_own_tree(tmp_path, monkeypatch):
    """The two step workers alternate in turns of STEP_BATCH steps; each turn's steps are
    logged with the side's name, so the order shows the turns. A stand-in worker (no env)."""
    order = tmp_path / "order"
    worker = r"""
import json, os, sys, time
print(json.dumps({"package": os.path.join(os.getcwd(), "bunshin_gym", "__init__.py")}), flush=True)
for line in sys.stdin:
    n = int(line.split()[1])
    with open(os.environ["ORDER"], "a") as f:
        f.write(os.path.basename(os.getcwd()) + f" {n}\n")
    print(json.dumps({"step_s": [0.001] * n, "last_step_timing_step_s": []}), flush=True)
"""
    monkeypatch.setattr(c, "STEP_WORKER", worker)
    monkeypatch.setenv("ORDER", str(order))
    sides = {"before": tmp_path / "old", "after": tmp_path / "new"}
    for tree in sides.values():
        tree.mkdir()
    docs = c.paired_steps(sides, tmp_path, "t", steps=12, batch=5)
    assert order.read_text().split("\n")[:-1] == ["old 5", "new 5", "old 5", "new 5", "old 2", "new 2"]
    assert all(len(d["step_s"]) == 12 for d in docs.values())
    monkeypatch.setattr(c, "STEP_WORKER", worker.replace('os.getcwd(), "bunshin_gym"', '"/elsewhere"'))
    with pytest.raises(RuntimeError, match="not the code of"):
        c.paired_steps(sides, tmp_path, "u", steps=2)
