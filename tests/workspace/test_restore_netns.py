"""What a clone's network namespace gets from CRIU's restore, and what the restore no longer
runs for it.

criu/patches/0027: CRIU restored a namespace's addresses, routes and rules by running ``ip ...
restore`` on each saved stream, six runs of ``ip`` per clone (a fork and an exec each). A
route stream that holds no route (only iproute2's magic) is no longer handed to ``ip``, and
the saved IPv4 rules, when they are byte for byte the rules the new namespace has already (the
kernel's three defaults), are no longer flushed and added again. A workspace with only ``lo``
(every workspace, unless its root changes its network) now runs ``ip`` once, for its
addresses. A namespace whose routes and rules were changed gets them as before.

The changes are made from the host (``nsenter``): a workspace's own root may not change its
network (no CAP_NET_ADMIN over it). IPv6 rules are left out: stock CRIU saves only the IPv4
ones (``ip rule save``), with or without the patch.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from fork_programs import host

from bunshin_gym.workspace import Workspace, fanout

#: what a clone's namespace must show as its source's does (``ip`` run in it from the host)
LISTINGS = ("addr", "-6 addr", "rule", "-6 rule", "route show table all", "-6 route show table all")
CHANGES = ("addr add 10.7.0.1/32 dev lo", "route add 10.8.0.0/24 dev lo", "-6 route add fd00:8::/64 dev lo",
           "rule add from 10.9.0.0/24 lookup 100 priority 1000")


def _ip(pid: int, args: str) -> str:
    res = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", *args.split()],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"ip {args}: {res.stderr}"
    return res.stdout


def _network(ws: Workspace) -> dict[str, str]:
    # addresses' lifetimes and the order of equal routes are the namespace's, not the state's
    return {args: _ip(ws.pid, args) for args in LISTINGS}


@pytest.fixture
def restore_logs(monkeypatch, tmp_path) -> list[pathlib.Path]:
    """CRIU's debug log of each restore made in the test (a restore's log is removed once it
    succeeds: copied here first)."""
    kept: list[pathlib.Path] = []
    unlink = pathlib.Path.unlink

    def keep(self, missing_ok=False):
        if self.name.endswith("-restore.log") and self.exists():
            kept.append(pathlib.Path(shutil.copy(self, tmp_path / self.name)))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", keep)
    with fanout.using(dataclasses.replace(fanout.current(), restore_verbosity=4)):
        yield kept


def _ip_runs(log: pathlib.Path) -> list[str]:
    return [ln.split("Running ip", 1)[1].strip() for ln in log.read_text(errors="replace").splitlines()
            if "Running ip " in ln]


@pytest.fixture
def source() -> Iterator[tuple[Workspace, list]]:
    """A base workspace, and a list for its snapshot and clones (closed and deleted after)."""
    ws = Workspace.create("base")
    made: list = []
    try:
        yield ws, made
    finally:
        host.close_all([m for m in made if isinstance(m, Workspace)], ws)
        for snap in (m for m in made if not isinstance(m, Workspace)):
            snap.delete()


def _clone(ws: Workspace, made: list) -> Workspace:
    snap = ws.snapshot()
    made.append(snap)
    made.extend(snap.fork(1))
    return made[-1]


def test_a_clone_of_a_workspace_with_only_lo_runs_ip_once(source, restore_logs):
    ws, made = source
    assert _network(_clone(ws, made)) == _network(ws)
    (log,) = restore_logs
    assert _ip_runs(log) == ["addr restore"]
    text = log.read_text(errors="replace")
    assert text.count("No route to restore") == 2  # IPv4 and IPv6
    assert "The saved rules are the namespace's own already" in text


def test_a_clone_gets_the_addresses_routes_and_rules_its_source_was_given(source, restore_logs):
    ws, made = source
    for change in CHANGES:
        _ip(ws.pid, change)
    before = _network(ws)
    assert "10.8.0.0/24" in before["route show table all"] and "10.9.0.0/24" in before["rule"]
    assert _network(_clone(ws, made)) == before
    (log,) = restore_logs
    runs = _ip_runs(log)
    assert "route restore" in runs and "rule restore" in runs  # what differs is restored by ip
