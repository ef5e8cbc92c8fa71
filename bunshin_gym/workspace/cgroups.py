"""Per-workspace cgroups: memory accounting and limit, pids limit, the freezer, and a handle
on every process.

Works with cgroup v2 (one ``bunshin/<id>`` group in the unified hierarchy) and with the
v1 hybrid layout (``memory``, ``freezer`` and ``pids`` controllers, one ``bunshin/<id>``
each). The limits (:class:`~bunshin_gym.config.Limits`) are written when the group is
created, before any process joins it: a workspace never runs unlimited.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import time
from pathlib import Path

from bunshin_gym.config import Limits, cgroup_root, paths
from bunshin_gym.workspace.errors import WorkspaceError

CGROOT = cgroup_root()
PARENT = "bunshin"
#: the run directory the environment named when CGROOT was read: the records that name this
#: process's workspace cgroups are there (``gc`` sweeps cgroups against no other)
RUN_DIR = paths().run


def unified() -> bool:
    return (CGROOT / "cgroup.controllers").exists()


#: v1 controllers a workspace gets a group in; the order is fixed: dirs[0] is memory,
#: dirs[1] the freezer (pids and devices are optional: a host without them runs without a
#: pids limit or a device allow-list)
V1_CONTROLLERS = ("memory", "freezer", "pids", "devices")
V1_OPTIONAL = ("pids", "devices")

#: the devices a workspace may open or create (cgroup v1 devices controller; "c MAJ:MIN
#: ACCESS"), all others are refused: its own /dev (null, zero, full, random, urandom, tty,
#: ptmx and its pts), the overlay's whiteouts (0:0), and /dev/userfaultfd for CRIU restoring a
#: share clone inside the group (the workspace has no such node and cannot make one)
ALLOWED_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm",
                   "c 136:* rwm", "c 0:0 m", "c 10:257 rw")


#: host device nodes that bunshin's restore helpers open from inside a workspace's groups when
#: the node exists: the kmod share module (its kmod action script runs in the clone's group)
HELPER_DEVICE_NODES = ("/dev/bunshin_share",)


def _host_helper_devices() -> list[str]:
    rules = []
    for node in HELPER_DEVICE_NODES:
        try:
            st = os.stat(node)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            rules.append(f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rw")
    return rules


def _v1_controllers() -> tuple[str, ...]:
    return tuple(c for c in V1_CONTROLLERS if c not in V1_OPTIONAL or (CGROOT / c).is_dir())


def _dirs(name: str) -> list[Path]:
    if unified():
        return [CGROOT / PARENT / name]
    return [CGROOT / ctl / PARENT / name for ctl in _v1_controllers()]


class Cgroup:
    """The cgroup(s) of one workspace."""

    def __init__(self, name: str):
        self.name = name
        self.dirs = _dirs(name)
        self._event_files: tuple[str, str | None] | None = None

    @classmethod
    def create(cls, name: str, limits: Limits | None = None) -> Cgroup:
        """Make the group(s) and write the limits (default: :meth:`Limits.from_env`)."""
        cg = cls(name)
        limits = limits or Limits.from_env()
        if unified():
            parent = CGROOT / PARENT
            parent.mkdir(exist_ok=True)
            # delegate the memory and pids controllers to the workspaces below us (pids where
            # the kernel has it: without it a workspace runs without a pids limit)
            have = set((CGROOT / "cgroup.controllers").read_text().split())
            enable = " ".join(f"+{c}" for c in ("memory", "pids") if c in have)
            for d in (CGROOT, parent) if enable else ():
                (d / "cgroup.subtree_control").write_text(enable)
        for d in cg.dirs:
            d.mkdir(parents=True, exist_ok=False)
        try:
            cg.set_limits(limits)
            cg._allow_devices()
        except BaseException:
            cg.remove()
            raise
        return cg

    def set_limits(self, limits: Limits) -> None:
        """Write the memory and pids limits (0 = unlimited)."""
        mem = self.dirs[0]
        pids = self._pids_dir()
        if unified():
            (mem / "memory.max").write_text(str(limits.memory) if limits.memory else "max")
            # no swap: a workspace at its limit is OOM-killed at once instead of thrashing the host
            if (mem / "memory.swap.max").exists():
                (mem / "memory.swap.max").write_text("0" if limits.memory else "max")
        else:
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory) if limits.memory else "-1")
            if (mem / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: cap memory+swap too
                (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory) if limits.memory else "-1")
        if pids is not None:
            (pids / "pids.max").write_text(str(limits.pids) if limits.pids else "max")

    def _pids_dir(self) -> Path | None:
        if unified():
            return self.dirs[0] if (self.dirs[0] / "pids.max").exists() else None
        return self._v1_dir("pids")

    def _v1_dir(self, controller: str) -> Path | None:
        found = [d for d in self.dirs if d.parts[-3] == controller]
        return found[0] if found else None

    def _allow_devices(self) -> None:
        """Deny every device but :data:`ALLOWED_DEVICES` (cgroup v1; on v2 the device rules are
        a BPF program, and the workspace's user namespace, with no CAP_MKNOD and only bound
        host nodes in its /dev, is what keeps it from devices there)."""
        d = None if unified() else self._v1_dir("devices")
        if d is None:
            return
        (d / "devices.deny").write_text("a")
        for rule in (*ALLOWED_DEVICES, *_host_helper_devices()):
            (d / "devices.allow").write_text(rule)

    def limits(self) -> dict[str, int]:
        """The limits in force (bytes, processes; 0 = unlimited)."""
        mem = self.dirs[0]
        raw = (mem / ("memory.max" if unified() else "memory.limit_in_bytes")).read_text().strip()
        memory = 0 if raw == "max" or int(raw) >= 1 << 62 else int(raw)
        pids_dir = self._pids_dir()
        raw = (pids_dir / "pids.max").read_text().strip() if pids_dir is not None else "max"
        return {"memory": memory, "pids": 0 if raw == "max" else int(raw)}

    def limit_events(self) -> dict[str, int]:
        """How often the workspace hit a limit since its group was made: ``oom_kill`` (processes
        the kernel killed at the memory limit) and ``pids_max`` (forks refused at the pids limit).
        """
        files = self._event_files
        if files is None:  # resolved once: this runs twice per env step
            pids_dir = self._pids_dir()
            files = self._event_files = (
                str(self.dirs[0] / ("memory.events" if unified() else "memory.oom_control")),
                str(pids_dir / "pids.events") if pids_dir is not None else None,
            )
        oom = _field(_read_small(files[0]), "oom_kill")
        refused = 0
        if files[1] is not None:
            try:
                refused = _field(_read_small(files[1]), "max")
            except FileNotFoundError:  # a kernel whose pids controller counts no events
                pass
        return {"oom_kill": oom, "pids_max": refused}

    def exists(self) -> bool:
        return any(d.exists() for d in self.dirs)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
            except OSError as e:  # ENODEV: removed (by a concurrent reclaim) while we read it
                if e.errno != errno.ENODEV:
                    raise
        return sorted(found)

    # freezer -------------------------------------------------------------------------
    def freezer_dir(self) -> Path:
        """The directory whose freezer this cgroup's freeze and thaw use (what ``criu dump
        --freeze-cgroup`` is given)."""
        return self.dirs[0] if unified() else self.dirs[1]

    def freeze(self, timeout: float = 10.0) -> None:
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 10.0) -> None:
        self._set_frozen(False, timeout)

    def is_frozen(self) -> bool:
        d = self.freezer_dir()
        if unified():
            return "frozen 1" in (d / "cgroup.events").read_text()
        return (d / "freezer.state").read_text().strip() == "FROZEN"

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        d = self.freezer_dir()
        if unified():
            (d / "cgroup.freeze").write_text("1" if frozen else "0")
            done = lambda: f"frozen {int(frozen)}" in (d / "cgroup.events").read_text()  # noqa: E731
        else:
            want = "FROZEN" if frozen else "THAWED"
            (d / "freezer.state").write_text(want)
            done = lambda: (d / "freezer.state").read_text().strip() == want  # noqa: E731
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise WorkspaceError(f"cgroup {self.name}: not {'frozen' if frozen else 'thawed'} after {timeout}s")
            time.sleep(0.0005)
            if frozen and not unified():
                # v1 tries each task once per write: one that went to sleep after that try (a
                # vfork parent waiting for its frozen child) stays FREEZING until the next write
                (d / "freezer.state").write_text(want)

    def memory_usage(self) -> int:
        """Bytes charged to the workspace's memory cgroup (page cache included)."""
        d = self.dirs[0]
        f = d / ("memory.current" if unified() else "memory.usage_in_bytes")
        return int(f.read_text())

    # teardown ------------------------------------------------------------------------
    def kill_all(self) -> None:
        if unified() and (self.dirs[0] / "cgroup.kill").exists():
            (self.dirs[0] / "cgroup.kill").write_text("1")
            return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, timeout: float = 10.0) -> None:
        """Kill what is left and remove the cgroup directories (missing is fine)."""
        deadline = time.monotonic() + timeout
        if not unified() and self.dirs[1].exists():
            try:  # frozen tasks cannot die
                self.thaw(timeout=1)
            except (WorkspaceError, OSError):
                pass
        for d in self.dirs:
            while d.exists():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise WorkspaceError(f"cannot remove cgroup {d}: {e}") from e
                    self.kill_all()
                    time.sleep(0.005)


def _read_small(path: str) -> str:
    """A small kernel file in one read (os calls: a third of the cost of open().read())."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def _field(text: str, key: str) -> int:
    """The value of ``key N`` in a flat-keyed cgroup file (0 when absent)."""
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def list_names() -> set[str]:
    """Names of all workspace cgroups present on the host."""
    names: set[str] = set()
    roots = [CGROOT / PARENT] if unified() else [CGROOT / c / PARENT for c in _v1_controllers()]
    for root in roots:
        if root.exists():
            names.update(p.name for p in root.iterdir() if p.is_dir())
    return names
