"""``bunshin bench train`` (Fig. 11): the runs' arguments, the agreement rule, the outputs, and
a small real run of base and full from one seed (slow)."""

from __future__ import annotations

import json
import math

import pytest

from bunshin_gym.train import compare as C
from bunshin_gym.train.args import Args


def test_each_mode_switches_the_cache_and_speculation_and_keeps_the_rest(tmp_path):
    base = Args(seed=5, steps=3)
    b = C.mode_args("base", base, tmp_path / "b")
    f = C.mode_args("full", base, tmp_path / "f")
    assert (b.cache, b.speculation) == (False, False) and (f.cache, f.speculation) == (True, True)
    assert b.seed == f.seed == 5 and b.steps == f.steps == 3 and b.quiet and f.quiet
    assert b.out_dir == str(tmp_path / "b")
    with pytest.raises(ValueError, match="unknown rollout mode"):
        C.mode_args("spec", base, tmp_path)


def _runs(b1, b2, f):
    return [{"mode": "base", "rewards": b1, "eval_after": 0.7}, {"mode": "full", "rewards": f, "eval_after": 0.72},
            {"mode": "base", "rewards": b2, "eval_after": 0.66}]


def test_full_agrees_when_within_the_base_runs_noise_and_not_beyond():
    a = C.agreement(_runs([0.5, 0.6, 0.7], [0.6, 0.5, 0.8], [0.55, 0.55, 0.75]))
    assert a["noise_rms_base_vs_base"] == pytest.approx(0.1)
    assert a["full_rms_vs_base_mean"] == pytest.approx(0.0) and a["ok"]
    assert a["eval_after"]["noise"] == pytest.approx(0.04)
    assert a["eval_after"]["full_vs_base_mean"] == pytest.approx(0.04)
    far = C.agreement(_runs([0.5, 0.6, 0.7], [0.6, 0.5, 0.8], [0.2, 0.2, 0.3]))
    assert not far["ok"] and far["full_rms_vs_base_mean"] == pytest.approx(math.sqrt((0.35**2 * 2 + 0.45**2) / 3),
                                                                             abs=1e-4)
    # the shorter run decides how many steps are compared
    assert C.agreement(_runs([0.5, 0.6], [0.6, 0.5, 0.8], [0.55, 0.55, 0.1]))["steps"] == 2


def test_agreement_needs_two_base_runs_and_a_full_one():
    with pytest.raises(ValueError, match="two base runs"):
        C.agreement([{"mode": "base", "rewards": [0.1]}, {"mode": "full", "rewards": [0.1]}])
    with pytest.raises(ValueError, match="no GRPO steps"):
        C.agreement(_runs([], [], []))


def _report(args: Args, rewards: list[float]) -> dict:
    return {"steps": [{"reward": r, "rollout_s": 1.0} for r in rewards], "wall_s": 2.0, "out_dir": args.out_dir,
            "eval": {"before": {"mean": 0.5}, "after": {"mean": 0.6}},
            "totals": {"rollout_s": 3.0, "peak_workspace_mb": 10.0,
                       "cache": {"hit_rate": 0.4} if args.cache else {},
                       "speculation": {"matched": 2} if args.speculation else {}}}


def test_runs_take_turns_from_one_seed_and_write_json_table_and_png(tmp_path):
    seen: list[Args] = []
    curves = iter([[0.5, 0.6], [0.52, 0.61], [0.55, 0.58]])

    def train(args: Args) -> dict:  # a test double of the main job: the bench's own work is checked here
        seen.append(args)
        return _report(args, next(curves))

    path = tmp_path / "train-fig11.json"
    doc = C.run(str(path), base=Args(seed=4), out_root=tmp_path / "runs", train=train)
    assert [(a.cache, a.speculation) for a in seen] == [(False, False), (True, True), (False, False)]
    assert {a.seed for a in seen} == {4} and len({a.out_dir for a in seen}) == 3
    assert [r["label"] for r in doc["runs"]] == ["base-1", "full-1", "base-2"]
    saved = json.loads(path.read_text())
    assert saved["agreement"] == doc["agreement"] and saved["runs"][1]["rewards"] == [0.52, 0.61]
    text = (tmp_path / "train-fig11.txt").read_text()
    assert "run-to-run noise" in text and "load average" in text and ("ok" in text or "NO" in text)
    assert (tmp_path / "train-fig11-rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown rollout mode"):
        C.run(None, runs=("base", "spec"), train=train)


@pytest.mark.slow
def test_base_and_full_train_from_one_seed_through_the_real_envs(tmp_path):
    """Two GRPO steps on two shell tasks, base, full, base (about a minute and a half on 2 cores)."""
    base = Args(tasks="shell/make-dir,shell/hello-file", steps=2, num_generations=4, lr_warmup_steps=0,
                warm_start_steps=60, eval_episodes=0, tiny_hidden=64, max_turns=3, seed=3)
    doc = C.run(str(tmp_path / "t.json"), base=base, out_root=tmp_path / "runs")
    assert [r["mode"] for r in doc["runs"]] == ["base", "full", "base"]
    for r in doc["runs"]:
        assert len(r["rewards"]) == 2 and all(0.0 <= x <= 1.0 for x in r["rewards"])
    base_runs = [r for r in doc["runs"] if r["mode"] == "base"]
    full = doc["runs"][1]
    assert all(not r["cache"] and not r["speculation"] for r in base_runs)  # nothing cached or speculated
    assert full["cache"].get("misses", 0) + full["cache"].get("hits", 0) > 0  # the full run used its cache
    assert doc["agreement"]["steps"] == 2 and (tmp_path / "t-rewards.png").exists()
