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


# per-workspace limits --------------------------------------------------------------------
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def userns_base() -> int | None:
    """The host uid/gid of root inside workspaces (their user namespace maps 65536 ids from it):
    ``BUNSHIN_USERNS_BASE`` (default 1000000); None when ``BUNSHIN_USERNS=0`` turns the user
    namespace off."""
    if os.environ.get("BUNSHIN_USERNS", "1") == "0":
        return None
    return int(os.environ.get("BUNSHIN_USERNS_BASE", "1000000"))


def parse_size(value: str | int | None) -> int:
    """Bytes of a size such as ``8G``, ``512M``, ``1048576`` (K/M/G/T are powers of 1024, an
    optional ``i``/``B`` suffix is accepted); 0, ``0``, ``max``, ``none`` and None mean no limit."""
    if value is None:
        return 0
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    if text in ("MAX", "NONE", "UNLIMITED", ""):
        return 0
    unit = text[-1] if text[-1] in _UNITS else ""
    number = text[: len(text) - len(unit)]
    try:
        size = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {value!r} (want e.g. 8G, 512M, 1048576, or max)") from None
    if size < 0:
        raise ValueError(f"a size cannot be negative: {value!r}")
    return int(size)


@dataclass(frozen=True)
class Limits:
    """What one workspace may use; 0 means unlimited. Clones inherit their snapshot's limits.

    Args:
        memory: bytes of memory (its memory cgroup; page cache and tmpfs included, no swap).
            ``BUNSHIN_WS_MEMORY``, default 8G.
        pids: processes and threads (its pids cgroup). ``BUNSHIN_WS_PIDS``, default 4096.
        disk: bytes the workspace may write to its upper layer (a btrfs simple quota on its
            subvolume; files it inherited from its snapshot are not charged again).
            ``BUNSHIN_WS_DISK``, default 8G.

    Example:
        >>> Limits.parse({"memory": "2G", "pids": 512})
        Limits(memory=2147483648, pids=512, disk=8589934592)
    """

    memory: int = 8 << 30
    pids: int = 4096
    disk: int = 8 << 30

    @classmethod
    def from_env(cls) -> Limits:
        """The defaults, overridden by ``BUNSHIN_WS_MEMORY``, ``BUNSHIN_WS_PIDS``, ``BUNSHIN_WS_DISK``."""
        d = cls()
        return cls(
            memory=parse_size(os.environ.get("BUNSHIN_WS_MEMORY", str(d.memory))),
            pids=_parse_count(os.environ.get("BUNSHIN_WS_PIDS", str(d.pids))),
            disk=parse_size(os.environ.get("BUNSHIN_WS_DISK", str(d.disk))),
        )

    @classmethod
    def parse(cls, value: Limits | dict | None) -> Limits:
        """A :class:`Limits` from one, a dict of some of its fields (sizes as ``"2G"`` or bytes;
        unnamed fields from :meth:`from_env`), or None (all from :meth:`from_env`)."""
        if isinstance(value, Limits):
            return value
        base = cls.from_env()
        if value is None:
            return base
        if not isinstance(value, dict):
            raise TypeError(f"limits: want a Limits or a dict, got {type(value).__name__}")
        unknown = set(value) - {"memory", "pids", "disk"}
        if unknown:
            raise ValueError(f"limits: unknown keys {sorted(unknown)} (known: memory, pids, disk)")
        return cls(
            memory=parse_size(value["memory"]) if "memory" in value else base.memory,
            pids=_parse_count(value["pids"]) if "pids" in value else base.pids,
            disk=parse_size(value["disk"]) if "disk" in value else base.disk,
        )

    def as_dict(self) -> dict[str, int]:
        return {"memory": self.memory, "pids": self.pids, "disk": self.disk}


def _parse_count(value: str | int | None) -> int:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("max", "none", "unlimited", "")):
        return 0
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"not a process count: {value!r} (want e.g. 4096, or max)") from None
    if n < 0:
        raise ValueError(f"a process count cannot be negative: {value!r}")
    return n
