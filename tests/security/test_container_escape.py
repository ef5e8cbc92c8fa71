"""Attacks of a policy on its workspace's container, each written as the attack.

The actions a workspace runs are written by a model trained for reward: as root (or as
``user`` through sudo) it tries to read other rollouts, change the snapshot store, reach the
host's devices, kernel and cgroups, and to slip past the seccomp filter. Every test runs the
attack in a real workspace (and in clones, where the store view differs) and asserts it fails.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin_gym.config import paths

PROGRAMS = Path(__file__).parent / "programs"
SUDO = "echo password | sudo -S -p '' "


def _caps(text: str) -> dict[str, int]:
    return {k: int(v, 16) for k, v in (line.split(":\t") for line in text.splitlines() if line.startswith("Cap"))}


@pytest.fixture(scope="module")
def syscall_probe(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("probe") / "syscalls"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(PROGRAMS / "syscalls.c")], check=True)
    return out.read_bytes()


# the user namespace ------------------------------------------------------------------------
def test_workspace_root_is_an_unprivileged_host_id(fresh_ws):
    from bunshin_gym.config import userns_base

    base = userns_base()
    uid_map = fresh_ws.exec("cat /proc/self/uid_map", check=True).text.split()
    assert uid_map == ["0", str(base), "65536"], uid_map  # not the identity map of host root
    # what root writes inside belongs to the namespace's root on the host, not to host root
    fresh_ws.exec("echo x > /root/owned-by && chown user /root/owned-by.user 2>/dev/null; "
                  "touch /root/owned-by.user && chown user:user /root/owned-by.user", check=True)
    upper = fresh_ws.upper / "root"
    assert (upper / "owned-by").stat().st_uid == base
    assert (upper / "owned-by.user").stat().st_uid == base + 1000  # `user` is uid 1000 inside
    # and inside, the image's files keep their owners
    assert fresh_ws.exec("stat -c '%U %a' /usr/bin/sudo /etc/shadow", check=True).text.split() == [
        "root", "4755", "root", "640"]


# capabilities ------------------------------------------------------------------------------
@pytest.mark.parametrize("who", ["root", "user via sudo"])
def test_workspace_root_has_no_host_capabilities(ws, who):
    cmd = "grep Cap /proc/self/status"
    res = ws.exec(cmd if who == "root" else SUDO + cmd, user=None if who == "root" else "user", check=True)
    caps = _caps(res.text)
    full = (1 << 41) - 1
    assert caps["CapBnd"] != full and caps["CapEff"] & ~caps["CapBnd"] == 0, caps
    for cap in (21, 16, 17, 27, 19, 12, 2, 22):  # SYS_ADMIN, SYS_MODULE, SYS_RAWIO, MKNOD, SYS_PTRACE,
        assert not caps["CapBnd"] >> cap & 1, (cap, caps)  # NET_ADMIN, DAC_READ_SEARCH, SYS_BOOT
    assert caps["CapEff"] >> 0 & 1  # CAP_CHOWN: root inside is still root for the workspace's files


def test_sudo_still_works_and_yields_only_the_contained_root(ws):
    res = ws.exec(SUDO + "sh -c 'id -u; touch /etc/sudo-was-here && echo wrote'", user="user", check=True)
    assert res.text.split() == ["0", "wrote"]
    assert ws.exec(SUDO + "mount -t tmpfs none /mnt", user="user").exit_code != 0


# the snapshot store ------------------------------------------------------------------------
def test_a_fresh_workspace_sees_no_snapshot(fresh_ws):
    other = fresh_ws.snapshot()  # a snapshot exists in the store ...
    try:
        assert fresh_ws.exec("ls -A /.snap", check=True).text.split() == []  # ... and is not seen
    finally:
        other.release()


def test_a_clone_sees_only_its_own_chain_and_cannot_write_it(fresh_ws):
    fresh_ws.exec("echo sibling-answer-42 > /root/answer.txt", check=True)
    secret = fresh_ws.snapshot()
    (sibling,) = secret.fork(1)
    fresh_ws.exec("rm /root/answer.txt", check=True)
    base = fresh_ws.snapshot()
    (clone,) = base.fork(1, mode="share")
    try:
        listed = clone.exec("ls -A /.snap", check=True).text.split()
        assert secret.id not in listed and set(listed) <= {base.id}, listed
        grep = clone.exec("grep -rl sibling-answer-42 /.snap 2>/dev/null; ls /.snap/*/fs 2>&1")
        assert "answer" not in grep.text and "sibling-answer-42" not in grep.text
        for attack in ("mount -o remount,bind,rw /.snap", "touch /.snap/x",
                       f"sh -c 'echo x > /.snap/{base.id}/criu/pages-1.img'"):
            assert clone.exec(attack).exit_code != 0, attack
        assert not (paths().snapshots / "x").exists()
    finally:
        for w in (clone, sibling):
            w.close()
        base.release()
        secret.release()


# devices, kernel files, cgroups --------------------------------------------------------------
def test_host_block_device_cannot_be_made_or_read(ws):
    disk = Path("/sys/dev/block")
    majmin = sorted(p.name for p in disk.iterdir())[0] if disk.exists() else "8:0"
    major, minor = majmin.split(":")
    res = ws.exec(f"mknod /tmp/disk b {major} {minor} && head -c 512 /tmp/disk | od -c | head -2")
    assert res.exit_code != 0 and "Operation not permitted" in res.stderr.decode()
    res = ws.exec(SUDO + f"mknod /tmp/disk2 b {major} {minor}", user="user")
    assert res.exit_code != 0


def test_host_cgroups_are_neither_mountable_nor_visible(ws):
    d = ws.exec("mkdir -p /tmp/cg && mount -t cgroup -o freezer none /tmp/cg && ls /tmp/cg")
    assert d.exit_code != 0 and "bunshin" not in d.text
    lines = ws.exec("cat /proc/self/cgroup", check=True).text.splitlines()
    assert lines and all(line.endswith(":/") for line in lines), lines  # a cgroup namespace


def test_sys_and_proc_kernel_files_are_read_only_or_masked(ws):
    assert ws.exec("mount -o remount,rw /sys").exit_code != 0
    assert ws.exec("mount -o remount,rw /proc/sys").exit_code != 0
    assert ws.exec("umount /proc/sys").exit_code != 0
    # a host-wide sysctl and the sysrq trigger cannot be written
    before = Path("/proc/sys/kernel/panic_on_oops").read_text()
    res = ws.exec("echo 1 > /proc/sys/kernel/panic_on_oops")
    assert res.exit_code != 0 and Path("/proc/sys/kernel/panic_on_oops").read_text() == before
    if Path("/proc/sysrq-trigger").exists():
        assert ws.exec("echo h > /proc/sysrq-trigger").exit_code != 0
    for masked in ("/proc/keys", "/proc/timer_list", "/proc/kallsyms"):
        if Path(masked).exists():
            assert ws.exec(f"cat {masked}").stdout == b"", masked
    assert ws.exec("ls /sys/firmware", check=True).text.strip() == ""


def test_root_cannot_fill_the_masks_through_dev(ws):
    """The masks are binds of an empty file and an empty directory of the workspace's /dev (no
    tmpfs of their own: one less tar on every dump and restore); written through /dev, they
    would show whatever root put there over /proc/kcore or /sys/kernel/security."""
    for attack in ("echo planted > /dev/.masked", "touch /dev/.masked-dir/planted",
                   "chmod 777 /dev/.masked-dir", "umount /dev/.masked-dir", "umount /sys/kernel/security",
                   "rmdir /dev/.masked-dir", "rm -f /dev/.masked"):
        ws.exec(attack)  # each may fail: what they leave is checked below
    assert ws.exec("cat /dev/.masked /proc/keys", check=True).stdout == b""
    for masked_dir in ("/sys/firmware", "/sys/kernel/security", "/proc/acpi"):
        if Path(masked_dir).exists():
            assert ws.exec(f"ls -A {masked_dir}", check=True).text.strip() == "", masked_dir
            assert ws.exec(f"touch {masked_dir}/planted").exit_code != 0, masked_dir
    # tmpfs file systems (binds of one show its device again): /dev, /dev/shm, /tmp and /run only
    tmpfs = {f[2] for f in (line.split() for line in ws.exec("cat /proc/self/mountinfo", check=True).text.splitlines())
             if f[f.index("-") + 1] == "tmpfs"}
    assert len(tmpfs) == 4, tmpfs


def test_nodev_everywhere_but_the_workspace_dev(ws):
    mounts = {line.split()[1]: line.split()[3].split(",") for line in
              ws.exec("cat /proc/self/mounts", check=True).text.splitlines()}
    assert "nodev" in mounts["/"] and "nodev" in mounts["/tmp"] and "nodev" in mounts["/.snap"]
    assert "ro" in mounts["/.snap"] and "ro" in mounts["/sys"] and "ro" in mounts["/proc/sys"]
    # sized tmpfs mounts: filling /tmp ends in ENOSPC, not in the host's memory
    assert all(any(o.startswith("size=") for o in mounts[m]) for m in ("/tmp", "/run", "/dev/shm"))


# seccomp -----------------------------------------------------------------------------------
def _probe(ws, program: bytes) -> dict[str, str]:
    ws.write_file("/tmp/syscalls", program, mode=0o755)
    res = ws.exec("/tmp/syscalls", check=True)
    return dict(line.split("=", 1) for line in res.text.splitlines())


EXPECTED = {
    "i386_io_uring_setup": "ENOSYS", "i386_getpid": "ENOSYS", "x32_getpid": "ENOSYS",
    "io_uring_setup": "ENOSYS", "init_module": "EPERM", "finit_module": "EPERM", "kexec_load": "EPERM",
    "open_by_handle_at": "EPERM", "keyctl": "EPERM", "add_key": "EPERM", "bpf": "EPERM",
    "userfaultfd": "EPERM", "unshare_user": "EPERM", "mount": "EPERM", "fsopen": "EPERM", "getpid": "ok",
    # not attacks: what CRIU cannot carry into a clone (protection keys, inotify watches on the overlay)
    "pkey_alloc": "ENOSYS", "inotify_init1": "ENOSYS",
}


def test_seccomp_refuses_other_architectures_and_kernel_reaching_calls(ws, syscall_probe):
    got = _probe(ws, syscall_probe)
    assert {k: got.get(k) for k in EXPECTED} == EXPECTED


@pytest.mark.parametrize("mode", ["copy", "share"])
def test_containment_survives_snapshot_and_fork(fresh_ws, syscall_probe, mode):
    fresh_ws.write_file("/tmp/syscalls", syscall_probe, mode=0o755)
    snap = fresh_ws.snapshot()
    (clone,) = snap.fork(1, mode=mode)
    try:
        got = dict(line.split("=", 1) for line in clone.exec("/tmp/syscalls", check=True).text.splitlines())
        assert {k: got.get(k) for k in EXPECTED} == EXPECTED
        caps = _caps(clone.exec("grep Cap /proc/self/status", check=True).text)
        assert not caps["CapBnd"] >> 21 & 1  # CAP_SYS_ADMIN stays dropped in the clone
        assert clone.exec("mount -o remount,rw /sys").exit_code != 0
        assert all(line.endswith(":/") for line in clone.exec("cat /proc/self/cgroup", check=True).text.splitlines())
    finally:
        clone.close()
        snap.release()


def test_devices_cgroup_allows_only_the_workspace_devices(ws):
    from bunshin_gym.workspace.cgroups import CGROOT, unified

    if unified():
        pytest.skip("cgroup v2 host: no v1 devices controller (the user namespace keeps devices out)")
    rules = (CGROOT / "devices" / "bunshin" / ws.id / "devices.list").read_text().split("\n")
    assert "a *:* rwm" not in rules and not any(r.startswith("b ") for r in rules), rules
    assert "c 1:3 rwm" in rules  # /dev/null still works
    assert ws.exec("echo x > /dev/null && head -c 1 /dev/zero | wc -c", check=True).text.strip() == "1"
