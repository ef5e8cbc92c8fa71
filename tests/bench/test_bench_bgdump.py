"""`bunshin bench bgdump`: both dump paths side by side from the command line, on a small heap;
the background path reports a frozen time up to the thaw and its snapshot forks a live clone."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_bgdump_from_the_command_line_measures_both_paths(tmp_path):
    out = tmp_path / "bgdump.json"
    proc = subprocess.run([sys.executable, "-m", "bunshin_gym.cli", "bench", "bgdump", "--heap-mb", "32",
                           "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["heap_mb"] == 32 and res["rounds"] == 1
    assert [len(res["runs"][k]) for k in ("stop-the-world", "background")] == [1, 1]
    for path in ("stop-the-world", "background"):
        m = res["median"][path]
        assert 0 < m["frozen_ms"] <= m["snapshot_ms"] and m["bytes"] > 32 << 20
    assert res["clone_of_background_snapshot_answers"] is True
    assert "median frozen: stop-the-world" in proc.stdout
