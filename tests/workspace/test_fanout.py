"""Fan-out of a fork (``forking.restore_clones`` with :mod:`bunshin_gym.workspace.fanout`):
the once-per-fork work runs beside the clones' set-ups, at most ``restores_at_once`` CRIU
restores run at a time, restores log at ``restore_verbosity``, every phase is traced, and a
clone that fails leaves the source running and nothing behind. ``fanout.BEFORE`` is the path
before, kept for ``bunshin bench fork``'s ``-before`` labels."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import pytest

from bunshin_gym.workspace import Workspace, fanout, forking, uffd
from bunshin_gym.workspace.errors import ForkError


# the options and the trace, without a workspace -----------------------------------------
def test_restore_limit_is_the_option_or_every_clone():
    assert fanout.FanoutOptions(restores_at_once=3).restore_limit(16) == 3
    assert fanout.FanoutOptions(restores_at_once=3).restore_limit(2) == 2
    assert fanout.FanoutOptions(restores_at_once=0).restore_limit(16) == 16


def test_using_sets_the_options_for_every_thread_and_puts_them_back():
    seen = []
    with fanout.using(fanout.BEFORE):
        t = threading.Thread(target=lambda: seen.append(fanout.current()))
        t.start()
        t.join()
    assert seen == [fanout.BEFORE]
    assert fanout.current() == fanout.DEFAULT
    with pytest.raises(RuntimeError), fanout.using(fanout.BEFORE):
        raise RuntimeError("inside")
    assert fanout.current() == fanout.DEFAULT


def test_a_trace_sums_each_phase_and_phases_outside_a_trace_go_nowhere():
    with fanout.phase("untraced", "c0"):
        pass
    with fanout.tracing() as trace:
        for clone in ("c1", "c2"):
            with fanout.phase("criu", clone):
                time.sleep(0.02)
    with fanout.phase("after", "c3"):
        pass
    phases = trace.phases()
    assert list(phases) == ["criu"]
    assert phases["criu"]["clones"] == 2
    assert phases["criu"]["sum_s"] >= 0.04
    assert phases["criu"]["last_s"] - phases["criu"]["first_s"] >= 0.04


# forks -----------------------------------------------------------------------------------
@pytest.fixture
def source():
    ws = Workspace.create("base", memory_mode="share")
    snap = None
    try:
        ws.write_file("/root/kept", "kept\n")
        snap = ws.snapshot()
        yield ws, snap
    finally:
        ws.close()
        if snap is not None:
            snap.delete()


def _fork(snap, n: int, options: fanout.FanoutOptions) -> tuple[list[Workspace], fanout.FanoutTrace]:
    with fanout.using(options), fanout.tracing() as trace:
        clones = snap.fork(n)
    return clones, trace


def _check_and_close(clones: list[Workspace]) -> None:
    from conftest import leftovers

    try:
        for c in clones:
            assert c.exec("cat /root/kept").text == "kept\n"
    finally:
        for c in clones:
            c.close()
    assert not leftovers([c.id for c in clones])


def _slow_image_copy(monkeypatch, seconds: float = 0.4) -> None:
    """share's tmpfs copy of the images takes ``seconds`` longer (and is made again: no copy
    kept from an earlier fork), so that what runs beside it shows."""
    uffd.release_images(None, None)
    real = uffd.prepare_images

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(uffd, "prepare_images", slow)


def test_the_clones_set_ups_run_beside_the_image_copy(source, monkeypatch):
    _ws, snap = source
    _slow_image_copy(monkeypatch)
    clones, trace = _fork(snap, 3, fanout.DEFAULT)
    _check_and_close(clones)
    phases = trace.phases()
    assert phases["setup"]["clones"] == phases["files"]["clones"] == phases["criu"]["clones"] == 3
    # every clone's record, cgroup and file system were made while the copy was being made
    assert phases["files"]["last_s"] < phases["prepare"]["last_s"], phases

    _slow_image_copy(monkeypatch)
    clones, trace = _fork(snap, 3, fanout.BEFORE)
    _check_and_close(clones)
    phases = trace.phases()
    assert phases["setup"]["first_s"] >= phases["prepare"]["last_s"], phases  # the path before: one after the other


def test_at_most_restores_at_once_restores_run_at_a_time(source):
    _ws, snap = source
    clones, trace = _fork(snap, 3, dataclasses.replace(fanout.DEFAULT, restores_at_once=1))
    _check_and_close(clones)
    runs = sorted((a, b) for name, _clone, a, b in trace.events if name == "criu")
    assert len(runs) == 3
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(runs, runs[1:], strict=False)), runs

    clones, trace = _fork(snap, 3, fanout.DEFAULT)  # all at once: the restores overlap
    _check_and_close(clones)
    runs = sorted((a, b) for name, _clone, a, b in trace.events if name == "criu")
    assert any(prev[1] > nxt[0] for prev, nxt in zip(runs, runs[1:], strict=False)), runs


def test_restores_log_at_the_options_level(source, monkeypatch, tmp_path):
    """CRIU's restore log (removed after a restore that worked; kept here) has no debug or
    info lines at the default level 2, and has them at the level of the path before (4)."""
    _ws, snap = source
    real = forking._finish_restore
    kept = []

    def keep_log(rec, proc, p):
        proc.wait()
        log = p.run / "logs" / f"{rec.id}-restore.log"
        shutil.copy(log, tmp_path / log.name)
        kept.append(tmp_path / log.name)
        return real(rec, proc, p)

    monkeypatch.setattr(forking, "_finish_restore", keep_log)
    for options, debug in ((fanout.DEFAULT, False), (fanout.BEFORE, True)):
        kept.clear()
        clones, _trace = _fork(snap, 2, options)
        _check_and_close(clones)
        assert len(kept) == 2
        for log in kept:
            text = log.read_text(errors="replace")
            assert ("Forking task" in text) == debug, (options, len(text.splitlines()))


def test_a_failed_restore_stops_the_fan_out_and_leaves_nothing(source, monkeypatch):
    """One restore at a time; the first fails in CRIU (an option it refuses): the other
    clones are not restored, the CRIU error is what is raised, every clone is reclaimed, and
    the source and its snapshot work as before."""
    from conftest import leftovers

    ws, snap = source
    real = forking._start_restore
    started = []

    def first_fails(snap_, rec, p, helper=None, view=None, *, plan=None, verbosity=None):
        started.append(rec.id)
        if len(started) == 1:
            plan = dataclasses.replace(plan, args=[*plan.args, "--no-such-criu-option"])
        return real(snap_, rec, p, helper, view, plan=plan, verbosity=verbosity)

    monkeypatch.setattr(forking, "_start_restore", first_fails)
    with fanout.tracing() as trace, fanout.using(dataclasses.replace(fanout.DEFAULT, restores_at_once=1)), \
            pytest.raises(ForkError) as err:
        snap.fork(4)
    monkeypatch.undo()
    assert str(err.value).startswith(f"CRIU restore of {started[0]}"), err.value
    assert started == started[:1], started  # no other restore was started
    ids = {clone for _name, clone, _a, _b in trace.events if clone}
    assert len(ids) == 4
    assert not leftovers(ids), leftovers(ids)
    assert ws.exec("cat /root/kept").text == "kept\n"
    _check_and_close(snap.fork(2))
