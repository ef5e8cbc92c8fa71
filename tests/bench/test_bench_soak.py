"""``bunshin bench soak`` on tiny parameters (real workspaces, shell envs only): it does real
operations and reports 0 errors and 0 leaks; and its leak count sees what a run leaves."""

from __future__ import annotations

import json

from bunshin_gym.bench import soak
from bunshin_gym.cli import main
from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace


def test_tiny_soak_through_the_cli_has_no_errors_and_no_leaks(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--cycles", "3", "--minutes", "0.2", "--threads", "2", "--envs", "shell",
               "--json", str(out)])
    doc = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert doc["errors"] == 0, doc["cycles"]["first_errors"] | doc["mixed"]["first_errors"]
    assert doc["leaks_total"] == 0, doc["leaked"]
    assert rc == 0
    # it did real work of every kind: cycles in each memory mode, and the phase-2 mix
    assert {f"fork_{m}" for m in soak.MODES} <= set(doc["cycles"]["ops"])
    assert doc["cycles"]["ops"]["exec"] == 3
    assert {"shell:make", "shell:reset", "shell:step", "shell:clone", "shell:snapshot", "shell:rollback",
            "shell:close"} <= set(doc["mixed"]["ops"]), doc["mixed"]["ops"]
    assert doc["made"]["workspaces"] >= 4 and doc["made"]["snapshots"] >= 2
    assert set(doc["leaks"]) == {"records", "mounts", "cgroups", "subvolumes", "processes", "netns",
                                 "tmpfs_images", "snapshots", "snapshot_views"}
    assert "leaks after the run" in printed and "total:" in printed


def test_leak_count_sees_what_a_run_leaves():
    """The counter is no rubber stamp: a workspace and a snapshot left open are counted."""
    made = soak.Made()
    baseline = {"children": soak._children(made.pid), "netns_fds": soak._netns_fds()}
    made.start()
    try:
        ws = Workspace.create("base")
        snap = ws.snapshot()
    finally:
        made.stop()
    try:
        left = soak.leaks(made, baseline)
        assert left["records"] == [ws.id] and left["subvolumes"] == [ws.id]
        assert left["cgroups"] and left["processes"]
        assert left["snapshots"] == [snap.id]
    finally:
        snap.delete()
        ws.close()
    left = soak.leaks(made, baseline)
    assert not any(left.values()), left
    assert not (paths().pool / "snap-views" / snap.id).exists()
