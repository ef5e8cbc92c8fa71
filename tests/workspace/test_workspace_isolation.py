"""Isolation of a workspace from the host: processes, files, network, writes, fds, cgroups, seccomp."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import cgroup_pids

from bunshin_gym.workspace import records
from bunshin_gym.workspace.cgroups import unified
from bunshin_gym.workspace.runtime import ensure_runtime

RUNTIME_ENTRIES = {".bunshin", ".snap"}
MOUNTED_ENTRIES = {"proc", "sys", "dev", "tmp", "run"}


def _image_root(ws) -> Path:
    return Path(records.load(ws.id).image_path)


# processes -----------------------------------------------------------------------------
def test_ps_sees_only_the_workspace(ws):
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    host = subprocess.Popen(["sleep", marker])  # a host process that must stay invisible
    try:
        res = ws.exec("ps -e -o pid=,args=", check=True)
    finally:
        host.kill()
        host.wait()
    rows = [line.split(None, 1) for line in res.text.strip().splitlines()]
    pids = {int(pid) for pid, _ in rows}
    args = [a for _, a in rows]
    assert not any(marker in a for a in args), args
    assert 1 in pids and args[[int(p) for p, _ in rows].index(1)].startswith("init")
    # init, the agent, the shell and ps: nothing of the host's hundreds of processes
    assert len(rows) <= 5, rows
    assert all(p < 1000 for p in pids), pids


def test_host_pids_are_not_signalable(ws):
    # the workspace's pid namespace has no host pid: our own pid is not a process inside
    res = ws.exec(f"test -e /proc/{os.getpid()} && echo visible || echo invisible", check=True)
    assert os.getpid() > 10 and res.text.strip() == "invisible"


def test_hostname_is_the_workspace_id(ws):
    assert ws.exec("uname -n", check=True).text.strip() == ws.id
    assert os.uname().nodename != ws.id  # the host's name is untouched


# files ---------------------------------------------------------------------------------
def test_root_holds_only_image_and_runtime_entries(ws):
    inside = set(ws.exec(["ls", "-A", "/"], check=True).text.split())
    image = {e.name for e in _image_root(ws).iterdir()}
    runtime = {e.name for e in ensure_runtime().iterdir()}
    assert runtime == RUNTIME_ENTRIES
    assert inside <= image | RUNTIME_ENTRIES | MOUNTED_ENTRIES, inside - image
    assert RUNTIME_ENTRIES <= inside


def test_host_paths_outside_the_image_are_invisible(ws):
    repo = Path(__file__).resolve().parents[2]
    marker = Path("/var/tmp") / f"bunshin-host-marker-{secrets.token_hex(4)}"
    marker.write_text("host secret")
    try:
        for path in [str(repo), str(repo / "pyproject.toml"), "/var/lib/bunshin", "/var/lib/bunshin/pool",
                     str(paths_records()), str(marker), "/root/.bash_history_host_only"]:
            res = ws.exec(["test", "-e", path])
            assert res.exit_code == 1, f"{path} is visible inside the workspace"
        # the image's /var/tmp is visible (the directory exists) but not the host's file in it
        assert ws.exec(["test", "-d", "/var/tmp"]).exit_code == 0
        # nothing in the workspace names the host root: / inside is the overlay
        assert ws.exec("stat -f -c %T /", check=True).text.strip() == "overlayfs"
    finally:
        marker.unlink()


def paths_records() -> Path:
    from bunshin_gym.config import paths

    return paths().records


def test_snap_is_read_only(ws):
    res = ws.exec("touch /.snap/x")
    assert res.exit_code != 0 and b"Read-only" in res.stderr


def test_writes_land_only_in_the_upper_layer(fresh_ws):
    ws = fresh_ws
    image = _image_root(ws)
    name = f"bunshin-write-{secrets.token_hex(4)}"
    assert (image / "etc" / "debian_version").exists()
    ws.exec(f"echo inside > /etc/{name}; mkdir -p /opt/{name}/d; echo x > /opt/{name}/d/f; "
            f"echo appended >> /etc/debian_version; rm /etc/issue", check=True)
    # the new files are in the upper layer, and nowhere else on the host
    assert (ws.upper / "etc" / name).read_text() == "inside\n"
    assert (ws.upper / "opt" / name / "d" / "f").read_text() == "x\n"
    assert not (image / "etc" / name).exists()
    assert not Path("/etc", name).exists() and not Path("/opt", name).exists()
    # the modified file was copied up, the image's copy is unchanged
    assert (ws.upper / "etc" / "debian_version").read_text().endswith("appended\n")
    assert not (image / "etc" / "debian_version").read_text().endswith("appended\n")
    # the deletion is a whiteout in the upper layer; the image keeps the file
    st = os.lstat(ws.upper / "etc" / "issue")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert (image / "etc" / "issue").exists()
    assert ws.exec("test -e /etc/issue").exit_code == 1
    # the image itself is read-only to the host, too
    with pytest.raises(OSError):
        (image / name).write_text("no")


def test_writes_are_not_seen_by_another_workspace(fresh_ws, ws):
    name = f"/root/private-{secrets.token_hex(4)}"
    fresh_ws.write_file(name, b"mine")
    assert fresh_ws.exec(["cat", name], check=True).stdout == b"mine"
    assert ws.exec(["test", "-e", name]).exit_code == 1


# network -------------------------------------------------------------------------------
def test_only_lo_exists(ws):
    assert ws.exec("ls /sys/class/net", check=True).text.split() == ["lo"]
    links = ws.exec("ip -o link", check=True).text.strip().splitlines()
    assert len(links) == 1 and links[0].split(":")[1].strip() == "lo" and "UP" in links[0]
    devs = ws.exec("tail -n +3 /proc/net/dev", check=True).text.split()
    assert [d for d in devs if d.endswith(":")] == ["lo:"]


def test_network_namespace_differs_from_the_host(ws):
    assert os.stat(f"/proc/{ws.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    script = textwrap.dedent("""
        import errno, socket
        s = socket.socket()
        s.settimeout(3)
        try:
            s.connect(("1.1.1.1", 80))
            print("connected")
        except OSError as e:
            print(errno.errorcode.get(e.errno, e))
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0)); u.sendto(b"ping", u.getsockname()); print(u.recv(10).decode())
    """)
    out = ws.exec(["python3", "-c", script], check=True).text.split()
    assert out == ["ENETUNREACH", "ping"], out


# PID 1, cgroups ------------------------------------------------------------------------
def test_pid1_holds_no_host_fds(ws):
    pid1 = ws.pid
    fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid1}/fd"))
    assert fds == [0, 1, 2]
    root = f"/proc/{pid1}/root"
    expect = {0: "/dev/null", 1: "/run/bunshin/init.log", 2: "/run/bunshin/init.log"}
    for fd, inside in expect.items():
        a, b = os.stat(f"/proc/{pid1}/fd/{fd}"), os.stat(root + inside)
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino), f"fd {fd} does not point to {inside}"
    assert ws.exec("readlink /proc/1/fd/0 /proc/1/fd/1 /proc/1/fd/2", check=True).text.split() == [
        expect[0], expect[1], expect[2]]
    # opened through the workspace's own /dev mount, not the host's (in a user namespace the
    # node itself is the host's, bind-mounted: mknod of a device is refused there)
    def mnt_id(fdinfo: str) -> str:
        return next(line.split()[1] for line in Path(fdinfo).read_text().splitlines() if line.startswith("mnt_id:"))

    with open("/dev/null") as host_null:
        assert mnt_id(f"/proc/self/fdinfo/{host_null.fileno()}") != mnt_id(f"/proc/{pid1}/fdinfo/0")


def test_pid1_is_a_session_leader_with_the_workspace_root(ws):
    fields = Path(f"/proc/{ws.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(fields[3]) == ws.pid  # session id (field 6) is itself
    assert os.stat(f"/proc/{ws.pid}/root").st_dev != os.stat("/").st_dev  # its root is the overlay


def _pid_ns_members(pid1: int) -> set[int]:
    ns = os.stat(f"/proc/{pid1}/ns/pid").st_ino
    members = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"{entry.path}/ns/pid").st_ino == ns:
                    members.add(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return members


def test_workspace_processes_are_in_its_cgroup(fresh_ws):
    ws = fresh_ws
    ws.spawn("sleep 1000")
    ws.spawn(["sh", "-c", "sleep 1001 & sleep 1002"], user="user")
    ws.exec("sleep 0.2")
    members = _pid_ns_members(ws.pid)
    assert len(members) >= 6, members  # init, agent, sleep, sh, 2 sleeps
    in_cgroup = set(ws.pids())
    assert members == in_cgroup
    assert cgroup_pids(ws.id) == in_cgroup
    for pid in in_cgroup:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        ctl = {line.split(":")[1]: line.split(":", 2)[2] for line in lines}
        for d in ws.cgroup.dirs:
            key = "" if unified() else d.parent.parent.name  # v1: one line per controller
            assert ctl.get(key) == f"/bunshin/{ws.id}", (pid, lines)


# seccomp -------------------------------------------------------------------------------
SECCOMP_PROBE = textwrap.dedent("""
    import ctypes, mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = 16 * 4096
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # MADV_FREE needs private anon
    m.write(b"x" * size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    def call(f, *a):
        ctypes.set_errno(0)
        r = f(*a)
        return r, (ctypes.get_errno() if r != 0 else 0)
    params = ctypes.create_string_buffer(256)
    res = {
        "free": call(libc.madvise, addr, size, 8),          # MADV_FREE
        "dontneed": call(libc.madvise, addr, size, 4),      # MADV_DONTNEED
        "io_uring": call(libc.syscall, 425, 4, params),     # io_uring_setup(4, &params)
    }
    print(" ".join(f"{k}={r}/{e}" for k, (r, e) in res.items()))
""")


@pytest.mark.parametrize("user", [None, "user"])
def test_seccomp_filter(ws, user):
    out = ws.exec(["python3", "-c", SECCOMP_PROBE], user=user, check=True).text.split()
    got = dict(kv.split("=") for kv in out)
    assert got["free"] == "-1/22", got  # EINVAL
    assert got["dontneed"] == "0/0", got  # other advice is untouched
    assert got["io_uring"] == "-1/38", got  # ENOSYS


def test_seccomp_is_only_in_the_workspace():
    # the same probe on the host: MADV_FREE works there, so the workspace's EINVAL is the filter's
    out = subprocess.run([sys.executable, "-c", SECCOMP_PROBE], capture_output=True, text=True, check=True)
    got = dict(kv.split("=") for kv in out.stdout.split())
    assert got["free"] == "0/0", got
    assert got["dontneed"] == "0/0", got
