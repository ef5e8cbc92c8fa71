"""``bunshin bench scaling`` (Fig. 2): projections, the stop rule, the outputs, and a small real
run on the desktop env (slow)."""

from __future__ import annotations

import json

import pytest

from bunshin_gym.bench import scaling as S


def test_projection_is_linear_per_rollout_from_the_largest_count():
    assert S.project([], 16) is None
    pts = [{"rollouts": 8, "peak_mb": 400.0}, {"rollouts": 16, "peak_mb": 640.0}]
    assert S.project(pts, 32) == 1280 * 2**20


def test_ratios_pair_the_counts_both_modes_measured():
    pts = {"copy-base": [{"rollouts": 8, "peak_mb": 800.0}, {"rollouts": 16, "peak_mb": 1600.0}],
           "share-base": [{"rollouts": 8, "peak_mb": 400.0}]}
    assert S.ratios(pts) == [{"rollouts": 8, "share_mb": 400.0, "copy_mb": 800.0, "ratio": 0.5}]


def test_bad_counts_and_modes_are_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        S.run(None, counts=(8, 12), group=8)
    with pytest.raises(ValueError, match="need 16 tasks"):
        S.run(None, counts=(128,), group=8)
    with pytest.raises(ValueError, match="unknown modes"):
        S.run(None, modes=("full",))


def _fake_concurrent_run(peak_per_rollout: dict[str, float], calls: list):
    def run_concurrently(recs, *, env_id, group, mode):
        calls.append((mode, len(recs), group))
        n = len(recs) * group
        peak = peak_per_rollout[mode] * n
        return {"memory": {"peak_mb": peak, "integral_gb_s": 1.0}, "wall_s": 1.0, "rewards": [1.0] * n,
                "all_forked_s": 0.5, "errors": [],
                "memory_parts_at_peak": {"cgroups": peak, "page_images": 0.0, "monitors": 0.0},
                "memory_parts_trace": [[0.0, peak, 0.0, 0.0, 0.0, n + len(recs)]], "running": [(0.0, n)],
                "memory_trace": [(0.0, peak)]}
    return run_concurrently


def test_a_count_projected_past_the_host_share_is_not_run_and_is_reported(tmp_path, monkeypatch):
    calls: list = []
    # the double stands for the desktops: what is checked is which counts run
    monkeypatch.setattr(S, "run_concurrently", _fake_concurrent_run({"copy-base": 100.0, "share-base": 10.0}, calls))
    total = 10_000 * 2**20
    monkeypatch.setattr(S, "_host_used", lambda: (1_000 * 2**20, total))
    path = tmp_path / "scaling.json"
    doc = S.run(str(path), counts=(2, 4, 8, 16), group=2, host_fraction=0.2)  # 2000 MB allowed, 1000 used
    # copy: 2 -> 200 MB, 4 -> 400, 8 -> projected 800 (fits), 16 -> projected 1600: past 2000 with 1000 used
    assert [p["rollouts"] for p in doc["modes"]["copy-base"]] == [2, 4, 8]
    assert doc["stopped"]["copy-base"]["at"] == 16 and doc["stopped"]["copy-base"]["projected_mb"] == 1600.0
    assert [p["rollouts"] for p in doc["modes"]["share-base"]] == [2, 4, 8, 16] and "share-base" not in doc["stopped"]
    assert {("copy-base", 1, 2), ("share-base", 8, 2)} <= set(calls)
    assert [r["ratio"] for r in doc["ratios"]] == [0.1, 0.1, 0.1]
    saved = json.loads(path.read_text())
    assert saved["stopped"] == doc["stopped"] and set(saved["trajectories"]) == {"2", "4", "8", "16"}
    text = (tmp_path / "scaling.txt").read_text()
    assert "copy-base stopped at 16 rollouts" in text and "share / copy" in text
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "scaling.png").unlink()
    again = S.refigure(str(path))  # the figures of a saved run, redrawn
    assert again["ratios"] == doc["ratios"] and (tmp_path / "scaling.png").exists()


@pytest.mark.slow
def test_four_concurrent_desktop_rollouts_in_both_modes(tmp_path):
    """Two groups of G=2 on Bunshin-OSWorld-v0, copy and share: real desktops, memory per part,
    all four members live at once (the barrier); each source is parked once its members are
    forked, so at most both sources and the four members ever ran together."""
    from bunshin_gym.rollout.runmemory import workspace_memory

    before = workspace_memory()["workspaces"]
    doc = S.run(str(tmp_path / "s.json"), counts=(4,), group=2)
    copy, share = doc["modes"]["copy-base"][0], doc["modes"]["share-base"][0]
    for p in (copy, share):
        assert p["most_running"] == 4 and 4 <= p["most_workspaces"] <= 6
        assert p["peak_mb"] > 0 and len(p["rewards"]) == 4 and not p["errors"] and p["all_forked_s"] > 0
    assert copy["parts_at_peak"]["page_images"] == 0.0  # private copies map no shared images
    assert share["parts_at_peak"]["page_images"] > 0 and share["parts_at_peak"]["monitors"] > 0
    assert doc["ratios"][0]["rollouts"] == 4
    assert workspace_memory()["workspaces"] == before  # every workspace closed
