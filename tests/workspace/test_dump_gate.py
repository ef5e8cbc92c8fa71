"""The dump gate (criu/patches/0029-dump-gate, ``dumping.GatedDump``): a snapshot starts CRIU
before it freezes the workspace; CRIU starts up while the workspace runs, says "ready", and
touches nothing until it is told the network lock method chosen frozen.

Each test is written as what could go wrong: a CRIU that seized the workspace before the go
(the workspace would stop running while CRIU waits), a gate closed early that still dumped, a
lock method that never reached the images (the command line no longer names one: CRIU's own
default, iptables, would show), a CRIU that dies at the gate leaving the source frozen."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bunshin_gym.config import criu_env, paths
from bunshin_gym.errors import ForkError
from bunshin_gym.workspace import dumping, forking
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.snapshots.criu_images import load_image

pytestmark = pytest.mark.skipif(not dumping.gate_available(),
                                reason="CRIU without criu/patches/0029-dump-gate (see criu/build.sh)")

#: CRIU's enum NETWORK_LOCK_METHOD (criu/include/cr_options.h), as the inventory stores it
LOCK_IN_IMAGES = {"iptables": 0, "nftables": 1, "skip": 2}

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"


def _count(ws) -> int:
    for _ in range(50):  # the counter truncates the file, then writes it: a read may fall between
        text = ws.exec("cat /tmp/count").text.strip()
        if text:
            return int(text)
        time.sleep(0.01)
    raise AssertionError("the counter's file stayed empty")


def _lasting(ws) -> list[int]:
    """The workspace's processes but the counter's short-lived sleeps."""
    out = []
    for pid in ws.pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
                out.append(pid)
        except OSError:
            pass
    return sorted(out)


def _gated(ws, tmp_path):
    """A gated ``criu dump`` of ``ws`` into ``tmp_path`` (started, not yet told to go)."""
    p, rec = paths(), ws._rec
    cg = Cgroup(rec.cgroup)
    freezer = cg.freezer_dir()
    images = tmp_path / "images"
    images.mkdir()
    ws._quiesce_agent()  # the controller's connections into the workspace (CRIU cannot dump them)
    cmd = forking.dump_command(rec, p, images, freezer, None)
    return dumping.GatedDump(cmd, dict(criu_env(p)), (), background=False), cg, images


def test_criu_starts_up_while_the_workspace_runs_and_a_gate_closed_before_the_go_dumps_nothing(fresh_ws, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "3")  # "Seized task", below, is an info line
    ws = fresh_ws
    ws.spawn(["sh", "-c", COUNTER])
    time.sleep(0.3)
    pids = _lasting(ws)
    gate, cg, images = _gated(ws, tmp_path)
    assert gate.ready(), "CRIU never said it was ready at the gate"
    # ready and waiting: it has seized nothing, the workspace runs on
    before = _count(ws)
    time.sleep(0.5)
    assert _count(ws) > before and not cg.is_frozen()
    assert gate.proc.poll() is None, "CRIU should wait at its gate"
    proc, thawed = gate.finish()  # the gate closed without a go
    log = (images / "dump.log").read_text()
    assert proc.returncode != 0 and thawed is None
    assert "dump gate: closed before the go" in log, log[-2000:]
    assert not (images / "pstree.img").exists() and "Seized task" not in log
    before = _count(ws)
    time.sleep(0.3)
    assert _count(ws) > before and _lasting(ws) == pids


def test_an_unknown_lock_method_at_the_gate_fails_the_dump_and_the_source_runs_on(fresh_ws, tmp_path):
    ws = fresh_ws
    ws.spawn(["sh", "-c", COUNTER])
    time.sleep(0.3)
    gate, cg, images = _gated(ws, tmp_path)
    assert gate.ready()
    cg.freeze()
    try:
        gate.go("bogus")
        proc, _ = gate.finish()
    finally:
        cg.thaw()
    log = (images / "dump.log").read_text()
    assert proc.returncode != 0 and 'unknown network lock method "bogus"' in log, log[-2000:]
    before = _count(ws)
    time.sleep(0.3)
    assert _count(ws) > before


@pytest.mark.parametrize("connected", [False, True])
def test_the_lock_method_chosen_frozen_is_the_one_in_the_images(fresh_ws, connected):
    """The command line names no lock method any more: the gate's line is the only source."""
    ws = fresh_ws
    if connected:  # a TCP connection inside: the dump must lock the network with nftables
        ws.spawn(["python3", "-c", "import socket, time\n"
                  "s = socket.create_server(('127.0.0.1', 7000))\n"
                  "c = socket.create_connection(('127.0.0.1', 7000)); a, _ = s.accept()\n"
                  "time.sleep(3600)\n"])
        for _ in range(50):
            if forking.network_lock(ws._rec.pid1) == "nftables":
                break
            time.sleep(0.1)
    want = "nftables" if connected else "skip"
    assert forking.network_lock(ws._rec.pid1) == want
    snap = ws.snapshot()
    try:
        assert "start_ms" in snap.metadata.timings, "the snapshot did not go through the gate"
        inventory = load_image(snap.path / "criu" / "inventory.img")["entries"][0]
        assert inventory["network_lock_method"] == LOCK_IN_IMAGES[want]
        (clone,) = snap.fork(1)
        try:
            assert clone.exec("echo alive").text.strip() == "alive"
        finally:
            clone.close()
    finally:
        snap.delete()


def test_a_criu_that_dies_at_its_gate_fails_the_snapshot_and_leaves_the_source_running(fresh_ws, monkeypatch):
    ws = fresh_ws
    ws.spawn(["sh", "-c", COUNTER])
    time.sleep(0.3)
    go = dumping.GatedDump.go

    def die_first(self, network_lock):
        self.proc.kill()  # CRIU gone while the workspace is frozen, before it was told to go
        self.proc.wait()
        go(self, network_lock)

    monkeypatch.setattr(dumping.GatedDump, "go", die_first)
    with pytest.raises(ForkError, match="killed by SIGKILL"):
        ws.snapshot()
    monkeypatch.undo()
    assert not Cgroup(ws._rec.cgroup).is_frozen()
    before = _count(ws)
    time.sleep(0.3)
    assert _count(ws) > before
    assert not [s for s in (paths().snapshots).iterdir() if s.name.startswith("snap-")
                and (s / ".in-progress").exists()], "the failed snapshot's directory was left"
    snap = ws.snapshot()  # and the next one works
    snap.delete()


def test_a_gated_dump_reaps_criu_when_it_fails_to_start(fresh_ws, tmp_path):
    """A CRIU that exits before it reaches the gate (here: a bad option) is reported, not waited for."""
    p, rec = paths(), fresh_ws._rec
    cmd = [str(p.criu), "dump", "--no-such-option", "-t", str(rec.pid1), "-D", str(tmp_path)]
    gate = dumping.GatedDump(cmd, dict(criu_env(p)), (), background=False)
    assert not gate.ready(timeout=10)
    proc, thawed = gate.finish()
    assert proc.returncode != 0 and thawed is None
    assert subprocess.run(["pgrep", "-f", "no-such-option"], capture_output=True).returncode == 1
