"""A workspace's life cycle and handles: create, close, attach, reconnect, freeze/thaw, memory,
and the errors bad input gets."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest
from conftest import alive, leftovers

from bunshin_gym.config import paths
from bunshin_gym.workspace import (
    MemoryStats,
    UnknownImage,
    Workspace,
    WorkspaceClosed,
    WorkspaceError,
    records,
)


def test_create_records_and_runs(fresh_ws):
    ws = fresh_ws
    rec = records.load(ws.id)
    assert rec is not None and rec.running() and rec.pid1 == ws.pid and rec.image == "base"
    assert rec.owner == os.getpid() and rec.owner_alive()
    assert Path(rec.subvolume).is_dir() and ws.upper.is_dir() and ws.cgroup.exists()
    assert ws.id.startswith("ws-") and ws.image == "base" and not ws.closed
    assert ws.id in repr(ws) and str(ws.pid) in repr(ws)
    assert ws.exec("echo hello", check=True).text == "hello\n"
    assert ws.pid in ws.pids()


def test_context_manager_reclaims_everything():
    with Workspace.create("base") as ws:
        ws.spawn("sleep 1000")
        ws.write_file("/root/x", b"x")
        ws_id = ws.id
        procs = {pid: records.proc_start_time(pid) for pid in ws.pids()}
        assert len(procs) >= 3 and leftovers([ws_id])  # sanity: the check sees a live workspace
    assert ws.closed and "closed" in repr(ws)
    assert leftovers([ws_id]) == {}
    assert not [pid for pid, start in procs.items() if alive(pid, start)]


def test_explicit_id():
    ws_id = f"ws-test-{secrets.token_hex(3)}"
    with Workspace.create("base", ws_id=ws_id) as ws:
        assert ws.id == ws_id and ws.exec("uname -n", check=True).text.strip() == ws_id
    assert leftovers([ws_id]) == {}


def test_an_id_in_use_is_refused_and_the_running_workspace_survives(fresh_ws):
    ws = fresh_ws
    with pytest.raises(WorkspaceError, match=ws.id):
        Workspace.create("base", ws_id=ws.id)
    assert records.load(ws.id) is not None and ws.upper.is_dir()
    assert ws.exec("echo survived", check=True).text == "survived\n"


# closed ------------------------------------------------------------------------------------
def test_closed_workspace_gives_a_clear_error():
    ws = Workspace.create("base")
    ws.close()
    ws.close()  # idempotent
    calls = [
        lambda: ws.exec("true"), lambda: ws.spawn("true"), lambda: ws.read_file("/etc/hostname"),
        lambda: ws.write_file("/tmp/x", b""), ws.freeze, ws.thaw, ws.pids, ws.memory, lambda: ws.pid,
    ]
    for call in calls:
        with pytest.raises(WorkspaceClosed) as ei:
            call()
        assert ws.id in str(ei.value) and "closed" in str(ei.value)
    ws.disconnect()  # harmless


# attach --------------------------------------------------------------------------------
def test_attach_from_the_record(fresh_ws):
    ws = fresh_ws
    ws.exec("echo shared > /root/shared", check=True)
    other = Workspace.attach(ws.id)
    assert other.id == ws.id and other.pid == ws.pid and other.image == "base"
    assert other.read_file("/root/shared") == b"shared\n"
    other.write_file("/root/back", b"from the attached handle")
    assert ws.read_file("/root/back") == b"from the attached handle"
    assert set(other.pids()) == set(ws.pids())
    other.disconnect()
    # closing the attached handle stops the workspace for everyone
    other.close()
    assert leftovers([ws.id]) == {}
    with pytest.raises(WorkspaceError):
        ws.exec("true")


def test_attach_unknown_id_names_it():
    bogus = f"ws-nosuch-{secrets.token_hex(3)}"
    with pytest.raises(WorkspaceError) as ei:
        Workspace.attach(bogus)
    assert bogus in str(ei.value)


def test_attach_a_dead_workspace_says_so():
    ws = Workspace.create("base")
    try:
        os.kill(ws.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while records.load(ws.id).running() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(WorkspaceClosed) as ei:
            Workspace.attach(ws.id)
        assert ws.id in str(ei.value) and "gc" in str(ei.value)
    finally:
        ws.close()
    assert leftovers([ws.id]) == {}


# the controller connection ---------------------------------------------------------------
def test_disconnect_and_transparent_reconnect(ws):
    agent = ws._agent().request({"op": "ping"})[0]["pid"]
    for _ in range(3):
        ws.disconnect()
        assert ws.exec("echo again", check=True).text == "again\n"
    ws.disconnect()
    ws.disconnect()  # twice is fine
    assert ws.read_file("/proc/sys/kernel/hostname").strip() == ws.id.encode()
    assert ws._agent().request({"op": "ping"})[0]["pid"] == agent  # the same agent served them


def test_stale_connection_is_retried(fresh_ws):
    """The agent dies (PID 1 restarts it): the old connection is stale, requests recover."""
    ws = fresh_ws
    old = ws._agent().request({"op": "ping"})[0]["pid"]
    try:
        ws.exec(f"kill -9 {old}")
    except WorkspaceError:
        pass  # the agent died before replying: the reply is lost, which is expected
    deadline = time.monotonic() + 10
    while True:
        try:
            new = ws._agent().request({"op": "ping"})[0]["pid"]
            break
        except WorkspaceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert new != old
    assert ws.exec("echo back", check=True).text == "back\n"
    log = (Path(f"/proc/{ws.pid}/root/run/bunshin/init.log")).read_text()
    assert "agent exited" in log and "restarting" in log


def test_concurrent_handles(ws):
    import threading

    results, errors = [], []

    def worker(i):
        try:
            h = Workspace.attach(ws.id)
            for j in range(5):
                results.append(h.exec(f"echo {i}-{j}", check=True).text.strip())
            h.disconnect()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(results) == sorted(f"{i}-{j}" for i in range(4) for j in range(5))


# freezer -----------------------------------------------------------------------------------
def _counter(ws) -> int:
    # read through PID 1's root: works while every process in the workspace is frozen
    text = Path(f"/proc/{ws.pid}/root/tmp/counter").read_text().strip()
    return int(text) if text else -1


def test_freeze_stops_and_thaw_resumes(fresh_ws):
    ws = fresh_ws
    ws.spawn("i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; "
             "sleep 0.01; done")
    deadline = time.monotonic() + 5
    while not Path(f"/proc/{ws.pid}/root/tmp/counter").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert _counter(ws) > 0
    ws.freeze()
    try:
        state = [d / "freezer.state" for d in ws.cgroup.dirs if (d / "freezer.state").exists()]
        if state:
            assert state[0].read_text().strip() == "FROZEN"
        a = _counter(ws)
        time.sleep(0.4)
        b = _counter(ws)
        assert a == b, f"the counter advanced while frozen: {a} -> {b}"
    finally:
        ws.thaw()
    time.sleep(0.3)
    c = _counter(ws)
    assert c > b, f"the counter did not resume after thaw: {b} -> {c}"
    assert ws.exec("echo thawed", check=True).text == "thawed\n"


def test_freeze_thaw_idempotent(fresh_ws):
    ws = fresh_ws
    ws.freeze()
    ws.freeze()
    ws.thaw()
    ws.thaw()
    assert ws.exec("echo ok", check=True).text == "ok\n"


def test_close_a_frozen_workspace(fresh_ws):
    ws = fresh_ws
    ws.spawn("sleep 1000")
    ws.freeze()
    ws.close()
    assert leftovers([ws.id]) == {}


# memory ------------------------------------------------------------------------------------
def test_memory_is_sane(ws):
    m = ws.memory()
    assert isinstance(m, MemoryStats)
    assert m.processes >= 2  # init and the agent
    assert 0 < m.pss <= m.rss and 0 < m.private <= m.rss
    assert m.rss < 2**30 and m.cgroup > 0
    mb = m.as_mb()
    assert mb["processes"] == m.processes and abs(mb["pss"] - m.pss / 2**20) < 0.1


def test_memory_grows_with_a_process(fresh_ws):
    ws = fresh_ws
    before = ws.memory()
    ws.spawn(["python3", "-c", "import time; b = b'x' * (64 << 20); open('/tmp/ready', 'w').close(); "
              "time.sleep(1000)"])
    deadline = time.monotonic() + 10
    while ws.exec("test -e /tmp/ready").exit_code != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = ws.memory()
    assert after.processes == before.processes + 1
    assert after.pss - before.pss > 60 * 2**20
    assert after.cgroup - before.cgroup > 60 * 2**20


# bad input -----------------------------------------------------------------------------
def test_unknown_image_names_it():
    ws_id = f"ws-test-{secrets.token_hex(3)}"
    with pytest.raises(UnknownImage) as ei:
        Workspace.create("no-such-image-xyz", ws_id=ws_id)
    msg = str(ei.value)
    assert "no-such-image-xyz" in msg and "base" in msg  # names the culprit and the known ones
    assert not msg.startswith(("'", '"'))
    assert leftovers([ws_id]) == {}
    assert not (paths().records / f"{ws_id}.json").exists()


def test_freeze_while_forking(fresh_ws):
    """Freezing never hangs on a workspace busy forking (a vfork parent waiting for a child
    the cgroup v1 freezer already froze needs the freeze re-requested)."""
    ws = fresh_ws
    ws.spawn("while :; do /bin/true; done")
    ws.spawn("while :; do /bin/true; done", user="user")
    for _ in range(150):
        t0 = time.monotonic()
        ws.cgroup.freeze(timeout=3)
        assert time.monotonic() - t0 < 3
        ws.cgroup.thaw(timeout=3)
    assert ws.exec("echo ok", check=True).text == "ok\n"
