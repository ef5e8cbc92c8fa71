"""Host settings workspaces need (bunshin_gym.workspace.hostlimits): pipe-max-size is raised
to CRIU's largest page pipe, so a dump hands a task's pages over in fewer, larger pipes; and a
workspace's network namespace, a clone's too, has TCP tables of its own, so a dump's listing of
its TCP sockets does not walk the host's."""

from __future__ import annotations

import re

import pytest
from fork_programs import host

from bunshin_gym.workspace import Workspace, hostlimits


def test_pipe_max_size_is_raised_never_lowered(tmp_path):
    setting = tmp_path / "pipe-max-size"
    setting.write_text("1048576\n")
    assert hostlimits.raise_pipe_max_size(setting) and int(setting.read_text()) == hostlimits.CRIU_PIPE_BYTES
    setting.write_text(f"{64 << 20}\n")
    assert hostlimits.raise_pipe_max_size(setting) and int(setting.read_text()) == 64 << 20
    assert not hostlimits.raise_pipe_max_size(tmp_path / "missing")  # logged, not raised


def test_a_dump_hands_pages_over_in_pipes_past_one_mib(monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "4")  # the log says how each pipe grew
    ws = Workspace.create("base")
    try:
        assert int(hostlimits.PIPE_MAX_SIZE.read_text()) >= hostlimits.CRIU_PIPE_BYTES
        ws.exec("python3 -c \"import os, time; b = bytearray(os.urandom(48 << 20)); "
                "open('/tmp/ready', 'w').close(); time.sleep(600)\" >/dev/null 2>&1 &")
        ws.exec("for i in $(seq 200); do [ -e /tmp/ready ] && break; sleep 0.05; done; [ -e /tmp/ready ]", check=True)
        snap = ws.snapshot()
        try:
            log = (snap.criu_dir / "dump.log").read_text(errors="replace")
        finally:
            snap.delete()
    finally:
        ws.close()
    grown = [int(m, 16) for m in re.findall(r"Grow pipe \w+ -> (\w+)", log)]
    if not grown:
        pytest.fail("the dump log shows no pipe growing: " + log[-2000:])
    assert max(grown) * 4096 > 1 << 20, f"pipes stayed at {max(grown)} pages (1 MiB)"


def test_namespaces_get_tcp_tables_of_their_own_unless_the_host_sized_them(tmp_path):
    setting = tmp_path / "tcp_child_ehash_entries"
    setting.write_text("0\n")
    assert hostlimits.give_namespaces_own_tcp_tables(setting)
    assert int(setting.read_text()) == hostlimits.WORKSPACE_TCP_BUCKETS
    setting.write_text("65536\n")  # an administrator's size is kept
    assert hostlimits.give_namespaces_own_tcp_tables(setting) and int(setting.read_text()) == 65536
    assert not hostlimits.give_namespaces_own_tcp_tables(tmp_path / "missing")  # logged, not raised


def test_a_workspace_and_its_clone_have_tcp_tables_of_their_own():
    # inside a namespace, tcp_ehash_entries is its table's size, negative when it shares the host's
    ws = Workspace.create("base")
    clones, snap = [], None
    try:
        assert int(hostlimits.TCP_CHILD_EHASH_ENTRIES.read_text()) != 0
        snap = ws.snapshot()
        clones = snap.fork(1)
        for w in (ws, *clones):
            entries = int(w.exec("cat /proc/sys/net/ipv4/tcp_ehash_entries", check=True).text)
            assert entries > 0, f"{w.id} shares the host's TCP table ({entries})"
    finally:
        host.close_all(clones, ws)
        if snap is not None:
            snap.delete()
