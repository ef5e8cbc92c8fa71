"""Shared fixtures for the workspace tests: real workspaces on the real runtime (no mocks).

Other test sessions may run workspaces on the same host at the same time, so every leak
check here is scoped to the ids a test created (plus host-wide counts that must not grow).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.workspace import reclaim

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ws():
    """A workspace shared by one module's tests; tests using it must not change shared state."""
    w = Workspace.create("base")
    yield w
    w.close()


@pytest.fixture
def fresh_ws():
    """A workspace of one's own, for tests that change it (files, processes, freezer)."""
    w = Workspace.create("base")
    yield w
    w.close()


@pytest.fixture
def kmod_double(monkeypatch):
    """``kmod_double(mode)``: for memory mode "kmod" on a host without the bunshin_share module
    (this one), run its whole path with the copying test double (tests/workspace/test_fork_kmod.py)."""
    from bunshin_gym import kmod_share

    def apply(mode: str) -> None:
        if mode == "kmod" and not kmod_share.available():
            monkeypatch.setenv("BUNSHIN_KMOD_DOUBLE", "copy")

    return apply


def fds_beyond(baseline: set[str], settle: float = 5.0) -> dict[str, str]:
    """This process's descriptors not in ``baseline`` (name -> target), once they stay open:
    threads that earlier tests of the suite left running (speculation, background snapshots)
    open and close descriptors of their own for a while, and one of theirs is not a leak of the
    test at hand; a leaked one is still there after ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        extra = {}
        for fd in set(os.listdir("/proc/self/fd")) - baseline:
            try:
                extra[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile (or the listing's own descriptor)
                continue
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


def proc_state(pid: int) -> str | None:
    """The state letter of a process (``Z`` for a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid: int, start_time: int | None) -> bool:
    """The process still exists and is not a zombie (a workspace's PID 1 is reparented to the
    host's init once its launcher exits; a lazy host init may keep it a zombie for a while,
    holding nothing but its pid)."""
    return records.process_alive(pid, start_time) and proc_state(pid) not in ("Z", "X", None)


def cgroup_pids(ws_id: str) -> set[int]:
    """Host pids (zombies excluded) whose /proc/PID/cgroup names the workspace's cgroup."""
    needle = f"/bunshin/{ws_id}"
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "cgroup").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if proc_state(int(entry.name)) in ("Z", "X", None):
            continue
        if any(line.split(":", 2)[-1] == needle for line in text.splitlines()):
            found.add(int(entry.name))
    return found


def pids_in_netns(inodes: set[int]) -> set[int]:
    """Host pids living in one of these network namespaces (by nsfs inode; a zombie has none)."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"{entry.path}/ns/net").st_ino in inodes:
                found.add(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def host_overlay_mounts() -> int:
    with open("/proc/mounts") as f:
        return sum(1 for line in f if line.split()[2] == "overlay")


def host_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return sorted(out.split("\n"))


def leftovers(ids: set[str] | list[str]) -> dict[str, list]:
    """Everything on the host that still belongs to these workspace ids (empty lists: clean)."""
    ids = set(ids)
    p = paths()
    found: dict[str, list] = {"records": [], "subvolumes": [], "cgroups": [], "processes": [], "mounts": []}
    for ws_id in sorted(ids):
        if (p.records / f"{ws_id}.json").exists():
            found["records"].append(ws_id)
        if (p.workspaces / ws_id).exists():
            found["subvolumes"].append(ws_id)
        found["cgroups"] += [str(d) for d in Cgroup(ws_id).dirs if d.exists()]
        found["processes"] += sorted(cgroup_pids(ws_id))
    with open("/proc/mounts") as f:
        found["mounts"] = [line.strip() for line in f if any(i in line for i in ids)]
    return {k: v for k, v in found.items() if v}


CONTROLLER = textwrap.dedent("""
    import sys, time
    from bunshin_gym.workspace import Workspace
    ws = Workspace.create("base")
    ws.spawn("sleep 1000")
    ws.spawn(["sh", "-c", "sleep 1001 & sleep 1002"], user="user")
    ws.write_file("/root/state", b"x" * 65536)
    print(ws.id, flush=True)
    time.sleep(1000)
""")


class Orphan:
    """A workspace whose controller (a child python process) we SIGKILL."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True,
                                     cwd=REPO)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("ws-"):
            self.proc.kill()
            raise AssertionError(f"controller printed {line!r} (rc {self.proc.wait()})")
        self.id = line
        self.rec = records.load(self.id)

    def kill_controller(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill_controller()
        rec = records.load(self.id)
        if rec is not None:
            reclaim(rec)


@pytest.fixture
def orphan():
    o = Orphan()
    yield o
    o.cleanup()


#: what chromium's flags leave out in the desktop and web workspaces (envs/osworld/image/chromium.sh,
#: envs/webarena/driver.py): zygotes, a GPU process and a network-service utility, each one more
#: task that every snapshot dumps and every clone restores
CHROMIUM_LEFT_OUT = ("--type=zygote", "--type=gpu-process", "network.mojom.NetworkService")
_CHROMIUM_COMMAND_LINES = ("for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = chromium ] && "
                           "tr '\\0' ' ' < $p/cmdline && echo; done; true")


@pytest.fixture
def check_chromium_processes():
    """A check of a workspace's chromium (the env tests): once a renderer has drawn a page, one
    browser process and none of :data:`CHROMIUM_LEFT_OUT`."""

    def check(ws) -> list[str]:
        deadline = time.monotonic() + 20
        while True:
            lines = [line for line in ws.exec(_CHROMIUM_COMMAND_LINES, user="root").text.splitlines() if line.strip()]
            if any("--type=renderer" in line for line in lines):
                break
            assert time.monotonic() < deadline, f"chromium drew no page (no renderer): {lines}"
            time.sleep(0.3)
        assert sum("--type=" not in line for line in lines) == 1, lines  # one browser process
        for kind in CHROMIUM_LEFT_OUT:
            assert not [line for line in lines if kind in line], f"chromium runs a {kind} process"
        return lines

    return check


@pytest.fixture
def fake_bin():
    """A directory for programs CRIU's helpers run (a failing tar or ip put first on PATH):
    readable by the workspace's root, which tar runs as (in the workspace's user namespace;
    pytest's tmp_path is private to the host's)."""
    d = Path(tempfile.mkdtemp(prefix="bunshin-fake-bin-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)
