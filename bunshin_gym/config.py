"""Where bunshin-gym keeps its state on the host, all overridable by environment variables.

``BUNSHIN_HOME`` (default ``/var/lib/bunshin``) holds the btrfs pool file and its mount,
the CRIU build and the runtime layer; ``BUNSHIN_RUN`` (default ``/run/bunshin``) holds
the records of live workspaces, which vanish with a reboot as the workspaces do.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """Host paths used by every layer. Build one with :func:`paths`."""

    home: Path
    run: Path
    pool_file: Path
    pool_size: str
    pool: Path
    criu_prefix: Path

    @property
    def criu(self) -> Path:
        return self.criu_prefix / "sbin" / "criu"

    @property
    def images(self) -> Path:
        return self.pool / "images"

    @property
    def workspaces(self) -> Path:
        return self.pool / "workspaces"

    @property
    def snapshots(self) -> Path:
        return self.pool / "snapshots"

    @property
    def runtime(self) -> Path:
        return self.home / "runtime"

    @property
    def cache(self) -> Path:
        return self.home / "cache"

    @property
    def records(self) -> Path:
        return self.run / "workspaces"


def paths() -> Paths:
    """Read the configuration from the environment (cheap; call it where needed)."""
    home = Path(os.environ.get("BUNSHIN_HOME", "/var/lib/bunshin"))
    return Paths(
        home=home,
        run=Path(os.environ.get("BUNSHIN_RUN", "/run/bunshin")),
        pool_file=Path(os.environ.get("BUNSHIN_POOL_FILE", str(home / "pool.img"))),
        pool_size=os.environ.get("BUNSHIN_POOL_SIZE", "60G"),
        pool=Path(os.environ.get("BUNSHIN_POOL", str(home / "pool"))),
        criu_prefix=Path(os.environ.get("BUNSHIN_CRIU_PREFIX", str(home / "criu"))),
    )


@functools.cache
def _binary_carries(path: str, mtime: float, marker: bytes) -> bool:
    try:
        return marker in Path(path).read_bytes()
    except OSError:
        return False


def criu_carries(marker: bytes, p: Paths | None = None) -> bool:
    """Whether the built CRIU carries one of the project's patches (named by a string only that
    patch adds to the binary); False when CRIU is not built. Cached until the binary changes."""
    criu = (p or paths()).criu
    try:
        mtime = criu.stat().st_mtime
    except OSError:
        return False
    return _binary_carries(str(criu), mtime, marker)


def criu_env(p: Paths | None = None) -> dict[str, str]:
    """Environment for every ``criu`` run: the kernel-feature cache file (criu/patches/0015),
    named by boot and by build so that neither a reboot nor a rebuild reads a stale one. CRIU
    keeps it in /run only where /run is a tmpfs; elsewhere it probed again in every dump and
    restore (~25 ms of frozen time)."""
    p = p or paths()
    try:
        build = (p.criu_prefix / ".stamp").read_text().strip()[:12]
    except OSError:
        return {}
    return {"CRIU_KDAT_CACHE": str(p.run / f"criu-{_boot_id()}-{build}.kdat")}


@functools.cache
def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
