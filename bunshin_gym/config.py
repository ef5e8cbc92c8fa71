"""Configuration: every ``BUNSHIN_*`` environment variable, read here and nowhere else.

:data:`VARIABLES` (loaded from ``variables.toml``) lists each one: its default and meaning,
and who reads it (this package, the set-up and test scripts, the kernel-module VM tests, or
bunshin itself for a program it starts). ``docs/configuration.md`` is generated from that
list (:func:`markdown`), and ``tests/test_config_vars.py`` fails when a variable is read or
mentioned anywhere without being listed, or read outside this module. Values are read at
use (a test or a benchmark may set one for a while), through the typed functions below or
:func:`get`.

``BUNSHIN_HOME`` (default ``/var/lib/bunshin``) holds the btrfs pool file and its mount,
the CRIU build and the runtime layer; ``BUNSHIN_RUN`` (default ``/run/bunshin``) holds
the records of live workspaces, which vanish with a reboot as the workspaces do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: who reads a variable (the table's "read by" column)
PACKAGE = "bunshin_gym"
SCRIPTS = "scripts"
KMOD_VM = "kmod VM tests"
INTERNAL = "internal"


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``default`` as the table shows it ("" when unset means
    "off" or "none"), what it does, and who reads it."""

    name: str
    default: str
    meaning: str
    read_by: str = PACKAGE


#: every BUNSHIN_* variable, in the order of docs/configuration.md (the list is data:
#: bunshin_gym/variables.toml)
VARIABLES: tuple[Variable, ...] = tuple(
    Variable(**row) for row in tomllib.loads(Path(__file__).with_name("variables.toml").read_text())["variable"])
_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str, default: str | None = None) -> str:
    """The value of a listed variable when set, else ``default``, else its listed default (for
    one derived from another variable, such as ``$BUNSHIN_HOME/pool``, the caller passes the
    derived value). A name not in :data:`VARIABLES` is a ``KeyError``: a new variable is
    listed (and so documented) first."""
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a listed variable: add it to bunshin_gym/variables.toml") from None
    return os.environ.get(name, var.default if default is None else default)


@contextlib.contextmanager
def overridden(values: dict[str, str | None]) -> Iterator[None]:
    """Listed variables set (None: unset) for the ``with`` block, their old values back after
    it: values are read when used, so what the block does sees these (a benchmark putting two
    settings side by side in one process)."""
    for name in values:
        get(name)  # a KeyError for an unlisted name
    with _environ(values):
        yield


@contextlib.contextmanager
def criu_overridden(values: dict[str, str | None]) -> Iterator[None]:
    """CRIU's own variables (``CRIU_*``: its switches in criu/patches, read by each CRIU run)
    set (None: unset) for the ``with`` block, as :func:`overridden` does for listed ones."""
    bad = [name for name in values if not name.startswith("CRIU_")]
    if bad:
        raise KeyError(f"{bad} are not CRIU's variables (CRIU_*): listed ones go through overridden()")
    with _environ(values):
        yield


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    old = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(old)


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def colon_dirs(name: str) -> list[str]:
    """The non-empty entries of a colon-separated list of directories (``BUNSHIN_RECIPES``,
    ``BUNSHIN_OSWORLD_CACHE``)."""
    return [d for d in get(name).split(":") if d]


def cgroup_root() -> Path:
    """``BUNSHIN_CGROUP_ROOT``: where workspaces' cgroups are created."""
    return Path(get("BUNSHIN_CGROUP_ROOT"))


def max_snapshot_depth() -> int:
    """``BUNSHIN_MAX_SNAPSHOT_DEPTH``: how many ancestors' page files a snapshot may reference
    before it is flattened (an empty value is the default, as it always was)."""
    return int(get("BUNSHIN_MAX_SNAPSHOT_DEPTH") or _BY_NAME["BUNSHIN_MAX_SNAPSHOT_DEPTH"].default)


def dump_tries() -> int:
    """``BUNSHIN_DUMP_TRIES``: how often a dump that failed to seize a task is tried (at least once)."""
    return max(1, int(get("BUNSHIN_DUMP_TRIES")))


def criu_dump_verbosity() -> int:
    """``BUNSHIN_CRIU_DUMP_VERBOSITY``: CRIU's log level for dumps."""
    return int(get("BUNSHIN_CRIU_DUMP_VERBOSITY"))


def share_ksm() -> bool:
    """``BUNSHIN_SHARE_KSM=1``: share mode's uffd clones are KSM-mergeable too."""
    return get("BUNSHIN_SHARE_KSM") == "1"


def share_anon_forced_ksm() -> bool:
    """``BUNSHIN_SHARE_ANON=ksm``: share mode serves anonymous memory through KSM."""
    return get("BUNSHIN_SHARE_ANON").lower() == "ksm"


def uffd_delta() -> bool:
    """``BUNSHIN_UFFD_DELTA`` (on unless ``0``): snapshots of uffd clones are deltas."""
    return get("BUNSHIN_UFFD_DELTA") != "0"


def write_tracking() -> bool:
    """``BUNSHIN_WRITE_TRACKING`` (on unless ``0``): copy and ksm clones are restored with
    userfaultfd write tracking, so that their snapshots can be deltas."""
    return get("BUNSHIN_WRITE_TRACKING") != "0"


def background_dump() -> bool:
    """``BUNSHIN_BACKGROUND_DUMP=1``: a snapshot's pages are written after the thaw (criu/patches/0020)."""
    return get("BUNSHIN_BACKGROUND_DUMP") == "1"


def workspace_nice() -> int:
    """``BUNSHIN_WS_NICE``: the nice value a new workspace's processes start at (-20..19)."""
    raw = get("BUNSHIN_WS_NICE")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"BUNSHIN_WS_NICE={raw!r} is not a nice value (an integer from -20 to 19)") from None
    if not -20 <= value <= 19:
        raise ValueError(f"BUNSHIN_WS_NICE={raw!r} is out of range (-20 to 19)")
    return value


def at_workspace_nice(cmd: list[str]) -> list[str]:
    """``cmd`` run at :func:`workspace_nice`, not at the calling thread's niceness, which a child
    inherits: Ray starts its workers at nice 15, and a workspace a host actor made ran its whole
    life at 15 beside work at 0. CRIU restores a task's niceness from its images, so a clone
    keeps what its snapshot's workspace was launched with."""
    adjust = workspace_nice() - os.getpriority(os.PRIO_PROCESS, 0)  # 0: this thread, on Linux
    return cmd if adjust == 0 else ["nice", "-n", str(adjust), *cmd]


def kmod_double_copy() -> bool:
    """``BUNSHIN_KMOD_DOUBLE=copy``: kmod mode's test double that copies pages."""
    return get("BUNSHIN_KMOD_DOUBLE") == "copy"


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
    home = Path(get("BUNSHIN_HOME"))
    return Paths(
        home=home,
        run=Path(get("BUNSHIN_RUN")),
        pool_file=Path(get("BUNSHIN_POOL_FILE", str(home / "pool.img"))),
        pool_size=get("BUNSHIN_POOL_SIZE"),
        pool=Path(get("BUNSHIN_POOL", str(home / "pool"))),
        criu_prefix=Path(get("BUNSHIN_CRIU_PREFIX", str(home / "criu"))),
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
    if get("BUNSHIN_USERNS") == "0":
        return None
    return int(get("BUNSHIN_USERNS_BASE"))


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
        return cls(
            memory=parse_size(get("BUNSHIN_WS_MEMORY")),
            pids=_parse_count(get("BUNSHIN_WS_PIDS")),
            disk=parse_size(get("BUNSHIN_WS_DISK")),
        )

    @classmethod
    def parse(cls, value: Limits | dict | None) -> Limits:
        """A :class:`Limits` from one, a dict of some of its fields (sizes as ``"2G"`` or bytes;
        unnamed fields from :meth:`from_env`), or None (all from :meth:`from_env`)."""
        if isinstance(value, Limits):
            return value
        if value is None:
            return cls.from_env()
        if not isinstance(value, dict):
            raise TypeError(f"limits: want a Limits or a dict, got {type(value).__name__}")
        unknown = set(value) - {"memory", "pids", "disk"}
        if unknown:
            raise ValueError(f"limits: unknown keys {sorted(unknown)} (known: memory, pids, disk)")
        # a workspace's record names all three: the environment is read only for a partial dict
        base = cls.from_env() if len(value) < 3 else cls()
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


# the documentation ------------------------------------------------------------------------
_SECTIONS = ((PACKAGE, "Read by the package"), (INTERNAL, "Set by bunshin for a program it starts (not configuration)"),
             (SCRIPTS, "Read by the set-up and test scripts"),
             (KMOD_VM, "Read by the kernel module's VM tests (kmod/)"))


def markdown() -> str:
    """docs/configuration.md, generated from :data:`VARIABLES`."""
    out = ["# Configuration", "",
           "<!-- generated from bunshin_gym/variables.toml; tests/test_config_vars.py checks it is",
           "     current. Regenerate: python -c 'import bunshin_gym.config as c; print(c.markdown(), end=\"\")'",
           "     > docs/configuration.md -->", "",
           "bunshin-gym is configured by environment variables only, all named `BUNSHIN_*`, all read",
           "in `bunshin_gym/config.py` (the package reads no other). Values are read when used, so a",
           "process may change one between operations. Per-workspace limits (`BUNSHIN_WS_*`) are",
           "defaults: `Workspace.create(limits=...)` and the envs' `limits=` override them, and",
           "clones keep their snapshot's."]
    for key, title in _SECTIONS:
        out += ["", f"## {title}", "", "| variable | default | meaning |", "|---|---|---|"]
        for v in VARIABLES:
            if v.read_by == key:
                default = f"`{v.default}`" if v.default else "(unset)"
                out.append(f"| `{v.name}` | {default} | {v.meaning} |")
    return "\n".join(out) + "\n"
