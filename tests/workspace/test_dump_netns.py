"""What a dump of a workspace's network namespace costs while it is frozen, and that it still
captures the namespace.

criu/patches/0022: the conntrack tables of a netns with no entry are not dumped. Each conntrack
dump walks the host-wide hash table (~10 ms with 262144 buckets, even for an empty netns),
twice per snapshot. A workspace's netns has no entry: the dumps are skipped and, as after a dump
that found nothing, there is no image of them (CRIU makes an image file on its first entry).
One with an entry (made over ctnetlink, as ``conntrack -I`` does) is dumped as before, and its
clone has the entry.

criu/patches/0024: the iptables binaries CRIU probes (``iptables-save -V``...) are looked up on
$PATH first: one that is not installed is not forked and run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from fork_programs import dumped, host

from bunshin_gym.workspace import Workspace

SKIPPED = "No conntrack entries in the netns: nothing to dump"
# run in a workspace's netns (nsenter): an entry made as ``conntrack -I`` makes one
ADD_ENTRY = """
import socket
from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple
t = dict(family=socket.AF_INET, proto=socket.IPPROTO_UDP)
Conntrack().entry("add", timeout=3600,
                  tuple_orig=NFCTAttrTuple(saddr="10.9.0.1", daddr="10.9.0.2", sport=4000, dport=53, **t),
                  tuple_reply=NFCTAttrTuple(saddr="10.9.0.2", daddr="10.9.0.1", sport=53, dport=4000, **t))
"""
LIST_ENTRIES = """
from pyroute2 import Conntrack
print(len(list(Conntrack().dump_entries())), open("/proc/sys/net/netfilter/nf_conntrack_count").read().strip())
"""


def _in_netns(program: str, pid: int) -> str:
    res = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", program],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture
def verbose_dumps(monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "4")  # the lines checked below


def _ct_images(snap) -> list[int]:
    return [p.stat().st_size for p in sorted(snap.criu_dir.glob("netns-ct-*.img"))]


def test_a_netns_without_conntrack_entries_is_not_walked_for_them(verbose_dumps):
    ws = Workspace.create("base")
    clones: list[Workspace] = []
    snaps = []  # kept by default: deleted below, after the clones that use them
    try:
        snap = ws.snapshot()
        snaps.append(snap)
        log = (snap.criu_dir / "dump.log").read_text(errors="replace")
        assert log.count(SKIPPED) == 2  # the entries and the expectations
        assert _ct_images(snap) == []
        clones += snap.fork(1)
        assert clones[0].exec(["true"]).ok
        assert _in_netns(LIST_ENTRIES, clones[0].pid).split() == ["0", "0"]

        # with an entry: dumped as before, and the clone has it
        _in_netns(ADD_ENTRY, ws.pid)
        assert _in_netns(LIST_ENTRIES, ws.pid).split() == ["1", "1"]
        snap2 = ws.snapshot()
        snaps.append(snap2)
        log = (snap2.criu_dir / "dump.log").read_text(errors="replace")
        assert SKIPPED not in log
        (size,) = _ct_images(snap2)
        assert size > 0
        clones += snap2.fork(1)
        assert _in_netns(LIST_ENTRIES, clones[1].pid).split() == ["1", "1"]
    finally:
        host.close_then_delete(clones, ws, snaps)


def test_iptables_binaries_that_are_not_installed_are_not_run(verbose_dumps):
    ws = Workspace.create("base")
    snap = None
    try:
        snap = ws.snapshot()
        log = (snap.criu_dir / "dump.log").read_text(errors="replace")
    finally:
        ws.close()
        if snap is not None:
            snap.delete()
    for binary in ("iptables-save", "iptables-legacy-save", "ip6tables-save", "ip6tables-legacy-save"):
        if shutil.which(binary):  # installed: probed by running it, as before
            assert f"{binary} is not on PATH" not in log
        else:
            assert f"{binary} is not on PATH" in log and f"{binary} -V failed" not in log


#: each ``ip ... save`` stream of a dump and the image it goes to (criu/patches/0028 runs them at once)
IP_SAVES = {"ifaddr": ["addr", "save"], "route": ["route", "save"], "route6": ["-6", "route", "save"],
            "rule": ["rule", "save"]}


def test_each_network_save_goes_to_its_own_image():
    ws = Workspace.create("base")
    snap = None
    try:
        for change in ("addr add 10.7.0.1/32 dev lo", "route add 10.8.0.0/24 dev lo",
                       "-6 route add fd00:8::/64 dev lo", "rule add from 10.9.0.0/24 lookup 100 priority 1000"):
            subprocess.run(["nsenter", f"--net=/proc/{ws.pid}/ns/net", "ip", *change.split()], check=True)
        now = {name: subprocess.run(["nsenter", f"--net=/proc/{ws.pid}/ns/net", "ip", *args],
                                    capture_output=True, check=True).stdout for name, args in IP_SAVES.items()}
        snap = ws.snapshot()
        for name, stream in now.items():
            (image,) = snap.criu_dir.glob(f"{name}-*.img")
            assert dumped.ip_save_messages(image.read_bytes()) == dumped.ip_save_messages(stream), name
            assert len(dumped.ip_save_messages(stream)) > 1, f"{name}: the test's change is not in the stream"
    finally:
        ws.close()
        if snap is not None:
            snap.delete()
