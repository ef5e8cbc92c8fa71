"""Create/close cycles leave nothing behind: mounts, cgroups, subvolumes, records, network
namespaces, processes, and the controller's own file descriptors.

Other sessions may run workspaces on this host concurrently, so leftovers are looked for
by the ids this test created; host-wide counts are only required not to grow.
"""

from __future__ import annotations

import os
import subprocess
import time

from conftest import alive, fds_beyond, host_netns, host_overlay_mounts, leftovers, pids_in_netns

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, records

CYCLES = 50


def _subvolume_names() -> set[str]:
    out = subprocess.run(["btrfs", "subvolume", "list", "-o", str(paths().workspaces)],
                         capture_output=True, text=True, check=True).stdout
    return {line.rsplit("/", 1)[-1] for line in out.splitlines() if line.strip()}


def _in_other_workspace(pid: int, ours: list[str]) -> bool:
    """A process of a workspace someone else runs (its netns may reuse one of our inode numbers)."""
    try:
        text = open(f"/proc/{pid}/cgroup").read()
    except OSError:
        return False
    groups = {line.split(":", 2)[2] for line in text.splitlines()}
    return any(g.startswith("/bunshin/") and g.split("/")[2] not in ours for g in groups)


def test_create_close_cycles_leave_nothing_behind():
    overlays, netns = host_overlay_mounts(), host_netns()
    fds = set(os.listdir("/proc/self/fd"))
    ids, procs, net_inodes = [], {}, set()
    t0 = time.monotonic()
    for i in range(CYCLES):
        ws = Workspace.create("base")
        ids.append(ws.id)
        try:
            if i % 5 == 0:  # exercise the workspace now and then: processes, files, a spawn
                ws.spawn("sleep 1000")
                ws.write_file("/root/f", os.urandom(4096))
                assert ws.exec("cat /root/f | wc -c", check=True).text.strip() == "4096"
            else:
                assert ws.exec("true").ok
            net_inodes.add(os.stat(f"/proc/{ws.pid}/ns/net").st_ino)
            procs.update({pid: records.proc_start_time(pid) for pid in ws.pids()})
        finally:
            ws.close()
    elapsed = time.monotonic() - t0

    # (a freed namespace's inode number may be reused by the next one: fewer than CYCLES is fine)
    assert len(set(ids)) == CYCLES and len(procs) >= 2 * CYCLES
    assert leftovers(ids) == {}
    assert not [pid for pid, start in procs.items() if alive(pid, start)], "workspace processes survive"
    in_ns = {pid for pid in pids_in_netns(net_inodes) if not _in_other_workspace(pid, ids)}
    assert in_ns == set(), "a workspace network namespace is still in use"
    assert not set(ids) & _subvolume_names()
    assert host_overlay_mounts() <= overlays, "overlay mounts leaked into the host"
    assert host_netns() == netns
    assert fds_beyond(fds) == {}, "the controller leaks file descriptors"
    assert elapsed < 45, f"{CYCLES} cycles took {elapsed:.1f} s"


def test_failed_create_leaves_nothing_behind():
    """A start that fails half-way (the agent never answers in time) is reclaimed entirely."""
    ws_id = f"ws-leak-{os.urandom(3).hex()}"
    overlays = host_overlay_mounts()
    try:
        Workspace.create("base", ws_id=ws_id, ready_timeout=0)
    except Exception as e:  # noqa: BLE001 - a 0 s ready timeout may or may not be met
        assert ws_id in str(e)
    else:
        Workspace.attach(ws_id).close()
    assert leftovers([ws_id]) == {}
    assert host_overlay_mounts() <= overlays
