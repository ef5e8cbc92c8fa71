"""The ``kmod`` memory mode: a clone's private anonymous memory is shared copy-on-write from a
frozen *holder* by the ``bunshin_share`` kernel module (``kmod/``, :mod:`bunshin_gym.kmod_share`).

A kmod clone is made in three steps:

1. The snapshot's holder: one clone of the snapshot restored in ``copy`` mode and kept frozen
   while kmod clones of the snapshot exist (made on first use, closed with the last such clone
   or the snapshot; ``bunshin gc`` reclaims holders a crashed controller left). Its processes
   hold the snapshot's anonymous pages; unmapping them later leaves the clones' pages valid.
2. ``criu restore`` with ``CRIU_SKIP_ANON_PAGES=1`` (``criu/patches/0012``) maps the clone's
   private anonymous memory but reads none of its pages (the module refuses a destination range
   that already holds pages of its own).
3. CRIU's pre-resume action script (:func:`main`) runs while the restored tasks are still
   stopped: each clone process is paired with the holder process of the same pid inside the
   workspace, and every private anonymous range is shared from it. A range the module refuses
   as populated or of an unsupported kind (``EBUSY``, ``EOPNOTSUPP``) is copied instead, so a
   clone is always exact. On any other failure the clone's tasks are stopped before they run,
   then killed, and the fork raises :class:`~bunshin_gym.workspace.errors.ForkError` with the reason.

The module cannot be loaded on every host (the development host's kernel has no module
support; ``make -C kmod test`` tests it in a VM). ``BUNSHIN_KMOD_DOUBLE=copy`` selects
:class:`MemCopySharer`, a test double that copies the present pages through ``/proc/PID/mem``
instead of sharing them: it exercises the whole restore path (skipped pages, the holder, the
pairing, the ranges) without the module, and never serves silently.

    snap = ws.snapshot()
    clones = snap.fork(4, mode="kmod")   # SetupError where /dev/bunshin_share is missing
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from bunshin_gym import config, kmod_share
from bunshin_gym.config import Paths, criu_carries, paths
from bunshin_gym.workspace import buildonce, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.errors import SetupError

CRIU_MARKER = b"CRIU_SKIP_ANON_PAGES"
DOUBLE_ENV = "BUNSHIN_KMOD_DOUBLE"
PAGE = os.sysconf("SC_PAGE_SIZE")
_SPECIAL = ("[vdso]", "[vvar]", "[vvar_vclock]", "[vsyscall]", "[uprobes]")


# availability ------------------------------------------------------------------------------
def unavailable_reason(p: Paths | None = None) -> str | None:
    """Why kmod clones cannot be made on this host (None when they can)."""
    p = p or paths()
    if not p.criu.exists():
        return f"CRIU is not built ({p.criu}); run: criu/build.sh"
    if not criu_carries(CRIU_MARKER, p):
        return f"{p.criu} lacks criu/patches/0012-restore-skip-anon-pages.patch; run: criu/build.sh"
    if config.kmod_double_copy():
        return None
    if not kmod_share.available():
        return (f"the bunshin_share kernel module is not loaded ({kmod_share.DEVICE} is missing): build and "
                "insmod kmod/bunshin_share.ko on a host that can load modules (kmod/README.md), or use "
                "memory mode 'share'")
    return None


def check_available(p: Paths | None = None) -> None:
    reason = unavailable_reason(p)
    if reason:
        raise SetupError(f"memory mode 'kmod' is unavailable: {reason}")


# sharers -----------------------------------------------------------------------------------
class Sharer(Protocol):
    name: str

    def share(self, src: int, dst: int, start: int, length: int) -> int:
        """Share (or copy) S's anonymous pages of the range into D; returns pages served."""


class ModuleSharer:
    """The bunshin_share module: D maps S's pages write-protected, copy-on-write both ways."""

    name = "module"

    def __init__(self) -> None:
        self._dev = kmod_share.KmodShare()

    def share(self, src: int, dst: int, start: int, length: int) -> int:
        return self._dev.share(src, dst, start, length).pages_mapped


class MemCopySharer:
    """Test double: copies S's present (or swapped) pages into D through ``/proc/PID/mem``.

    Exact, but shares nothing; selected only by ``BUNSHIN_KMOD_DOUBLE=copy``. Also the
    fallback for ranges the module refuses."""

    name = "copy"

    def share(self, src: int, dst: int, start: int, length: int) -> int:
        copied = 0
        with open(f"/proc/{src}/pagemap", "rb", buffering=0) as pm, \
                open(f"/proc/{src}/mem", "rb", buffering=0) as smem, \
                open(f"/proc/{dst}/mem", "r+b", buffering=0) as dmem:
            for run_start, run_len in _resident_runs(pm, start, length):
                data = os.pread(smem.fileno(), run_len, run_start)
                if len(data) != run_len:
                    raise OSError(errno.EIO, f"short read of {run_len} bytes at {run_start:#x} from pid {src}")
                os.pwrite(dmem.fileno(), data, run_start)
                copied += run_len // PAGE
        return copied


def _resident_runs(pagemap, start: int, length: int, chunk: int = 1 << 15):
    """(address, bytes) runs of pages present in RAM or swap, from a /proc/PID/pagemap file."""
    run_start, run_len = None, 0
    first = start // PAGE
    total = length // PAGE
    for base in range(0, total, chunk):
        n = min(chunk, total - base)
        raw = os.pread(pagemap.fileno(), 8 * n, 8 * (first + base))
        for i in range(len(raw) // 8):
            entry = int.from_bytes(raw[8 * i:8 * i + 8], "little")
            addr = (first + base + i) * PAGE
            if entry >> 62 & 3:  # bit 63 present, bit 62 swapped
                if run_start is None:
                    run_start, run_len = addr, 0
                run_len += PAGE
            elif run_start is not None:
                yield run_start, run_len
                run_start = None
    if run_start is not None:
        yield run_start, run_len


def sharer() -> Sharer:
    if config.kmod_double_copy():
        return MemCopySharer()
    return ModuleSharer()


# address-space plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    perms: str
    path: str

    @property
    def private_anon(self) -> bool:
        """What CRIU_SKIP_ANON_PAGES leaves empty: private anonymous memory (heap, stacks, named
        anonymous regions), not the kernel's special mappings."""
        if self.perms[3] != "p" or self.path in _SPECIAL:
            return False
        return self.path in ("", "[heap]", "[stack]") or self.path.startswith("[anon:")


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


def parse_maps(text: str) -> list[Vma]:
    out = []
    for line in text.splitlines():
        m = _MAPS_LINE.match(line)
        if m:
            out.append(Vma(int(m[1], 16), int(m[2], 16), m[3], m[4].strip()))
    return out


@dataclass(frozen=True)
class Range:
    start: int
    end: int
    same_prot: bool  # the module needs S and D to have the same protections

    @property
    def length(self) -> int:
        return self.end - self.start


def plan(src: list[Vma], dst: list[Vma]) -> tuple[list[Range], list[tuple[int, int]]]:
    """Ranges to serve: D's private anonymous memory cut at every VMA boundary of S and D (the
    module works on one mapping of each side at a time), and the parts of D that S does not map
    as private anonymous memory (an error: the holder must mirror the clone)."""
    src_anon = sorted((v for v in src if v.private_anon), key=lambda v: v.start)
    ranges, missing = [], []
    for d in (v for v in dst if v.private_anon):
        pos = d.start
        for s in src_anon:
            if s.end <= pos or s.start >= d.end:
                continue
            if s.start > pos:
                missing.append((pos, s.start))
            end = min(s.end, d.end)
            ranges.append(Range(max(pos, s.start), end, s.perms == d.perms))
            pos = end
            if pos >= d.end:
                break
        if pos < d.end:
            missing.append((pos, d.end))
    return ranges, missing


# processes ---------------------------------------------------------------------------------
def _ns_pid(host_pid: int) -> int | None:
    """A process's pid inside its innermost pid namespace (None for a thread or a dead one)."""
    try:
        for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _pid_ns(host_pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{host_pid}/ns/pid")
    except OSError:
        return None


def tree_by_ns_pid(root_pid: int, candidates: list[int]) -> dict[int, int]:
    """{pid inside the workspace: host pid} of the candidates in ``root_pid``'s pid namespace."""
    ns = _pid_ns(root_pid)
    out = {}
    for pid in candidates:
        if _pid_ns(pid) == ns:
            inner = _ns_pid(pid)
            if inner is not None:
                out[inner] = pid
    return out


def _maps(pid: int) -> list[Vma]:
    return parse_maps(Path(f"/proc/{pid}/maps").read_text())


#: what :func:`share_tree` did (a kmod clone's record keeps it: ``rec.kmod``)
ShareStats = records.KmodShareStats


def share_tree(holder_pids: dict[int, int], clone_pids: dict[int, int], use: Sharer) -> ShareStats:
    """Serve every clone process's private anonymous memory from its holder twin."""
    t0 = time.perf_counter()
    stats = ShareStats(mechanism=use.name)
    fallback = MemCopySharer()
    for inner, dst in sorted(clone_pids.items()):
        dst_maps = _maps(dst)
        if not dst_maps:  # a zombie restored as such
            continue
        src = holder_pids.get(inner)
        if src is None:
            raise RuntimeError(f"no holder process for pid {inner} of the clone (holder pids: {sorted(holder_pids)})")
        ranges, missing = plan(_maps(src), dst_maps)
        if missing:
            spans = ", ".join(f"{a:#x}-{b:#x}" for a, b in missing[:4])
            raise RuntimeError(f"pid {inner}: the holder does not map {spans} as private anonymous memory")
        stats.processes += 1
        for r in ranges:
            stats.ranges += 1
            why = None if r.same_prot else "protections"
            if why is None:
                try:
                    served = use.share(src, dst, r.start, r.length)
                except OSError as e:
                    if e.errno not in (errno.EBUSY, errno.EOPNOTSUPP):
                        raise
                    why = errno.errorcode[e.errno]
            if why is not None:  # copied, so the clone stays exact
                stats.pages_copied += fallback.share(src, dst, r.start, r.length)
                stats.fallback_ranges += 1
                stats.fallback_reasons[why] = stats.fallback_reasons.get(why, 0) + 1
                continue
            if isinstance(use, MemCopySharer):
                stats.pages_copied += served
            else:
                stats.pages_shared += served
    stats.ms = round((time.perf_counter() - t0) * 1000, 1)
    return stats


# holders -----------------------------------------------------------------------------------
def is_holder(rec: records.Record) -> bool:
    return bool(rec.holder_of)


def holders_of(snap_id: str, recs: list[records.Record] | None = None, p: Paths | None = None) -> list[records.Record]:
    """The records of a snapshot's holders (among ``recs``, default all records)."""
    return [r for r in (records.all_records(p) if recs is None else recs) if r.holder_of == snap_id]


@contextlib.contextmanager
def _holder_lock(snap_path: Path):
    with open(snap_path / ".holder.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def holder_for(snap, p: Paths | None = None) -> records.Record:
    """The snapshot's holder, restored (in copy mode) on first use. It never runs: its memory
    must stay exactly the snapshot's, since clones get it together with the snapshot's kernel
    state. Its tasks are stopped by the pre-resume script before their first instruction, then
    its cgroup is frozen."""
    p = p or paths()
    with _holder_lock(snap.path):
        for rec in holders_of(snap.id, p=p):
            if rec.running():
                return rec
        [holder] = snap.fork(1, mode="copy", detached=True, _holder=True)
        holder.freeze()
        return holder._rec


def close_holders(snap_id: str, reclaim: Callable[[records.Record, Paths], None], p: Paths | None = None, *,
                  unless_used: bool = False) -> list[str]:
    """Reclaim the holders of a snapshot with ``reclaim`` (``teardown.reclaim``) on its
    deletion; with ``unless_used``, only when no kmod clone of it is left: a holder costs a
    full copy of the snapshot's memory."""
    p = p or paths()
    recs = records.all_records(p)
    if unless_used and any(r.snapshot == snap_id and not is_holder(r) and r.memory_mode == "kmod" for r in recs):
        return []
    closed = []
    for rec in holders_of(snap_id, recs):
        reclaim(rec, p)
        closed.append(rec.id)
    return closed


def involved(rec: records.Record) -> bool:
    """A kmod clone or a holder: restored with the action script, which leaves a report."""
    return rec.memory_mode == "kmod" or is_holder(rec)


def report_path(rec: records.Record, p: Paths) -> Path:
    return p.run / "logs" / f"{rec.id}-kmod.json"


def restore_setup(rec: records.Record, holder: records.Record | None, p: Paths) -> tuple[dict[str, str], list[str]]:
    """Environment and extra arguments of ``criu restore`` for a kmod clone (served from
    ``holder``) or a holder (stopped before it runs); nothing for other workspaces."""
    if not involved(rec):
        return {}, []
    env = {"BUNSHIN_KMOD_REPORT": str(report_path(rec, p))}
    if is_holder(rec):
        env["BUNSHIN_KMOD_STOP"] = "1"
    else:
        env.update(CRIU_SKIP_ANON_PAGES="1", BUNSHIN_KMOD_HOLDER=f"{holder.pid1}:{holder.cgroup}")
    return env, ["--action-script", str(action_script(p))]


def action_script(p: Paths | None = None) -> Path:
    """The executable CRIU runs at every restore stage; it acts on ``pre-resume`` only."""
    p = p or paths()
    path = p.run / "kmod-action.sh"
    text = ('#!/bin/sh\n# bunshin kmod mode: share anonymous memory from the holder before the clone runs\n'
            '[ "$CRTOOLS_SCRIPT_ACTION" = pre-resume ] || exit 0\n'
            f'exec {sys.executable} -c "from bunshin_gym.workspace.kmod import main; raise SystemExit(main())"\n')
    return buildonce.write_text(path, text, 0o755)


def read_report(report: Path) -> dict:
    """What the action script wrote (an ``error`` key when it failed); the file is removed."""
    try:
        data = json.loads(report.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"error": f"the kmod pre-resume script left no report at {report}"}
    report.unlink(missing_ok=True)
    return data


def main() -> int:
    """CRIU pre-resume action: serve the restored clone's anonymous memory from the holder."""
    report = Path(config.get("BUNSHIN_KMOD_REPORT"))
    root = int(os.environ["CRTOOLS_INIT_PID"])
    tree = _tree_pids(root)
    if config.get("BUNSHIN_KMOD_STOP") == "1":  # a holder
        _stop(tree)
        report.write_text(json.dumps({"stopped": len(tree)}))
        return 0
    try:
        holder_pid1, holder_cgroup = config.get("BUNSHIN_KMOD_HOLDER").split(":", 1)
        holder = tree_by_ns_pid(int(holder_pid1), Cgroup(holder_cgroup).pids())
        stats = share_tree(holder, tree_by_ns_pid(root, tree), sharer())
        report.write_text(json.dumps(asdict(stats)))
        return 0
    except Exception as e:
        # The clone must never run with empty memory. Its tasks are stopped under CRIU's ptrace:
        # a pending SIGSTOP stops each one before its first user instruction once CRIU detaches
        # (killing them here would leave CRIU waiting for them); the fork then kills the clone.
        _stop(tree)
        report.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1


def _stop(pids: list[int]) -> None:
    """Stop tasks held by CRIU's ptrace: the pending SIGSTOP takes effect when CRIU detaches,
    before the task's first user instruction."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)


def _tree_pids(root: int) -> list[int]:
    """Host pids of ``root`` and its descendants (children files of every thread)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            with contextlib.suppress(FileNotFoundError):
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return out

