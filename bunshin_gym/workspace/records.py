"""Records of live workspaces on this host, so that any process can list, attach to and
reclaim them (``bunshin ws ls``, ``bunshin gc``).

A record is written before anything is created and removed after everything is reclaimed:
whatever a crash leaves behind is either named by a record or found by ``gc``'s sweep.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bunshin_gym.config import Paths, paths


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, None when gone."""
    # os.read, not Path.read_text: a quarter of the time, and this runs several times per env step
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
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
    memory_mode: str = "share"  # how its clones get their memory (workspace/memory.py)
    snapshot: str | None = None  # the snapshot it was restored from, if any
    userns_base: int | None = None  # host id of root inside (workspace/idmap.py); None: no user namespace
    extra: dict = field(default_factory=dict)
    # the process starting or restoring it, until PID 1 is recorded: a detached workspace has no
    # owner, so this is what tells ``gc`` that a half-made one (its maker killed) is abandoned
    builder: int | None = None
    builder_start: int | None = None

    def owner_alive(self) -> bool:
        return self.owner is None or process_alive(self.owner, self.owner_start)

    def abandoned(self) -> bool:
        """Not started yet (no PID 1 recorded) and its maker is gone: nobody will finish it."""
        return self.pid1 is None and self.builder is not None and not process_alive(self.builder, self.builder_start)

    def running(self) -> bool:
        return process_alive(self.pid1, self.pid1_start)


def _dir(p: Paths | None) -> Path:
    d = (p or paths()).records
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(rec: Record, p: Paths | None = None) -> None:
    path = _dir(p) / f"{rec.id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rec)))
    os.replace(tmp, path)


def _parse(text: str) -> Record:
    data = json.loads(text)
    known = Record.__dataclass_fields__
    return Record(**{k: v for k, v in data.items() if k in known})  # newer fields are ignored


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
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            continue
    return out
