"""`bunshin bench bgdump`: both dump paths side by side from the command line, on a small heap;
the background path reports a frozen time up to the thaw and its snapshot forks a live clone;
``--log-levels`` adds background snapshots at other CRIU log levels, ``--fork-wait`` ones with
each copy-on-write fork waited at once (before criu/patches/0036), ``--scans-as-before`` ones
with CRIU's scans and deleted-file copies as before 0039 and 0040 and ``--ns-after-tasks`` ones
with the namespaces and tmpfs contents dumped after the tasks (before 0041), side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bunshin_gym.bench.bgdump import FORK_WAIT_SIDE, NS_AFTER_TASKS_SIDE, SCANS_AS_BEFORE_SIDE, parse_levels


def test_bench_bgdump_from_the_command_line_measures_both_paths(tmp_path):
    out = tmp_path / "bgdump.json"
    proc = subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "bench", "bgdump", "--heap-mb", "32",
                           "--rounds", "1", "--log-levels", "3", "--fork-wait", "--scans-as-before", "--settle",
                           "--ns-after-tasks", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "BUNSHIN_CRIU_DUMP_VERBOSITY"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["heap_mb"] == 32 and res["rounds"] == 1 and res["settle"] is True
    sides = ("stop-the-world", "background", "background, log level 3", FORK_WAIT_SIDE, SCANS_AS_BEFORE_SIDE,
             NS_AFTER_TASKS_SIDE)
    assert res["criu_log_level"] == 2 and [len(res["runs"][k]) for k in sides] == [1] * 6
    for path in sides:
        m = res["median"][path]
        assert 0 < m["frozen_ms"] <= m["snapshot_ms"] and m["bytes"] > 32 << 20
    assert res["clone_of_background_snapshot_answers"] is True
    assert "median frozen: stop-the-world" in proc.stdout
    assert "median frozen, background at CRIU log level 3:" in proc.stdout
    assert "median frozen, background with each fork waited at once (before 0036, 0038):" in proc.stdout
    assert "copied by CRIU (before 0039, 0040):" in proc.stdout and "of 1 rounds" in proc.stdout
    assert "dumped after the tasks (before 0041):" in proc.stdout


def test_log_levels_are_criu_levels():
    assert parse_levels("3, 4") == (3, 4) and parse_levels("") == () and parse_levels(None) == ()
    with pytest.raises(ValueError, match="0-4"):
        parse_levels("2,7")


def test_background_only_compares_background_snapshots_without_stop_the_world(tmp_path, capsys):
    from bunshin_gym.bench import bgdump

    res = bgdump.run("base", 32, 2, str(tmp_path / "bg.json"), scans_as_before=True, background_only=True)
    assert set(res["runs"]) == {"background", SCANS_AS_BEFORE_SIDE} and res["background_only"] is True
    assert all(len(rows) == 2 and all(r["background_ms"] is not None for r in rows) for rows in res["runs"].values())
    out = capsys.readouterr().out
    assert "stop-the-world" not in out and "lower in" in out and "of 2 rounds" in out
