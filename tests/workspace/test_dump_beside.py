"""criu/patches/0041: the UTS and network namespaces and the tmpfs mounts' contents are dumped by
a process beside the task dump, not after it.

Those dumps read nothing the task dump writes, and the network's four ``ip ... save`` runs and
the tmpfs tars are forks and execs that CRIU waited for while the workspace was frozen (~10-20
ms). CRIU now opens the tmpfs mounts and their images once the mounts are collected, forks a
dumper (at SCHED_IDLE: it takes what the task dump leaves of the CPUs), and takes its result
before it dumps the mounts. ``CRIU_NS_BESIDE=0`` dumps them after the tasks, as before.

The workspace is frozen and dumped both ways (CRIU leaves it frozen, as it found it): both must
record the same tmpfs contents, host name and network; a clone of a snapshot dumped the new way
has them; a failure in the dumper or in the task dump fails the snapshot and leaves no process.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from fork_programs import dumped

from bunshin_gym.errors import ForkError
from bunshin_gym.workspace import Workspace

#: files on four of the workspace's tmpfs mounts
MAKE = ("set -e; mkdir -p /tmp/b/sub; printf 'beside tmp' > /tmp/b/a; ln -s a /tmp/b/link; "
        "truncate -s 2M /tmp/b/sparse; printf 'beside run' > /run/b; printf 'beside shm' > /dev/shm/b; "
        "printf 'beside dev' > /dev/b")
LOOK = ("cat /proc/sys/kernel/hostname; stat -c '%n %s %a %F' /tmp/b /tmp/b/a /tmp/b/link /tmp/b/sparse /tmp/b/sub; "
        "cat /tmp/b/a /run/b /dev/shm/b /dev/b")
#: the network, changed from the host in the workspace's namespace (its image has no ip)
NET_CHANGES = ("addr add 10.7.0.1/32 dev lo", "route add 10.8.0.0/24 dev lo", "-6 route add fd00:8::/64 dev lo",
               "rule add from 10.9.0.0/24 lookup 100 priority 1000")
NET_LOOK = ("-o addr show", "route show", "-6 route show", "rule show")


def _ip(pid: int, args: str) -> str:
    return subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", *args.split()],
                          capture_output=True, text=True, check=True).stdout


def _looks(ws: Workspace) -> tuple[str, list[str]]:
    return ws.exec(["sh", "-c", LOOK]).text, [_ip(ws.pid, args) for args in NET_LOOK]


@pytest.fixture
def source():
    ws = Workspace.create("base")
    try:
        assert ws.exec(["sh", "-c", MAKE]).ok
        subprocess.run(["nsenter", f"--uts=/proc/{ws.pid}/ns/uts", "hostname", "beside-host"], check=True)
        for change in NET_CHANGES:
            _ip(ws.pid, change)
        yield ws
    finally:
        ws.close()


def test_namespaces_and_tmpfs_contents_dumped_beside_the_tasks_are_what_after_them_gave(source, tmp_path):
    old, new = tmp_path / "after", tmp_path / "beside"
    dumped.dump_frozen(source, {old: {"CRIU_NS_BESIDE": "0"}, new: {"CRIU_NS_BESIDE": None}}, verbosity=3)
    old_log, log = (old / "dump.log").read_text(), (new / "dump.log").read_text()

    # the old way: no dumper; the new way: started before the first task is dumped, every tar
    # and the UTS and network namespaces in it, its result taken before the mounts are dumped
    assert "ns-beside" not in old_log
    started = re.search(r"ns-beside: dumper \d+ saves the tmpfs contents \((\d+) mount\(s\)\) and namespaces", log)
    assert started, log[-3000:]
    assert "Dumping task (pid" not in log[:started.start()]
    tars = sorted(p.name for p in new.glob("tmpfs-dev-*.tar.img"))
    assert tars == sorted(p.name for p in old.glob("tmpfs-dev-*.tar.img")) and len(tars) >= 4, tars
    assert int(started.group(1)) == len(tars)
    assert len(re.findall(r"tmpfs 0x[0-9a-f]+: tar \d+ started beside the tasks", log)) == len(tars)
    assert len(re.findall(r"tmpfs 0x[0-9a-f]+: tar \d+ done \(beside the tasks\)", log)) == len(tars)
    done = log.index("ns-beside: done (waited")
    assert done < log.index("mnt: Dumping mountpoints")
    late = log[log.index("'s namespaces\n"):]
    assert re.findall(r"Dump (\w+) namespace", late) == ["IPC"], "the parent dumped UTS or NET again"
    assert {"UTS", "NET"} <= set(re.findall(r"Dump (\w+) namespace", log[:done]))

    # the same state recorded: tmpfs contents, host name, links and namespace settings, ip saves
    for name in tars + [p.name for p in old.glob("utsns-*.img")] + [p.name for p in old.glob("netdev-*.img")]:
        assert (new / name).read_bytes() == (old / name).read_bytes(), name
    for name in ("ifaddr", "route", "route6", "rule"):
        (want,) = old.glob(f"{name}-*.img")
        got = new / want.name
        assert dumped.ip_save_messages(got.read_bytes()) == dumped.ip_save_messages(want.read_bytes()), name
    assert "beside-host" in (next(old.glob("utsns-*.img"))).read_text(errors="replace")


def test_a_clone_of_a_snapshot_dumped_beside_the_tasks_has_its_tmpfs_contents_and_network(source):
    want = _looks(source)
    assert "beside-host" in want[0] and "10.7.0.1/32" in want[1][0] and "10.8.0.0/24" in want[1][1]
    snap = source.snapshot()
    try:
        for mode in ("share", "copy"):
            (c,) = snap.fork(1, mode=mode)
            try:
                assert _looks(c) == want, mode
            finally:
                c.close()
    finally:
        snap.delete()


def _no_process_left(pattern: str) -> None:
    """Nothing matching ``pattern`` runs once the dump has failed (the dumper is reaped by the
    dump that fails; a tar it started ends by itself within moments)."""
    deadline = time.monotonic() + 5
    while True:
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        if left.returncode == 1:
            return
        assert time.monotonic() < deadline, f"left running: {left.stdout}"
        time.sleep(0.05)


def _fails_and_runs_on(source: Workspace, monkeypatch, env: dict[str, str], expect: str) -> None:
    want = _looks(source)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ForkError, match="CRIU dump") as failed:
        source.snapshot()
    monkeypatch.undo()
    log = Path(re.search(r"log: (\S+)", str(failed.value)).group(1)).read_text()
    assert expect in log, log[-3000:]
    assert not source.cgroup.is_frozen()
    assert _looks(source) == want
    _no_process_left("criu dump")
    _no_process_left("tar --create --no-unquote")


def test_a_network_save_that_fails_beside_the_tasks_fails_the_snapshot(source, fake_bin, monkeypatch):
    fake = fake_bin / "ip"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    _fails_and_runs_on(source, monkeypatch, {"PATH": f"{fake_bin}:{os.environ['PATH']}"},
                       "ns-beside: dumping the tmpfs contents or namespaces failed")


def test_a_task_dump_that_fails_stops_the_dumper_beside_it(source, monkeypatch):
    # CRIU's fault injection: the first task's page dump fails (FI_DUMP_PAGES), the dumper runs
    _fails_and_runs_on(source, monkeypatch, {"CRIU_FAULT": "3"}, "fault: Dump VMA pages failure!")
