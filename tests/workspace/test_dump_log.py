"""A snapshot's CRIU dump log (``criu/dump.log``): by default it holds CRIU's errors and warnings
only, as CRIU formats and writes each line while the workspace is frozen (info lines cost a
desktop ~17,000 lines and ~80 ms of frozen time); ``BUNSHIN_CRIU_DUMP_VERBOSITY`` brings the
info lines back for debugging."""

from __future__ import annotations

#: lines CRIU logs at level 3 (info) in every dump
INFO_LINES = ("Dumping task (pid:", "Seized task")


def _dump_log(ws) -> str:
    snap = ws.snapshot()
    try:
        return (snap.criu_dir / "dump.log").read_text(errors="replace")
    finally:
        snap.delete()


def test_a_dump_logs_no_info_lines_by_default_and_does_at_level_3(fresh_ws, monkeypatch):
    monkeypatch.delenv("BUNSHIN_CRIU_DUMP_VERBOSITY", raising=False)
    quiet = _dump_log(fresh_ws)
    assert not [line for line in INFO_LINES if line in quiet], quiet[-2000:]
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")
    told = _dump_log(fresh_ws)
    assert all(line in told for line in INFO_LINES), told[-2000:]
    assert len(told) > 10 * max(len(quiet), 1)
