"""``bunshin bench epoch``: the recorded trajectories, the figures computed from a run, the
memory of a run's own workspaces, and a quick real run on the desktop env (slow)."""

from __future__ import annotations

import json
import random

import pytest

from bunshin_gym.bench import epoch as E
from bunshin_gym.core import boots
from bunshin_gym.envs.osworld.env import OSWorldEnv, check_computer_13
from bunshin_gym.envs.webarena.actions import parse_action
from bunshin_gym.rollout.signature import signature
from bunshin_gym.workspace import Workspace


def _trajs(env_id=E.OSWORLD, n=4, group=8, epochs=3, seed=7):
    return E.make_trajectories(env_id, E.TASKS[env_id][:n], group=group, epochs=epochs, seed=seed,
                               think=E.ThinkTime())


def test_trajectories_are_reproducible_from_the_seed_and_shaped_as_asked():
    a, b, c = _trajs(), _trajs(), _trajs(seed=8)
    assert a == b and a != c
    assert len(a) == 4 * 3 and {r["epoch"] for r in a} == {0, 1, 2}
    for r in a:
        assert len(r["members"]) == 8
        for m in r["members"]:
            assert len(m["think"]) == len(m["actions"]) and all(t > 0 for t in m["think"])
    assert json.loads(json.dumps(a)) == a  # saved with the results as they are


def test_desktop_groups_speak_both_action_kinds_and_every_action_is_valid():
    trajs = _trajs(n=8)
    kinds = {r["kind"] for r in trajs}
    assert kinds == {"pyautogui", "computer_13"}
    for r in trajs:
        for m in r["members"]:
            for a in m["actions"]:
                if r["kind"] == "computer_13":
                    check_computer_13(a, 1920, 1080)  # raises on a malformed action
                else:
                    assert isinstance(a, str)
                    if a not in ("WAIT", "DONE", "FAIL"):
                        compile(a, "<action>", "exec")
            assert m["actions"][-1] in ("DONE", {"action_type": "DONE"})  # every member ends its episode


def test_web_actions_parse_and_end_with_stop():
    for r in _trajs(E.WEBARENA, n=8):
        assert r["kind"] == "webarena"
        for m in r["members"]:
            kinds = [parse_action(a).kind for a in m["actions"]]
            assert kinds[-1] == "stop" and "stop" not in kinds[:-1]


def test_later_epochs_revisit_earlier_prefixes_and_groups_share_them():
    trajs = _trajs()
    for task in E.TASKS[E.OSWORLD][:4]:
        recs = {r["epoch"]: r for r in trajs if r["task"] == task}
        kind = recs[0]["kind"]
        first = {tuple(signature(a, kind) for a in m["actions"][:2]) for m in recs[0]["members"]}
        # the members of one group do not all explore differently
        assert len(first) < len(recs[0]["members"])
        for later in (1, 2):
            revisits = [m for m in recs[later]["members"]
                        if tuple(signature(a, kind) for a in m["actions"][:2]) in first]
            assert revisits, f"{task}: epoch {later + 1} revisits no prefix of epoch 1"


def test_members_mix_full_and_cut_short_solutions():
    oracles = {t: E.oracle(E.OSWORLD, t) for t in E.TASKS[E.OSWORLD][:4]}
    trajs = _trajs()
    full = cut = 0
    for r in trajs:
        solve = E._solution(r["kind"], oracles[r["task"]])
        last = E.last_real_step(solve)
        assert not E._is_wait(solve[last])
        for m in r["members"]:
            sigs = [signature(a, r["kind"]) for a in m["actions"]]
            assert all(signature(a, r["kind"]) in sigs for a in solve[:last])
            if signature(solve[last], r["kind"]) in sigs:
                full += 1
            else:
                cut += 1
    assert full and cut


def test_think_time_is_lognormal_around_the_scaled_median():
    think = E.ThinkTime(median_s=6.0, sigma=0.6, scale=0.2)
    rng = random.Random(1)
    xs = sorted(think.draw(rng) for _ in range(4000))
    assert 1.1 < xs[len(xs) // 2] < 1.3  # median 6 s * 0.2
    assert 2.0 < xs[int(0.9 * len(xs))] / xs[len(xs) // 2] < 2.4  # exp(1.2816 * 0.6) = 2.16
    assert "lognormal" in think.describe() and "0.2" in think.describe()


def test_pyautogui_oracle_actions_translate_to_computer_13():
    assert E.to_computer_13("pyautogui.write('ls\\n')") == [{"action_type": "TYPING", "text": "ls\n"}]
    assert E.to_computer_13("pyautogui.hotkey('ctrl', 's')") == [{"action_type": "HOTKEY", "keys": ["ctrl", "s"]}]
    assert E.to_computer_13("pyautogui.press('down', presses=3)") == [{"action_type": "PRESS", "key": "down"}] * 3
    assert E.to_computer_13("pyautogui.click(900, 700)")[0]["x"] == 900
    assert E.to_computer_13("import time; time.sleep(0.5)") == [{"action_type": "WAIT"}]
    assert E.to_computer_13("DONE") == [{"action_type": "DONE"}]
    with pytest.raises(ValueError):
        E.to_computer_13("pyautogui.dragTo(1, 2)")
    with pytest.raises(ValueError):
        E.to_computer_13("x = 1\ny = 2\nz = 3")


def test_bad_sizes_and_envs_are_refused():
    with pytest.raises(ValueError, match="group >= 1"):
        E.make_trajectories(E.OSWORLD, ["osworld/terminal-count-lines"], group=0, epochs=1, seed=1,
                            think=E.ThinkTime())
    with pytest.raises(ValueError, match="unknown env"):
        E.run(None, env_id="Bunshin-Nope-v0")
    with pytest.raises(ValueError, match="unknown modes"):
        E.run(None, modes=("base",))


def test_running_curve_counts_spans_holding_each_instant():
    curve = E.running_curve([(0.0, 10.0), (0.0, 5.0), (2.0, 4.0)], points=10)
    assert curve[0] == (0.0, 2) and dict(curve)[3.0] == 3 and dict(curve)[6.0] == 1 and curve[-1] == (10.0, 0)
    assert E.running_curve([]) == []


def test_memory_figures_peak_and_integral():
    gib = 2**30
    f = E.memory_figures([(0.0, 0), (1.0, gib), (3.0, gib), (4.0, 0)])
    assert f == {"peak_mb": 1024.0, "integral_gb_s": 3.0}  # 0.5 + 2 + 0.5 GiB*s


def _epoch(n, wall, peak, served, rewards):
    return {"epoch": n, "wall_s": wall, "served_fraction": served, "rewards": rewards,
            "memory": {"peak_mb": peak, "integral_gb_s": 1.0}, "served": {"cache": 1, "speculation": 0, "executed": 1},
            "running": [(0.0, 2), (wall, 0)], "memory_trace": [(0.0, 0.0), (wall, peak)]}


def _results(full_wall=70.0, share_peak=500.0, rewards_full=(1.0, 0.0)):
    modes = {
        "copy-base": [_epoch(n, 140.0, 1000.0, 0.0, [1.0, 0.0]) for n in (1, 2, 3)],
        "share-base": [_epoch(n, 100.0, share_peak, 0.0, [1.0, 0.0]) for n in (1, 2, 3)],
        "spec": [_epoch(n, 90.0, share_peak, 0.2, [1.0, 0.0]) for n in (1, 2, 3)],
        "full": [_epoch(n, full_wall, share_peak * 1.02, 0.3 * n, list(rewards_full)) for n in (1, 2, 3)],
    }
    return {"env": E.OSWORLD, "tasks": ["t"], "group": 2, "epochs": 3, "parallel": 1,
            "think_distribution": "x", "load_average": {}, "modes": {k: {"epochs": v} for k, v in modes.items()}}


def test_targets_are_marked_ok_or_no_from_the_figures():
    res = _results()
    marks = {t["target"]: t["ok"] for t in E.evaluate_targets(res)}
    assert all(marks.values()), marks  # 0.5x memory, 1.4x copy, 1.43x full, +2% memory, 90% served, same rewards
    res = _results(full_wall=90.0, share_peak=700.0, rewards_full=(0.0, 0.0))
    marks = {t["target"]: t["ok"] for t in E.evaluate_targets(res)}
    assert not marks[E.TARGETS[0][0]]  # 0.7x
    assert not marks[E.TARGETS[2][0]]  # 1.11x
    assert not marks[E.TARGETS[5][0]]  # rewards differ
    assert marks[E.TARGETS[1][0]] and marks[E.TARGETS[4][0]]


def test_the_restore_target_compares_measured_hot_and_cold_restores():
    res = _results()
    assert E.TARGETS[6][0] not in {t["target"] for t in E.evaluate_targets(res)}  # not measured: no row
    res["restores"] = {"hot": {"mean_s": 1.2}, "cold": {"mean_s": 1.8}}
    row = {t["target"]: t for t in E.evaluate_targets(res)}[E.TARGETS[6][0]]
    assert row["ok"] and row["measured"] == "hot 1.2 s, cold 1.8 s (1.50x)"
    res["restores"]["cold"]["mean_s"] = 1.1
    assert not {t["target"]: t for t in E.evaluate_targets(res)}[E.TARGETS[6][0]]["ok"]
    # with spares: the cache's hot path is the spare's; every "spare" restore must have taken one
    res["restores"] = {"spare": {"median_s": 0.2}, "hot": {"median_s": 1.0}, "cold": {"median_s": 1.1},
                       "spares_taken": 4, "spares_tried": 4}
    row = {t["target"]: t for t in E.evaluate_targets(res)}[E.TARGETS[6][0]]
    assert row["ok"] and "with a spare 0.2 s" in row["measured"] and "5.50x" in row["measured"]
    res["restores"]["spares_taken"] = 3
    assert not {t["target"]: t for t in E.evaluate_targets(res)}[E.TARGETS[6][0]]["ok"]


def test_hot_and_cold_restores_are_measured_as_the_cache_restores_and_leave_nothing():
    from bunshin_gym.workspace.snapshot import SnapshotStore

    mem = E.workspace_memory()
    r = E.measure_restores("Bunshin-Shell-v0", "shell/make-dir", ["echo a > /home/user/a", "echo b > /home/user/b"],
                           rounds=2)
    assert len(r["spare"]["times_s"]) == len(r["hot"]["times_s"]) == len(r["cold"]["times_s"]) == 4  # 2 x 2
    assert all(t > 0 for k in ("spare", "hot", "cold") for t in r[k]["times_s"]) and len(r["images_mb"]) == 2
    assert r["spares_taken"] == r["spares_tried"] == 4  # each "spare" restore thawed the one made for it
    ids = {s.id for s in SnapshotStore().list()}
    assert len(r["snapshots"]) == 2 and not ids & set(r["snapshots"])  # its snapshots are deleted
    assert E.workspace_memory()["workspaces"] == mem["workspaces"]  # and its env closed
    with pytest.raises(ValueError, match="two actions"):
        E.measure_restores("Bunshin-Shell-v0", "shell/make-dir", ["ls"])


def test_run_to_run_noise_compares_spec_epoch_1_with_share_base():
    res = _results()
    assert E.run_to_run_noise(res) == {"spec_s": 90.0, "share_base_s": 100.0, "ratio": 0.9}
    res["modes"]["spec"]["epochs"][0]["speculation"] = {"launched": 1}  # it speculated: not a twin run
    assert E.run_to_run_noise(res) is None


def test_speculation_in_spec_and_full_modes_is_bounded_by_a_share_of_the_runs_memory(tmp_path, monkeypatch):
    from bunshin_gym.rollout.speculation import MEMORY_FRACTION

    seen = {}

    def replay_group(rec, group, cache, spec, log, **kwargs):  # the groups' run itself is not the point here
        seen[kwargs["kind"]] = spec
        return []

    monkeypatch.setattr(E, "replay_group", replay_group)
    for mode in ("spec", "full"):
        state = E._ModeState(mode, tmp_path)
        state.log.record(task="t", episode="e", depth=0, signature="ls", action="ls", duration=2.0, served="executed")
        seen.clear()
        E.run_epoch(state, [{"epoch": 1, "task": "t", "kind": "pyautogui", "members": []}], env_id=E.OSWORLD,
                    group=1, parallel=1, min_speculate_s=0.8)
        spec = seen["pyautogui"]
        assert spec.memory is not None and spec.memory.fixed is None  # sized from the run
        assert spec.timing is state.spec_timing  # what forks took carries over to the next epoch
        assert spec.memory.fraction == MEMORY_FRACTION == 0.03
        if state.cache is not None:
            state.cache.clear()


def test_table_and_one_png_per_figure(tmp_path):
    res = _results(full_wall=90.0)
    res["targets"] = E.evaluate_targets(res)
    text = E.summarise(res)
    assert "full >= 1.25x faster" in text and " NO" in text and " ok" in text
    out = E.plot(res, str(tmp_path / "epoch-test"))
    assert set(out) == {"epoch_time", "running", "memory", "hit_rate", "rewards"}
    for path in out.values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_workspace_memory_counts_this_process_workspaces_only():
    before = E.workspace_memory()
    ws = Workspace.create("base")
    try:
        ws.exec("head -c 64m /dev/urandom > /dev/shm/blob")  # 64 MiB charged to its cgroup (shmem)
        mid = E.workspace_memory()
        assert mid["workspaces"] == before["workspaces"] + 1
        assert mid["cgroups"] - before["cgroups"] >= 64 * 2**20
        snap = ws.snapshot()
        try:
            clones = snap.fork(2, mode="share")
            try:
                with_clones = E.workspace_memory()
                assert with_clones["workspaces"] == mid["workspaces"] + 2
                assert with_clones["page_images"] > 0 and with_clones["monitors"] > 0
            finally:
                for c in clones:
                    c.close()
        finally:
            snap.delete()
    finally:
        ws.close()
    after = E.workspace_memory()
    assert after["workspaces"] == before["workspaces"] and after["cgroups"] <= before["cgroups"] + 2**20
    # another process's workspaces are not counted
    assert E.workspace_memory(owner=1)["workspaces"] == 0


@pytest.mark.slow
def test_quick_run_on_the_desktop(tmp_path, monkeypatch):
    """2 tasks x G=2 x 2 epochs in all four modes, on Bunshin-OSWorld-v0 (real desktops)."""
    booted: list[str] = []
    real_boot = OSWorldEnv.boot
    monkeypatch.setattr(OSWorldEnv, "boot", lambda self, ws: (booted.append(self.memory_mode), real_boot(self, ws)))
    path = tmp_path / "epoch-quick.json"
    doc = E.run(str(path), env_id=E.OSWORLD, size=E.QUICK, seed=3)
    # one boot per memory mode for the whole run, before the epochs; none kept after it
    assert sorted(booted) == ["copy", "share"] and set(doc["boot_s"]) == {"copy", "share"}
    assert not [k for k in boots.held() if k[1] == "OSWorldEnv"]
    saved = json.loads(path.read_text())
    assert saved["trajectories"] == doc["trajectories"] and len(doc["trajectories"]) == 2 * 2
    assert set(doc["modes"]) == set(E.MODES)
    for mode, m in doc["modes"].items():
        assert [e["epoch"] for e in m["epochs"]] == [1, 2]
        for e in m["epochs"]:
            assert len(e["rewards"]) == 2 * 2
            assert e["memory"]["peak_mb"] > 0, mode  # the run's own workspaces, measured
    rewards = {t["target"]: t for t in doc["targets"]}[E.TARGETS[5][0]]
    assert rewards["ok"], doc["modes"]
    assert sum(doc["modes"]["full"]["epochs"][1]["served"][k] for k in ("cache", "speculation")) > 0
    for png in doc["figures"].values():
        assert (tmp_path / png.rsplit("/", 1)[1]).exists()
    assert (tmp_path / "epoch-quick.txt").read_text().count(" ok") + \
        (tmp_path / "epoch-quick.txt").read_text().count(" NO") >= 5
    # a rerun replays the saved trajectories (same actions, same think times), with the same rewards
    again = E.run(None, replay=str(path), modes=("share-base",), seed=99)
    assert again["trajectories"] == doc["trajectories"] and again["seed"] == 3
    assert [e["rewards"] for e in again["modes"]["share-base"]["epochs"]] == \
        [e["rewards"] for e in doc["modes"]["share-base"]["epochs"]]


def test_an_episode_ended_by_a_failed_workspace_is_reported_and_fails_its_target():
    res = _results()
    assert E.TARGETS[7][0] not in {t["target"] for t in E.evaluate_targets(res)}  # a run saved before: no row
    for m in res["modes"].values():
        for e in m["epochs"]:
            e["workspace_failures"] = []
    row = {t["target"]: t for t in E.evaluate_targets(res)}[E.TARGETS[7][0]]
    assert row["ok"] and row["measured"] == "copy-base 0, share-base 0, spec 0, full 0 failed"
    res["modes"]["spec"]["epochs"][1]["workspace_failures"] = [
        {"task": "osworld/editor-fix-port", "member": 3, "error": "the workspace failed: gone"}]
    res["targets"] = E.evaluate_targets(res)
    row = {t["target"]: t for t in res["targets"]}[E.TARGETS[7][0]]
    assert not row["ok"] and "spec 1" in row["measured"]
    text = E.summarise(res)
    assert "spec epoch 2: osworld/editor-fix-port member 3: the workspace failed: gone" in text


def test_run_epoch_keeps_which_member_a_failed_workspace_ended(tmp_path, monkeypatch):
    def replay_group(rec, group, cache, spec, log, **kwargs):  # member 1's workspace failed
        return [(1.0, 2.0, ["executed"], 2.0, None), (0.0, 1.0, ["executed"], 1.0, "the workspace failed: x")]

    monkeypatch.setattr(E, "replay_group", replay_group)
    e = E.run_epoch(E._ModeState("share-base", tmp_path), [{"epoch": 0, "task": "t", "kind": "shell", "members": []}],
                    env_id=E.OSWORLD, group=2, parallel=1, min_speculate_s=0.8)
    assert e["rewards"] == [1.0, 0.0]
    assert e["workspace_failures"] == [{"task": "t", "member": 1, "error": "the workspace failed: x"}]
