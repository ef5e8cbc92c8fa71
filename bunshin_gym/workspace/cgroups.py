"""Per-workspace cgroups: memory accounting, the freezer, and a handle on every process.

Works with cgroup v2 (one ``bunshin/<id>`` group in the unified hierarchy) and with the
v1 hybrid layout (``memory`` and ``freezer`` controllers, one ``bunshin/<id>`` each).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from bunshin_gym.workspace.errors import WorkspaceError

CGROOT = Path(os.environ.get("BUNSHIN_CGROUP_ROOT", "/sys/fs/cgroup"))
PARENT = "bunshin"


def unified() -> bool:
    return (CGROOT / "cgroup.controllers").exists()


def _dirs(name: str) -> list[Path]:
    if unified():
        return [CGROOT / PARENT / name]
    return [CGROOT / ctl / PARENT / name for ctl in ("memory", "freezer")]


class Cgroup:
    """The cgroup(s) of one workspace."""

    def __init__(self, name: str):
        self.name = name
        self.dirs = _dirs(name)

    @classmethod
    def create(cls, name: str) -> Cgroup:
        cg = cls(name)
        if unified():
            parent = CGROOT / PARENT
            parent.mkdir(exist_ok=True)
            # delegate the memory controller to the workspaces below us
            (CGROOT / "cgroup.subtree_control").write_text("+memory")
            (parent / "cgroup.subtree_control").write_text("+memory")
        for d in cg.dirs:
            d.mkdir(parents=True, exist_ok=False)
        return cg

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
    def _freezer(self) -> Path:
        return self.dirs[0] if unified() else self.dirs[1]

    def freeze(self, timeout: float = 10.0) -> None:
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 10.0) -> None:
        self._set_frozen(False, timeout)

    def is_frozen(self) -> bool:
        d = self._freezer()
        if unified():
            return "frozen 1" in (d / "cgroup.events").read_text()
        return (d / "freezer.state").read_text().strip() == "FROZEN"

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        d = self._freezer()
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


def list_names() -> set[str]:
    """Names of all workspace cgroups present on the host."""
    names: set[str] = set()
    roots = [CGROOT / PARENT] if unified() else [CGROOT / c / PARENT for c in ("memory", "freezer")]
    for root in roots:
        if root.exists():
            names.update(p.name for p in root.iterdir() if p.is_dir())
    return names
