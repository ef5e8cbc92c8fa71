"""Records of live workspaces on this host, so that any process can list, attach to and
reclaim them (``bunshin ws ls``, ``bunshin gc``).

A record is written before anything is created and removed after everything is reclaimed:
whatever a crash leaves behind is either named by a record or found by ``gc``'s sweep.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from bunshin_gym.config import Limits, Paths, paths


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, None when gone."""
    # os.read, not Path.read_text: a quarter of the time, and this runs several times per env step
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):  # gone; ESRCH: exiting (CI saw it closing a clone)
        return None
    try:
        raw = os.read(fd, 4096)
    except ProcessLookupError:  # exited between the open and the read
        return None
    finally:
        os.close(fd)
    if b")" not in raw:  # nothing read: gone
        return None
    fields = raw.rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[19])


def proc_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (tells a pid from a reused one)."""
    st = _stat(pid)
    return st[1] if st else None


def process_alive(pid: int | None, start_time: int | None) -> bool:
    """The process with this pid and start time still runs (a zombie is dead: a workspace's
    PID 1 is orphaned by its launcher and stays a zombie until the host's init reaps it).
    One read of /proc (every env step checks PID 1 and a uffd monitor's two processes)."""
    if pid is None or start_time is None:
        return False
    st = _stat(pid)
    return st is not None and st[1] == start_time and st[0] not in ("Z", "X")


@dataclass
class UffdMonitor:
    """The userfaultfd monitor serving a share clone's anonymous memory (workspace/uffd.py):
    its guard and worker processes, its socket, and the record id its files are named after
    (a rollback moves a monitor between records; absent in records of older versions)."""

    guard: int
    guard_start: int | None
    worker: int
    worker_start: int | None
    sock: str
    stem: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> UffdMonitor:
        return cls(**{k: data[k] for k in ("guard", "guard_start", "worker", "worker_start", "sock")},
                   stem=data.get("stem"))

    def to_json(self) -> dict:
        data = asdict(self)
        if self.stem is None:  # as older versions wrote it
            del data["stem"]
        return data


@dataclass
class KmodShareStats:
    """What the kmod pre-resume script did for a kmod clone (workspace/kmod.py): processes and
    ranges served from the holder, pages shared, pages copied (by the test double, or ranges
    the module refused, counted by reason)."""

    processes: int = 0
    ranges: int = 0
    pages_shared: int = 0
    pages_copied: int = 0
    fallback_ranges: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)  # why: "protections", "EBUSY", ...
    mechanism: str = ""
    ms: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class KmodHolderStopped:
    """What the kmod pre-resume script did for a holder: stopped its tasks before they ran."""

    stopped: int

    def to_json(self) -> dict:
        return asdict(self)


def kmod_report(data: dict) -> KmodShareStats | KmodHolderStopped:
    """The typed form of a kmod report (as the pre-resume script writes it, or a record holds it)."""
    if "stopped" in data:
        return KmodHolderStopped(int(data["stopped"]))
    known = {f.name for f in fields(KmodShareStats)}
    return KmodShareStats(**{k: v for k, v in data.items() if k in known})


#: the keys of a record's ``extra`` object in its JSON file (the format of earlier versions,
#: which kept these in an untyped dict): typed fields of :class:`Record` now
_EXTRA_KEYS = ("limits", "uffd", "kmod", "holder_of")


@dataclass
class Record:
    id: str
    image: str
    image_path: str
    subvolume: str
    cgroup: str
    pid1: int | None = None
    pid1_start: int | None = None
    owner: int | None = None  # controller pid; None for workspaces started detached (CLI)
    owner_start: int | None = None
    created: float = 0.0
    layer: str = ""  # runtime layer (top overlay lower) this workspace was started with
    memory_mode: str = "share"  # how its clones get their memory (workspace/memory/)
    snapshot: str | None = None  # the snapshot it was restored from, if any
    userns_base: int | None = None  # host id of root inside (workspace/idmap.py); None: no user namespace
    # the process starting or restoring it, until PID 1 is recorded: a detached workspace has no
    # owner, so this is what tells ``gc`` that a half-made one (its maker killed) is abandoned
    builder: int | None = None
    builder_start: int | None = None
    # in the JSON file these four sit in an object named "extra" (see _EXTRA_KEYS)
    limits: Limits | None = None  # memory, pids and disk limits it was started or restored with
    uffd: UffdMonitor | None = None  # the monitor serving its anonymous memory (share mode over uffd)
    kmod: KmodShareStats | KmodHolderStopped | None = None  # what its kmod restore did
    # the snapshot whose anonymous memory this workspace holds for kmod clones (a holder: a
    # helper of the memory backend, not a user of the snapshot)
    holder_of: str | None = None

    def owner_alive(self) -> bool:
        return self.owner is None or process_alive(self.owner, self.owner_start)

    def abandoned(self) -> bool:
        """Not started yet (no PID 1 recorded) and its maker is gone: nobody will finish it."""
        return self.pid1 is None and self.builder is not None and not process_alive(self.builder, self.builder_start)

    def running(self) -> bool:
        return process_alive(self.pid1, self.pid1_start)

    def to_json(self) -> dict:
        """The record as its file holds it (the layout of earlier versions: see _EXTRA_KEYS)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _EXTRA_KEYS}
        extra = {}
        if self.limits is not None:
            extra["limits"] = self.limits.as_dict()
        if self.uffd is not None:
            extra["uffd"] = self.uffd.to_json()
        if self.kmod is not None:
            extra["kmod"] = self.kmod.to_json()
        if self.holder_of is not None:
            extra["holder_of"] = self.holder_of
        data["extra"] = extra
        return data

    @classmethod
    def from_json(cls, data: dict) -> Record:
        """A record from its file, written by this version or an earlier one (newer fields are
        ignored)."""
        known = {f.name for f in fields(cls)} - set(_EXTRA_KEYS)
        extra = data.get("extra") or {}
        return cls(
            **{k: v for k, v in data.items() if k in known},
            limits=Limits.parse(extra["limits"]) if extra.get("limits") is not None else None,
            uffd=UffdMonitor.from_json(extra["uffd"]) if extra.get("uffd") else None,
            kmod=kmod_report(extra["kmod"]) if extra.get("kmod") is not None else None,
            holder_of=extra.get("holder_of") or None,
        )


def _dir(p: Paths | None) -> Path:
    d = (p or paths()).records
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(rec: Record, p: Paths | None = None) -> None:
    path = _dir(p) / f"{rec.id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec.to_json()))
    os.replace(tmp, path)


def _parse(text: str) -> Record:
    return Record.from_json(json.loads(text))


def load(ws_id: str, p: Paths | None = None) -> Record | None:
    try:
        return _parse((_dir(p) / f"{ws_id}.json").read_text())
    except FileNotFoundError:
        return None


def all_ids(p: Paths | None = None) -> set[str]:
    """Ids of every record, readable or not: what ``gc`` must never sweep as an orphan."""
    return {f.stem for f in _dir(p).glob("*.json")}


def made_by_me() -> dict[str, int | None]:
    """``builder`` fields naming this process (for a record about to be started or restored)."""
    me = os.getpid()
    return {"builder": me, "builder_start": proc_start_time(me)}


def all_names(p: Paths | None = None) -> set[str]:
    """Every id, subvolume name and cgroup name a record holds (a rolled-back workspace runs in
    a subvolume and cgroup named after the restore that replaced its processes): what ``gc``
    must never sweep."""
    names = all_ids(p)
    for rec in all_records(p):
        names |= {Path(rec.subvolume).name, rec.cgroup}
    return names


def remove(ws_id: str, p: Paths | None = None) -> None:
    (_dir(p) / f"{ws_id}.json").unlink(missing_ok=True)


def all_records(p: Paths | None = None) -> list[Record]:
    out = []
    for f in sorted(_dir(p).glob("*.json")):
        try:
            out.append(_parse(f.read_text()))
        except (FileNotFoundError, ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
            continue
    return out
