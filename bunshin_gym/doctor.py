"""``bunshin doctor``: check every prerequisite and say the command that fixes what is wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.config import paths

SETUP = "scripts/setup.sh"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def _check(name: str, fix: str, fn: Callable[[], str]) -> Check:
    try:
        return Check(name, True, fn())
    except Exception as e:  # noqa: BLE001 - each failure is a finding
        return Check(name, False, str(e), fix)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _root() -> str:
    _need(os.geteuid() == 0, "bunshin needs root (namespaces, mounts, CRIU)")
    return "running as root"


def _kernel() -> str:
    for ns in ("mnt", "pid", "net", "ipc", "uts"):
        _need(Path(f"/proc/self/ns/{ns}").exists(), f"no {ns} namespaces")
    fs = Path("/proc/filesystems").read_text()
    for name in ("overlay", "btrfs", "tmpfs"):
        _need(name in fs, f"kernel lacks the {name} filesystem")
    _need(hasattr(os, "pidfd_open"), "no pidfd_open")
    feats = ["namespaces", "overlay", "btrfs"]
    if Path("/sys/kernel/mm/ksm/run").exists():
        feats.append("ksm")
    if Path("/proc/sys/vm/unprivileged_userfaultfd").exists() or Path("/dev/userfaultfd").exists():
        feats.append("userfaultfd")
    return f"{os.uname().release}: " + ", ".join(feats)


def _cgroups() -> str:
    from bunshin_gym.workspace import cgroups

    if cgroups.unified():
        ctl = (cgroups.CGROOT / "cgroup.controllers").read_text()
        _need("memory" in ctl, "cgroup v2 without the memory controller")
        return "cgroup v2 (memory, freeze)"
    for ctl in ("memory", "freezer"):
        _need((cgroups.CGROOT / ctl).is_dir(), f"cgroup v1 {ctl} controller not mounted")
    return "cgroup v1 (memory, freezer)"


def _tools() -> str:
    missing = [t for t in ("btrfs", "mkfs.btrfs", "debootstrap", "gcc", "unshare", "nft") if not shutil.which(t)]
    _need(not missing, f"missing host tools: {', '.join(missing)}")
    return "btrfs-progs, debootstrap, gcc, util-linux, nftables"


def _criu() -> str:
    p = paths()
    _need(p.criu.exists(), f"CRIU is not built at {p.criu}")
    out = subprocess.run([str(p.criu), "check"], capture_output=True, text=True)
    _need(out.returncode == 0, f"criu check failed: {(out.stderr or out.stdout).strip()[-300:]}")
    ver = subprocess.run([str(p.criu), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return f"{ver.strip()} at {p.criu}: criu check passes"


def _pycriu() -> str:
    from bunshin_gym.workspace.snapshots import criu_images

    images = criu_images.pycriu_images(paths())
    return f"pycriu from {images.__file__.rsplit('/pycriu/', 1)[0]} (snapshot flattening rewrites CRIU images)"


def _pool() -> str:
    from bunshin_gym.workspace import pool

    p = paths()
    _need(pool.is_mounted(p.pool), f"btrfs pool {p.pool_file} is not mounted on {p.pool}")
    st = os.statvfs(p.pool)
    free = st.f_bavail * st.f_frsize / 2**30
    _need(free > 5, f"only {free:.1f} GiB free in the pool")
    return f"{p.pool} mounted, {free:.1f} GiB free"


def _disk() -> str:
    p = paths()
    st = os.statvfs(p.home if p.home.exists() else "/")
    free = st.f_bavail * st.f_frsize / 2**30
    _need(free > 10, f"only {free:.1f} GiB free under {p.home}")
    return f"{free:.1f} GiB free under {p.home}"


def _images() -> str:
    from bunshin_gym.workspace.images import ImageStore, recipe_paths

    store = ImageStore()
    names = sorted(recipe_paths())
    missing = [n for n in names if not store.exists(n)]
    _need("base" not in missing, "the base image is not built")
    built = [n for n in names if n not in missing]
    return f"built: {', '.join(built)}" + (f"; not yet built: {', '.join(missing)}" if missing else "")


def _runtime() -> str:
    from bunshin_gym.workspace.runtime import ensure_runtime

    return f"runtime layer {ensure_runtime()}"


def _containment() -> str:
    """The containment in force, read from inside a real workspace (not from the settings)."""
    from bunshin_gym.config import Limits
    from bunshin_gym.workspace import Workspace, idmap

    with Workspace.create("base") as ws:
        probe = ws.exec("cat /proc/self/uid_map; grep -E '^(CapBnd|Seccomp):' /proc/self/status; "
                        "ls -A /.snap | wc -l; head -1 /proc/self/cgroup; "
                        "grep -c ' /proc/sys proc ro' /proc/self/mounts", check=True)
        uid_map, capbnd, seccomp, snap_entries, cgroup, proc_sys_ro = probe.text.split("\n")[:6]
        devices = ws.cgroup._v1_dir("devices")
        dev_rules = len((devices / "devices.list").read_text().splitlines()) if devices else 0
    host_root = uid_map.split()[1]
    _need(host_root != "0" or idmap.current() is None, f"workspace root is host root (uid_map {uid_map.strip()})")
    caps = int(capbnd.split()[1], 16)
    _need(not caps >> 21 & 1, "workspaces hold CAP_SYS_ADMIN")
    _need(seccomp.split()[1] == "2", "no seccomp filter in workspaces")
    _need(snap_entries.strip() == "0", f"a fresh workspace sees {snap_entries.strip()} entries at /.snap")
    _need(proc_sys_ro.strip() == "1", "/proc/sys is writable in workspaces")
    _need(cgroup.endswith(":/"), f"no cgroup namespace ({cgroup})")
    limits = Limits.from_env()
    userns = f"user namespace (root = host uid {host_root})" if host_root != "0" else "NO user namespace"
    return (f"{userns}; {bin(caps).count('1')} capabilities (no CAP_SYS_ADMIN); seccomp (native arch "
            f"only, kernel-reaching calls denied); /proc and /sys masked or read-only; cgroup namespace; "
            + (f"devices cgroup ({dev_rules} allowed); " if devices else "")
            + f"snapshot store hidden; limits: memory {limits.memory >> 20} MiB, pids {limits.pids}, "
            f"disk {limits.disk >> 20} MiB")


def run_checks() -> list[Check]:
    return [
        _check("root", "run as root (sudo -i)", _root),
        _check("kernel", "use a Linux kernel with namespaces, overlayfs and btrfs", _kernel),
        _check("cgroups", "mount the memory and freezer cgroup controllers (or cgroup v2)", _cgroups),
        _check("host tools", SETUP, _tools),
        _check("criu", "criu/build.sh (or " + SETUP + ")", _criu),
        _check("pycriu", "criu/pycriu.sh (or " + SETUP + ")", _pycriu),
        _check("disk", f"free disk space under {paths().home}", _disk),
        _check("pool", SETUP, _pool),
        _check("runtime", SETUP, _runtime),
        _check("images", "bunshin image build base  (or " + SETUP + ")", _images),
        _check("containment", "see docs/containment.md", _containment),
    ]


def main() -> int:
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else "FAIL"
        print(f"[{mark}] {c.name:<{width}}  {c.detail}")
        if not c.ok:
            print(f"       {'':<{width}}  fix: {c.fix}")
    bad = [c for c in checks if not c.ok]
    print(f"\n{len(checks) - len(bad)} of {len(checks)} checks pass" + ("" if not bad else "; see the fixes above"))
    return 1 if bad else 0
