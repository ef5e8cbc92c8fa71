"""Host-side helpers for the fork tests: put the programs of this directory into a workspace
and talk to them. Everything here drives real workspaces (no mocks)."""

from __future__ import annotations

import functools
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

from bunshin_gym.workspace import AgentError, Workspace

HERE = Path(__file__).parent
#: where the programs live inside a workspace
DIR = "/opt/forktest"
#: a file-system state: paths, sizes, modes and link targets of the whole overlay root (other
#: mounts are skipped; /.snap, the shared snapshot store, changes as others snapshot) plus the
#: contents of the places tests write, tmpfs ones (/tmp, /dev/shm) included
STATE_CMD = (
    "find / -xdev \\( -path /.snap -o -path /proc -o -path /sys \\) -prune -o -printf '%p %s %m %l\\n' "
    "| LC_ALL=C sort | sha256sum; "
    "find /root /etc /opt /tmp /dev/shm /var/lib/forktest -type f -print0 2>/dev/null "
    "| LC_ALL=C sort -z | xargs -0 sha256sum"
)


@functools.cache
def compiled(name: str) -> bytes:
    """The named C program of this directory, built static on the host (the image has no gcc)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / name
        subprocess.run(["gcc", "-static", "-O1", "-Wall", "-o", str(out), str(HERE / f"{name}.c")],
                       check=True, capture_output=True, text=True)
        return out.read_bytes()


def install(ws: Workspace, *names: str) -> None:
    """Copy programs into the workspace's DIR: ``x.py`` as is, ``x`` (a C file) compiled."""
    for name in names:
        if name.endswith(".py"):
            ws.write_file(f"{DIR}/{name}", (HERE / name).read_bytes(), mode=0o755)
        else:
            ws.write_file(f"{DIR}/{name}", compiled(name), mode=0o755)


def wait_file(ws: Workspace, path: str, timeout: float = 60.0, *, contains: str = "") -> str:
    """Wait until a file exists in the workspace (and contains ``contains``); its text."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = ws.read_file(path).decode()
            if contains in text:
                return text
        except AgentError:
            text = None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ws.id}: {path} not ready after {timeout}s (last: {text!r})")
        time.sleep(0.05)


def sh(ws: Workspace, cmd: str, timeout: float = 120.0) -> str:
    """Run a shell command in the workspace, fail loudly, return stdout."""
    res = ws.exec(cmd, timeout=timeout)
    assert res.ok, f"{ws.id}: {cmd!r} -> exit {res.exit_code} timed_out={res.timed_out}: {res.stderr.decode()}"
    return res.text


def heap_start(ws: Workspace, port: int, mb: int, seed: str) -> int:
    """Install and start heap.py (a process holding ``mb`` MiB); its pid inside the workspace."""
    install(ws, "heap.py", "heapctl.py")
    ready = f"/tmp/heap-{port}.ready"
    ws.spawn(["python3", f"{DIR}/heap.py", str(port), str(mb), seed, ready], log=f"/tmp/heap-{port}.log")
    return int(wait_file(ws, ready, timeout=120))


def heap(ws: Workspace, port: int, *cmd: str) -> str:
    """Send one command to heap.py and return its answer."""
    return sh(ws, f"python3 {DIR}/heapctl.py {port} {shlex.join(cmd)}").strip()


def fs_state(ws: Workspace) -> str:
    return sh(ws, STATE_CMD)


def proc_tree(ws: Workspace) -> list[str]:
    """``pid ppid comm args`` of every process, without the ps invocation itself."""
    out = sh(ws, "ps -eo pid,ppid,comm,args --no-headers # forktest-ps")
    rows = [" ".join(line.split()) for line in out.splitlines()]
    return [r for r in rows if "forktest-ps" not in r and "ps -eo pid,ppid,comm,args" not in r]


def close_all(*workspaces: Workspace | list) -> None:
    for w in workspaces:
        if isinstance(w, list):
            close_all(*w)
        elif w is not None:
            w.close()


def close_then_delete(clones: list[Workspace], ws: Workspace, snaps: list) -> None:
    """A test's end: its clones, then their source, closed; then its snapshots deleted, the
    newest first (each after the clones restored from it)."""
    close_all(clones, ws)
    for s in reversed(snaps):
        s.delete()


def heap_expected(mb: int, seed: str, *mutations: str) -> str:
    """The sha256 heap.py answers after these ``mutate`` commands (computed on the host)."""
    import hashlib

    heap = bytearray(hashlib.shake_256(seed.encode()).digest(mb << 20))
    for m in mutations:
        patch = hashlib.shake_256(("mutate-" + m).encode()).digest(1 << 20)
        off = int(hashlib.sha256(m.encode()).hexdigest(), 16) % (len(heap) - len(patch))
        heap[off:off + len(patch)] = patch
    return hashlib.sha256(heap).hexdigest()


def frozen(ws: Workspace) -> bool:
    """Whether the workspace's cgroup freezer reports it frozen (v1 or v2)."""
    from bunshin_gym.workspace.cgroups import unified

    d = ws.cgroup.freezer_dir()
    if unified():
        return "frozen 1" in (d / "cgroup.events").read_text()
    return (d / "freezer.state").read_text().strip() != "THAWED"


def children_of(pid: int) -> list[str]:
    """Processes (zombies included) whose parent is ``pid``: "pid state comm"."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid:
                found.append(f"{entry} {state} {comm}")
    return found


def kmod_vm(target: str, timeout: float) -> tuple[str, str]:
    """Run ``make -C kmod TARGET`` (a qemu VM booting Debian's 6.1 kernel with the module, see
    kmod/README.md), check it succeeded with the PASS marker on its serial console, and return
    (make's output, the serial log)."""
    repo = HERE.parent.parent
    r = subprocess.run(["make", "-C", str(repo / "kmod"), target], capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    serial = (repo / f"kmod/build/serial-{target}.log").read_text()
    assert "BUNSHIN_KMOD_RESULT: PASS" in serial
    return out, serial


def host_pid_of(ws: Workspace, ns_pid: int) -> int:
    """The host pid of a process known by its pid inside the workspace."""
    for pid in ws.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if int(nspid[-1]) == ns_pid:
            return pid
    raise AssertionError(f"{ws.id}: no process {ns_pid}")
