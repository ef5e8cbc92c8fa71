"""bench fanout: each count forks once by the path before and once by today's, alternating,
from one snapshot per mode (a double stands in for the desktop; the real run is
``python -m bunshin_gym.bench.fanout``)."""

from __future__ import annotations

from bunshin_gym.bench import fanout as bench
from bunshin_gym.workspace import fanout


class _Clone:
    closed = 0

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        _Clone.closed += 1


class _Snapshot:
    def __init__(self) -> None:
        self.seen: list[tuple[int, fanout.FanoutOptions]] = []
        self.deleted = False

    def fork(self, n: int, mode: str) -> list[_Clone]:
        with fanout.phase("criu", "ws-x"):
            self.seen.append((n, fanout.current()))
        return [_Clone() for _ in range(n)]

    def delete(self) -> None:
        self.deleted = True


class _Source:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_each_count_forks_by_both_paths_and_everything_is_closed(monkeypatch):
    snap, src = _Snapshot(), _Source()
    monkeypatch.setattr(bench, "make_source", lambda image, heap, procs: src)
    monkeypatch.setattr(bench, "_snapshot", lambda s: snap)
    monkeypatch.setattr(bench, "group_memory", lambda pids: type("M", (), {"as_mb": lambda self: {
        "unique": 1.0, "pss": 2.0}})())
    out = bench.run(None, counts=(1, 3), modes=("share",))
    assert snap.seen == [(1, fanout.BEFORE), (1, fanout.DEFAULT), (3, fanout.BEFORE), (3, fanout.DEFAULT)]
    assert [(r["n"], r["path"]) for r in out["rows"]] == [(1, "before"), (1, "today"), (3, "before"), (3, "today")]
    assert all(r["phases"]["criu"]["clones"] == 1 for r in out["rows"])
    assert _Clone.closed == 8 and snap.deleted and src.closed
    assert fanout.current() == fanout.DEFAULT
