"""BunshinFork, networking: a TCP client/server pair inside a workspace, with an
established connection at snapshot time, keeps exchanging its counter in every clone (and
in the source), on the same connection."""

from __future__ import annotations

import time

import pytest
from fork_programs import host
from fork_programs.host import DIR, sh

from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.forking import network_lock
from bunshin_gym.workspace.memory import MemoryMode

PORT = 7100


def _client(ws: Workspace) -> tuple[int, int]:
    """(counter, local port) from the client's state file; fails on a broken connection."""
    text = ws.read_file("/tmp/tcp-client.state").decode()
    assert not text.startswith("error"), f"{ws.id}: the client lost its connection: {text}"
    n, port, connects = text.split()
    assert connects == "1"
    return int(n), int(port)


def _server(ws: Workspace) -> tuple[int, int]:
    text = ws.read_file("/tmp/tcp-server.state").decode()
    assert not text.startswith("error"), f"{ws.id}: the server lost its connection: {text}"
    accepted, last = text.split()
    return int(accepted), int(last)


def _established(ws: Workspace) -> list[str]:
    """Established TCP connections inside the workspace, as "local peer" pairs."""
    out = sh(ws, "ss -tnH state established")
    return sorted(" ".join(line.split()[-2:]) for line in out.splitlines() if line.strip())


def _assert_talking(ws: Workspace, port: int, seconds: float = 1.0) -> tuple[int, int]:
    n1, p1 = _client(ws)
    time.sleep(seconds)
    n2, p2 = _client(ws)
    accepted, last = _server(ws)
    assert p2 == p1 == port, f"{ws.id}: the client is on another connection ({p1}, {p2}, expected {port})"
    assert accepted == 1, f"{ws.id}: the server accepted {accepted} connections"
    assert n2 >= n1 + 20, f"{ws.id}: the counter went from {n1} to {n2} in {seconds}s: the pair stopped talking"
    assert last >= n1
    return n1, n2


@pytest.mark.parametrize("mode", [m.value for m in MemoryMode])
def test_established_tcp_pair_keeps_talking_in_every_clone(mode, kmod_double):
    kmod_double(mode)
    ws = Workspace.create("base", memory_mode=mode)
    clones, snap = [], None
    try:
        host.install(ws, "tcp_pair.py")
        ws.spawn(["python3", f"{DIR}/tcp_pair.py", "server", str(PORT), "/tmp/tcp-server.state"],
                 log="/tmp/tcp-server.log")
        host.wait_file(ws, "/tmp/tcp-server.state")
        # a listening socket alone needs no network lock during a dump; a connection does
        assert network_lock(ws._rec.pid1) == "skip"
        ws.spawn(["python3", f"{DIR}/tcp_pair.py", "client", str(PORT), "/tmp/tcp-client.state"],
                 log="/tmp/tcp-client.log")
        host.wait_file(ws, "/tmp/tcp-client.state")
        assert network_lock(ws._rec.pid1) == "nftables"
        _, cport = _client(ws)
        conns = _established(ws)
        assert conns == sorted([f"127.0.0.1:{PORT} 127.0.0.1:{cport}", f"127.0.0.1:{cport} 127.0.0.1:{PORT}"])
        n_src, _ = _assert_talking(ws, cport, 0.5)

        snap = ws.snapshot()
        print(f"\n[{mode}] snapshot with an established connection: {snap.meta['timings']}")
        clones = snap.fork(3)
        at_fork = []
        for c in clones:
            assert _established(c) == conns, f"{c.id}: connections {_established(c)}"
            n1, n2 = _assert_talking(c, cport)
            at_fork.append(n1)
            print(f"[{mode}] {c.id}: counter {n1} -> {n2} in 1 s")
        # each clone started from the snapshot's counter, after the pre-snapshot value
        assert all(n >= n_src for n in at_fork)
        _assert_talking(ws, cport)
        assert _established(ws) == conns
        # still talking a while later, after the siblings ran
        for c in clones:
            _assert_talking(c, cport, 0.3)
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
