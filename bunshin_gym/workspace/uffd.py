"""Anonymous memory shared copy-on-write across clones, with exact semantics, through userfaultfd.

This is what serves a clone's anonymous memory in the ``share`` memory mode when the kernel
has userfaultfd minor faults on shmem (else ``share`` falls back to KSM, see
:func:`bunshin_gym.workspace.memory.share_anon_mechanism`; the ``share`` backend,
:mod:`bunshin_gym.workspace.memory.share`, drives it):

- the snapshot's CRIU images are copied once onto a dedicated tmpfs (:func:`images_root`),
  the page images sparse and larger than their data; ``criu restore -D`` reads that copy;
- CRIU (``criu/patches/0003-uffd-share-anon.patch``) maps every private anonymous range
  ``MAP_PRIVATE`` from it, so all clones share the page cache and writes copy, and hands each
  restored process's userfaultfd to the clone's monitor;
- the monitor (``native/uffd-monitor.c``, one per clone, a worker and a guard) registers
  those ranges, maps every page up front (``UFFDIO_CONTINUE``) and keeps a per-page discard
  bitmap so that dropped memory reads back as zeros, through fork, mremap and munmap;
- if the monitor dies, its guard (or :func:`check`) stops the clone and leaves a report
  (:func:`failure`): a clone is never left reading stale image data.

Re-dumping a clone (``CRIU_UFFD_IMAGES``, :func:`dump_env`) records these mappings as the
anonymous memory they stand for. Workspaces reject ``MADV_FREE`` (seccomp filter of the
workspace's PID 1), which would otherwise make the monitor zero live data.

Write tracking (memory modes ``copy`` and ``ksm``): the same monitor started with ``--wp``
(:func:`start` with ``track_writes=True``) gets every restored task's userfaultfd through the
same CRIU hand-off (``CRIU_UFFD_WP_SOCK``, criu/patches/0018-*), maps nothing, and registers the
task's private anonymous memory for asynchronous write-protect: a snapshot of the clone then
records the pages never written since the restore as "in parent" (:mod:`.snapshots.delta`).
Such a monitor dying costs nothing but the tracking (the kernel drops it with the
userfaultfds; later snapshots are full dumps), so it is no health failure (:func:`failure`).

Measure with :func:`cpu_seconds` (monitor CPU) and :func:`stats` (counters of one clone).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from functools import cache
from pathlib import Path

from bunshin_gym.config import Paths, at_workspace_nice, criu_carries, paths, share_anon_forced_ksm, write_tracking
from bunshin_gym.workspace import buildonce, idmap, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.errors import ForkError, SetupError

HERE = Path(__file__).parent
SOURCE = HERE / "native" / "uffd-monitor.c"
CFLAGS = ["-O2", "-Wall"]
#: sparse room past the data of every page image: a mapping grown in place (mremap) stays
#: inside the file (a fault past its end would be SIGBUS; inside, the monitor gives zeros)
IMAGE_HEADROOM = 64 << 30
#: the criu binary knows the mechanism if it contains this string (criu/patches/0003-*)
CRIU_MARKER = b"CRIU_UFFD_SOCK"
#: ... and write tracking of copy restores if it contains this one (criu/patches/0018-*)
CRIU_WP_MARKER = b"CRIU_UFFD_WP_SOCK"
#: a write-tracking monitor's socket ends so (what tells it from a share clone's monitor)
WP_SOCK_SUFFIX = ".wp.sock"


# build and availability ------------------------------------------------------------------
def monitor_binary(p: Paths | None = None) -> Path:
    """The monitor binary, compiled from ``native/uffd-monitor.c`` once per source version."""
    p = p or paths()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out = p.home / "uffd" / key / "bunshin-uffd-monitor"
    if out.exists():
        return out
    if shutil.which("gcc") is None:
        raise SetupError("gcc is missing (needed to build the uffd monitor); run: scripts/setup.sh")

    def compile_to(target: Path) -> None:
        proc = subprocess.run(["gcc", *CFLAGS, "-o", str(target), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SetupError(f"compiling {SOURCE} failed:\n{proc.stderr}")

    return buildonce.build_once(out, compile_to)


@cache
def _kernel_probe(binary: str, flag: str = "--probe") -> tuple[bool, str]:
    proc = subprocess.run([binary, flag], capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def write_tracking_unavailable_reason(p: Paths | None = None) -> str | None:
    """Why copy and ksm clones cannot be write-tracked on this host (None when they can):
    ``BUNSHIN_WRITE_TRACKING=0``, no asynchronous write-protect in the kernel, or a CRIU
    without criu/patches/0018-*."""
    p = p or paths()
    if not write_tracking():
        return "BUNSHIN_WRITE_TRACKING=0"
    try:
        binary = monitor_binary(p)
    except (SetupError, OSError) as e:
        return str(e)
    ok, msg = _kernel_probe(str(binary), "--probe-wp")
    if not ok:
        return msg
    if not criu_carries(CRIU_WP_MARKER, p):
        return f"{p.criu} lacks criu/patches/0018-wp-async-deltas.patch; run: criu/build.sh"
    return None


def tracks_writes(rec: records.Record) -> bool:
    """Whether the clone's monitor is a write tracker (copy and ksm modes), not a share monitor."""
    return rec.uffd is not None and rec.uffd.sock.endswith(WP_SOCK_SUFFIX)


def unavailable_reason(p: Paths | None = None) -> str | None:
    """Why the mechanism cannot be used on this host (None when it can)."""
    p = p or paths()
    if share_anon_forced_ksm():
        return "BUNSHIN_SHARE_ANON=ksm"
    try:
        binary = monitor_binary(p)
    except (SetupError, OSError) as e:
        return str(e)
    ok, msg = _kernel_probe(str(binary))
    if not ok:
        return msg
    if not p.criu.exists():
        return f"CRIU is not built ({p.criu}); run: criu/build.sh"
    if not criu_carries(CRIU_MARKER, p):
        return f"{p.criu} lacks criu/patches/0003-uffd-share-anon.patch; run: criu/build.sh"
    return None


def available(p: Paths | None = None) -> bool:
    return unavailable_reason(p) is None


# page images on tmpfs --------------------------------------------------------------------
def images_root(p: Paths | None = None) -> Path:
    """The tmpfs holding clones' page images (mounted on first use; no huge pages).

    Mounted once, under a file lock beside it (each use opens the file, so it excludes threads
    as well as processes): two first uses that both saw no mount stacked two tmpfs, and a copy
    under way in the first (:func:`prepare_images`) lost its directory when the second covered
    it (a cluster host's first share forks, two at once, failed so in CI)."""
    p = p or paths()
    root = p.run / "uffd-images"
    if not os.path.ismount(root):
        root.mkdir(parents=True, exist_ok=True)
        with open(p.run / ".uffd-images.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if not os.path.ismount(root):
                proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,huge=never,nr_inodes=0",
                                       "bunshin-uffd", str(root)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SetupError(f"mounting a tmpfs on {root} failed: {proc.stderr.strip()}")
    idmap.let_restores_traverse(root)
    return root


def has_image_copy(snap_id: str, p: Paths | None = None) -> bool:
    """Whether a complete tmpfs copy of the snapshot's images exists (share clones map it)."""
    return ((p or paths()).run / "uffd-images" / snap_id / ".complete").exists()


@contextlib.contextmanager
def _images_lock(p: Paths):
    root = images_root(p)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield root


def prepare_images(snap_id: str, criu_dir: Path, p: Paths | None = None) -> Path:
    """The tmpfs copy of a snapshot's CRIU images (made once; ``criu restore -D`` reads it).

    A snapshot dumped as a delta (:func:`delta.dump_delta`: pages "in parent") links its copy to its
    parent's copy (``parent``, made first), as CRIU links the snapshots: CRIU maps the pages in
    parent from the parent's copy (criu/patches/0014-*), so clones of parent and child share them."""
    p = p or paths()
    with _images_lock(p) as root:
        return _prepare(root, snap_id, criu_dir)


def _prepare(root: Path, snap_id: str, criu_dir: Path) -> Path:
    d = root / snap_id
    if _intact(d):
        return d
    link = criu_dir / "parent"
    parent = None
    if link.is_symlink() or link.exists():
        target = link.resolve()
        if not (target / "inventory.img").exists():
            raise ForkError(f"snapshot {snap_id}: its parent images {target} are missing")
        parent = _prepare(root, target.parent.name, target).name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    for f in criu_dir.iterdir():
        if f.is_file() and f.suffix == ".img":
            shutil.copyfile(f, d / f.name)
            if f.name.startswith("pages-"):
                os.truncate(d / f.name, f.stat().st_size + IMAGE_HEADROOM)
    if parent:
        (d / "parent").symlink_to(f"../{parent}")
    (d / ".complete").touch()
    return d


def _intact(d: Path) -> bool:
    """A complete copy whose parent copies are all there (one made before its parent's copy
    was dropped is made again; clones running from the old one keep their pages)."""
    while (d / ".complete").exists():
        link = d / "parent"
        if not link.is_symlink():
            return True
        d = (d / os.readlink(link)).resolve()
    return False


def with_ancestors(root: Path, names: set[str]) -> set[str]:
    """Snapshot copies and the copies they link to as their parents."""
    out, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        link = root / n / "parent"
        if link.is_symlink():
            todo.append(Path(os.readlink(link)).name)
    return out


def _uffd_users(p: Paths) -> set[str]:
    """Snapshots whose images a running uffd clone (or one being restored) maps, and the
    ancestors their copies link to (their pages are mapped too)."""
    users = set()
    for r in records.all_records(p):
        if r.uffd is not None and not tracks_writes(r) and r.snapshot and (r.pid1 is None or r.running()):
            users.add(r.snapshot)
    return with_ancestors(p.run / "uffd-images", users)


#: a copy holding this file is kept while the process it names lives, mapped or not (the prefix
#: cache's hot snapshots: their restores skip the copy); ``release_images(force=True)`` drops it
KEEP_MARK = ".kept"


def keep_images(snap_id: str, keep: bool = True, p: Paths | None = None) -> bool:
    """Keep a snapshot's complete tmpfs copy while this process lives (or stop keeping it);
    returns whether it is kept."""
    mark = (p or paths()).run / "uffd-images" / snap_id / KEEP_MARK
    if not keep:
        mark.unlink(missing_ok=True)
        return False
    me = os.getpid()
    if keeper(mark.parent) == me:
        return True
    with _images_lock(p or paths()):
        if not (mark.parent / ".complete").exists():
            return False
        mark.write_text(f"{me} {records.proc_start_time(me)}")
    return True


def keeper(copy: Path) -> int | None:
    """The live process that keeps this copy (:func:`keep_images`), if any."""
    try:
        pid, start = (copy / KEEP_MARK).read_text().split()
        return int(pid) if records.process_alive(int(pid), int(start)) else None
    except (OSError, ValueError):
        return None


def release_images(p: Paths | None = None, snap_id: str | None = None, *, force: bool = False) -> list[str]:
    """Drop tmpfs image copies no running clone maps (one snapshot's, or all); ``force``
    drops a deleted snapshot's copy outright. Pages still mapped stay until unmapped."""
    p = p or paths()
    root = p.run / "uffd-images"
    if not os.path.ismount(root):
        return []
    dropped = []
    with _images_lock(p):
        used = set() if force else _uffd_users(p)
        for d in sorted(root.iterdir()):
            if not d.is_dir() or (snap_id and d.name != snap_id) or d.name in used:
                continue
            if not force and keeper(d) is not None:
                continue
            if not force and time.time() - d.stat().st_mtime < 5 and not (d / ".complete").exists():
                continue  # being made
            shutil.rmtree(d, ignore_errors=True)
            dropped.append(d.name)
    return dropped


# the monitor -----------------------------------------------------------------------------
def _files(rec: records.Record, p: Paths, wp: bool | None = None) -> dict[str, Path]:
    # named after the record the monitor was started for: a rollback moves a monitor (with
    # its processes) from a temporary record to the workspace's, and the old one the other way
    stem = (rec.uffd.stem if rec.uffd is not None else None) or rec.id
    wp = tracks_writes(rec) if wp is None else wp
    d = p.run / "uffd"
    return {"sock": d / (stem + (WP_SOCK_SUFFIX if wp else ".sock")), "state": d / f"{stem}.json",
            "report": d / f"{stem}.report", "log": d / f"{stem}.log"}


def start(rec: records.Record, p: Paths | None = None, *, track_writes: bool = False) -> records.UffdMonitor:
    """Start the monitor of one clone (before its restore); recorded in ``rec.uffd``. With
    ``track_writes`` it is a write tracker of a copy restore (``--wp``), else a share monitor."""
    p = p or paths()
    f = _files(rec, p, track_writes)
    f["sock"].parent.mkdir(parents=True, exist_ok=True)
    for k in ("sock", "state", "report"):
        f[k].unlink(missing_ok=True)
    # a tracker maps no images: it needs no tmpfs
    where = ["--wp", str(f["sock"])] if track_writes else [str(f["sock"]), str(images_root(p))]
    with open(f["log"], "ab") as log:
        proc = subprocess.Popen(  # it serves the clone's faults: at the clone's niceness, not its maker's
            at_workspace_nice([str(monitor_binary(p)), *where, str(f["state"]), str(f["report"]),
                               *(str(d) for d in Cgroup(rec.cgroup).dirs)]),
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    line = proc.stdout.readline().decode().split()
    proc.stdout.close()
    if len(line) != 3 or line[0] != "ready":
        proc.wait(timeout=5)
        raise ForkError(f"{rec.id}: the uffd monitor did not start (exit {proc.returncode}); log: {f['log']}")
    guard, worker = int(line[1]), int(line[2])
    info = records.UffdMonitor(guard=guard, guard_start=records.proc_start_time(guard), worker=worker,
                               worker_start=records.proc_start_time(worker), sock=str(f["sock"]), stem=rec.id)
    # the guard is our child only until we return: nobody waits for it later, so the host's
    # init (or subreaper) must reap it: detach it from this process's zombies
    _detach(proc)
    rec.uffd = info
    records.save(rec, p)
    return info


def _detach(proc: subprocess.Popen) -> None:
    """Forget a child without leaving a zombie: a thread waits for it."""
    import threading

    threading.Thread(target=proc.wait, daemon=True).start()


def restore_env(rec: records.Record) -> dict[str, str]:
    """Environment for ``criu restore`` of a clone served (or write-tracked) by its monitor."""
    return {"CRIU_UFFD_WP_SOCK" if tracks_writes(rec) else "CRIU_UFFD_SOCK": rec.uffd.sock}


def tracking_since(rec: records.Record, snap_id: str) -> bool:
    """Whether the clone's writes have been tracked since its restore from ``snap_id``: it was
    restored from that snapshot with a write tracker, which still runs (a dead one has dropped
    the tracking, and it cannot be taken up again)."""
    return tracks_writes(rec) and rec.snapshot == snap_id and monitor_alive(rec)


def dump_env(p: Paths | None = None) -> dict[str, str]:
    """Environment for ``criu dump``: mappings of the tmpfs images are anonymous memory."""
    root = (p or paths()).run / "uffd-images"
    return {"CRIU_UFFD_IMAGES": str(root)} if os.path.ismount(root) else {}


def monitor_alive(rec: records.Record) -> bool:
    u = rec.uffd
    return u is not None and records.process_alive(u.guard, u.guard_start) and \
        records.process_alive(u.worker, u.worker_start)


def stop(rec: records.Record, p: Paths | None = None, timeout: float = 5.0) -> None:
    """Stop a clone's monitor (after its processes are gone) and remove its files."""
    u = rec.uffd
    if u is None:
        return
    p = p or paths()
    for pid, start_t, sig in ((u.guard, u.guard_start, signal.SIGTERM), (u.worker, u.worker_start, signal.SIGKILL)):
        if sig is signal.SIGKILL:  # the guard stops its worker; only a straggler gets SIGKILL
            _wait_dead(pid, start_t, timeout)
        if records.process_alive(pid, start_t):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        _wait_dead(pid, start_t, timeout)
    for f in _files(rec, p).values():
        f.unlink(missing_ok=True)
    rec.uffd = None
    if records.load(rec.id, p) is not None:
        records.save(rec, p)


def _wait_dead(pid: int, start_t: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while records.process_alive(pid, start_t) and time.monotonic() < deadline:
        time.sleep(0.002)


# health ----------------------------------------------------------------------------------
def failure(rec: records.Record, p: Paths | None = None) -> str | None:
    """Why this clone's monitor is gone (its report), or None while it serves the clone. A
    write tracker never fails the clone: without it, the clone's snapshots are full dumps."""
    if rec.uffd is None or tracks_writes(rec):
        return None
    p = p or paths()
    rep = _files(rec, p)["report"]
    if rep.exists():
        try:
            r = json.loads(rep.read_text())
            return f"{rec.id}: {r['reason']}; the clone was stopped ({r['who']} of the uffd monitor)"
        except (OSError, ValueError, KeyError):
            return f"{rec.id}: the uffd monitor failed; report: {rep}"
    if rec.pid1 is not None and not monitor_alive(rec):
        return f"{rec.id}: the uffd monitor (pids {rec.uffd.guard}, {rec.uffd.worker}) is gone; " \
               "the clone was stopped"
    return None


def check(rec: records.Record, p: Paths | None = None) -> str | None:
    """Health check: a clone whose monitor is gone is stopped at once (it must not read stale
    data) and the reason returned; None when all is well."""
    why = failure(rec, p)
    if why and rec.running():
        cg = Cgroup(rec.cgroup)
        with contextlib.suppress(OSError):
            cg.freeze(timeout=1)
        cg.kill_all()
        with contextlib.suppress(OSError):
            cg.thaw(timeout=1)
        rep = _files(rec, p or paths())["report"]
        if not rep.exists():
            rep.write_text(json.dumps({"event": "monitor-died", "who": "controller", "reason": why,
                                       "time": time.time(), "action": "clone stopped"}) + "\n")
    return why


def check_all(p: Paths | None = None) -> dict[str, str]:
    """:func:`check` every uffd clone on this host; returns {workspace id: reason} of the failed."""
    p = p or paths()
    out = {}
    for rec in records.all_records(p):
        why = check(rec, p)
        if why:
            out[rec.id] = why
    return out


# measurements ----------------------------------------------------------------------------
def _cpu(pid: int, start_t: int | None) -> float:
    if not records.process_alive(pid, start_t):
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(ws_ids: list[str] | None = None, p: Paths | None = None) -> float:
    """CPU seconds (user + system) used so far by the monitors of running clones (of the given
    workspaces, or all). Sample before and after a phase and subtract."""
    p = p or paths()
    total = 0.0
    for rec in records.all_records(p):
        u = rec.uffd
        if u is not None and (ws_ids is None or rec.id in ws_ids):
            total += _cpu(u.guard, u.guard_start) + _cpu(u.worker, u.worker_start)
    return total


def stats(ws_id: str, p: Paths | None = None) -> dict:
    """Counters of one clone's monitor (faults, zero pages, events, processes, bitmap bytes,
    errors; rewritten every second)."""
    p = p or paths()
    rec = records.load(ws_id, p)
    if rec is None or rec.uffd is None:
        return {}
    try:
        return json.loads(_files(rec, p)["state"].read_text())
    except (OSError, ValueError):
        return {}


def _stems(recs: list[records.Record]) -> set[str]:
    """Names monitor files of live records may have: their ids, and the stems of monitors a
    rollback moved to them (see :func:`_files`)."""
    return {r.id for r in recs} | {r.uffd.stem for r in recs if r.uffd is not None and r.uffd.stem}


def leftovers(p: Paths | None = None) -> dict[str, list[str]]:
    """Monitor files and image copies no record accounts for (tests check this stays empty)."""
    p = p or paths()
    recs = records.all_records(p)
    ids = _stems(recs)
    d = p.run / "uffd"
    files = sorted(f.name for f in d.iterdir() if f.name.split(".")[0] not in ids
                   and not f.name.endswith(".log")) if d.exists() else []
    root = p.run / "uffd-images"
    used = with_ancestors(root, {r.snapshot for r in recs if r.uffd is not None and not tracks_writes(r)})
    imgs = sorted(x.name for x in root.iterdir() if x.is_dir() and x.name not in used) \
        if os.path.ismount(root) else []
    return {"files": files, "images": imgs}


def sweep(p: Paths | None = None) -> list[str]:
    """``bunshin gc``: remove monitor files of workspaces that no longer exist, and unused images."""
    p = p or paths()
    ids = _stems(records.all_records(p))
    d = p.run / "uffd"
    gone = []
    for f in sorted(d.iterdir()) if d.exists() else []:
        if f.name.split(".")[0] not in ids:
            f.unlink(missing_ok=True)
            gone.append(f.name)
    return gone + release_images(p)
