"""BunshinFork: snapshots of live workspaces, forks and rollbacks.

A snapshot is an immutable directory in the pool's snapshot store (bind-mounted read-only
at ``/.snap`` in every workspace, so page images are reachable from inside clones)::

    snapshots/<id>/meta.json   parent, image, runtime layer, memory mode, timings, tags
    snapshots/<id>/criu/       CRIU images of the whole process tree (dumped --leave-running)
    snapshots/<id>/fs          read-only btrfs snapshot of the workspace's upper layer

``meta.json`` is written last: a snapshot without it is incomplete and reported as corrupt.
The files of a child are a btrfs delta of its parent's; in the ``share`` modes its page
image references its parent's page files for every page the clone did not write.

Example:
    >>> ws = Workspace.create("base")
    >>> snap = ws.snapshot()                 # source frozen only while dumping
    >>> a, b = snap.fork(2)                  # two live clones, fresh namespaces each
    >>> a.exec("touch /root/a"); ws.rollback(snap)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from bunshin_gym import config
from bunshin_gym.config import Limits, Paths, criu_env, paths
from bunshin_gym.workspace import dumping, hostlimits, idmap, memory, pool, records
from bunshin_gym.workspace.cgroups import Cgroup, unified
from bunshin_gym.workspace.errors import ForkError, SnapshotError, WorkspaceError
from bunshin_gym.workspace.snapshots import delta, flatten, integrity, views

if TYPE_CHECKING:
    from bunshin_gym.workspace.workspace import Workspace

log = logging.getLogger(__name__)

#: the default depth past which snapshot chains are flattened: a snapshot whose images would
#: reference more ancestors' page files (``ref_depth``) takes those files over (see
#: :mod:`bunshin_gym.workspace.snapshots.flatten`). BUNSHIN_MAX_SNAPSHOT_DEPTH, read at use, overrides it.
MAX_DEPTH = config.max_snapshot_depth()

#: ``--skip-in-flight``: a TCP connection still in a listening socket's accept queue cannot be
#: dumped ("In-flight connection"); it is dropped instead (its client sees a reset). Chromium's
#: speculative preconnects to a workspace's web server hit this often.
DUMP_FLAGS = [
    "--leave-running", "--tcp-established", "--skip-in-flight", "--file-locks",
    "--ghost-limit", "256M", "--irmap-scan-path", "/usr/share/zoneinfo",
    "--external", "mnt[/.snap]:snap", "--manage-cgroups=ignore",
]

#: device nodes of a user-namespaced workspace: bind mounts of the host's own nodes (mknod of a
#: device is refused in a user namespace), external to CRIU (bunshin-init.c's ``devs``)
HOST_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _device_mounts(dump: bool) -> list[str]:
    if dump:
        return [a for d in HOST_DEVICES for a in ("--external", f"mnt[/dev/{d}]:dev-{d}")]
    return [a for d in HOST_DEVICES for a in ("--external", f"mnt[dev-{d}]:/dev/{d}")]


class Snapshot:
    """A frozen, immutable state of a workspace that clones can be forked from."""

    def __init__(self, path: Path, meta: dict, p: Paths | None = None):
        self.path = path
        self.meta = meta
        self._p = p or paths()

    id = property(lambda self: self.meta["id"])
    parent = property(lambda self: self.meta.get("parent"))
    image = property(lambda self: self.meta["image"])
    depth = property(lambda self: self.meta.get("depth", 0))
    tags = property(lambda self: self.meta.get("tags", {}))
    mode = property(lambda self: memory.MemoryMode(self.meta["memory_mode"]))
    criu_dir = property(lambda self: self.path / "criu")
    fs = property(lambda self: self.path / "fs")

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.meta.get('workspace')} parent={self.parent}>"

    def fork(self, n: int = 1, *, mode: str | memory.MemoryMode | None = None,
             detached: bool = False, _holder: bool = False) -> list[Workspace]:
        """Restore ``n`` live clones concurrently, each in fresh namespaces and its own cgroup.

        Args:
            n: number of clones.
            mode: memory mode of the clones (default: the snapshot's).
            detached: keep the clones after this process exits (CLI use).
            _holder: restore the snapshot's kmod holder (stopped before it runs; see kmod.py).
        """
        from bunshin_gym.workspace.workspace import Workspace

        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        mode = memory.MemoryMode.parse(mode or self.mode)
        backend = memory.backend(mode)
        backend.check_available(self._p)  # before anything is made
        hostlimits.prepare_host()
        verify(self)  # a damaged image is refused before anything is made
        me = os.getpid()
        recs = []
        for _ in range(n):
            ws_id = f"ws-{secrets.token_hex(4)}"
            recs.append(records.Record(
                id=ws_id, image=self.image, image_path=self.meta["image_path"], layer=self.meta["layer"],
                subvolume=str(self._p.workspaces / ws_id), cgroup=ws_id, memory_mode=mode.value,
                snapshot=self.id, userns_base=self.meta.get("userns_base"), owner=None if detached else me,
                owner_start=None if detached else records.proc_start_time(me), created=time.time(),
                **records.made_by_me(),  # gc reclaims a half-restored clone once we are gone
                # clones keep the snapshot's limits (older snapshots: the defaults)
                limits=Limits.parse(self.meta.get("limits") or Limits.from_env()),
                holder_of=self.id if _holder else None,
            ))
        clones = [Workspace(rec, self._p) for rec in recs]
        try:
            if backend.one_by_one or n == 1:
                for rec in recs:
                    records.save(rec, self._p)
                    Cgroup.create(rec.cgroup, Limits.parse(rec.limits))
                helper = backend.helper(self, self._p)  # once the clones' records keep it from `bunshin gc`
                view = views.view_for(self)  # once for all clones: what they may see at /.snap
                _lay_files(self, recs)
                procs = [_start_restore(self, rec, self._p, helper, view) for rec in recs]
            else:
                procs = _start_clones(self, recs, backend)
            failed = []  # wait for every restore, so none is left unreaped and unreported
            for rec, proc in zip(recs, procs, strict=True):
                try:
                    _finish_restore(rec, proc, self._p)
                except ForkError as e:
                    failed.append(e)
            if failed:
                more = "".join(f"; also: {e}" for e in failed[1:])
                raise ForkError(f"{failed[0]}{more}") from failed[0]
            for ws in clones:
                if not _holder:
                    ws._connect()
        except BaseException:
            for ws in clones:
                ws.close()
            raise
        return clones

    # usage and deletion --------------------------------------------------------------
    def users(self) -> dict[str, list[str]]:
        """Live workspaces restored from this snapshot, and child snapshots that need it."""
        wait_replaced(self.id)  # a rollback's replaced processes are killed: let them go first
        running = [r for r in records.all_records(self._p) if r.running()]
        snaps = SnapshotStore(self._p).list()
        clones = [r.id for r in running if r.snapshot == self.id and not r.holder_of]  # a holder serves, not uses
        clones += flatten.stale_clones(self.id, self._p, snaps, running)
        children = [s.id for s in snaps if flatten.needs(s, self.id)]
        return {"clones": clones, "children": children}

    def flatten(self) -> dict:
        """Make this snapshot need no other snapshot: take over the ancestors' page files its
        images name and rewrite the images (:mod:`bunshin_gym.workspace.snapshots.flatten`)."""
        return flatten.flatten_snapshot(self)

    def size(self) -> int:
        """Bytes of this snapshot's own CRIU images (the files are a btrfs delta)."""
        return sum(f.stat().st_size for f in self.criu_dir.iterdir() if f.is_file())

    def delete(self) -> None:
        """Delete the snapshot; refused while a clone or a child snapshot uses it."""
        users = self.users()
        if users["clones"] or users["children"]:
            raise SnapshotError(f"snapshot {self.id} is in use by clones {users['clones']} and child "
                                f"snapshots {users['children']}; close or delete those first")
        _remove_dir(self.path, self._p)
        views.remove(self.id, self._p)
        for needed in {self.parent, *self.meta.get("refs", [])} - {None}:
            release_snapshot(needed, self._p)  # an ephemeral ancestor this one kept alive goes now

    def release(self) -> None:
        """Delete the snapshot now if nothing uses it, else as soon as nothing does (it becomes
        ephemeral: the last user's close, or ``bunshin gc``, deletes it)."""
        try:
            self.delete()
        except SnapshotError:
            self.meta["ephemeral"] = True
            _write_meta(self.path, self.meta)
            release_snapshot(self.id, self._p)  # in case the last user went meanwhile


class SnapshotStore:
    """The snapshots on this host."""

    def __init__(self, p: Paths | None = None):
        self.p = p or paths()

    def get(self, snap_id: str) -> Snapshot:
        path = self.p.snapshots / snap_id
        if not path.is_dir():
            raise SnapshotError(f"no snapshot {snap_id!r} in {self.p.snapshots}")
        try:
            meta = json.loads((path / "meta.json").read_text())
        except FileNotFoundError:
            raise SnapshotError(f"snapshot {snap_id} is corrupt or incomplete: no meta.json") from None
        except json.JSONDecodeError as e:
            raise SnapshotError(f"snapshot {snap_id} is corrupt: meta.json: {e}") from None
        for part in ("criu/inventory.img", "criu/pstree.img", "fs/upper"):
            if not (path / part).exists():
                raise SnapshotError(f"snapshot {snap_id} is corrupt: {part} is missing")
        return Snapshot(path, meta, self.p)

    def list(self) -> list[Snapshot]:
        out = []
        for d in sorted(self.p.snapshots.iterdir()) if self.p.snapshots.exists() else []:
            if (d / "meta.json").exists():
                try:
                    out.append(Snapshot(d, json.loads((d / "meta.json").read_text()), self.p))
                except (json.JSONDecodeError, FileNotFoundError):  # deleted while we list
                    continue
        return out


def verify(snap: Snapshot) -> None:
    """Refuse (:class:`SnapshotError`, naming the snapshot and the image) a snapshot whose
    images, or those of a snapshot its images need (parent chain, referenced page files), are
    missing, truncated or altered. Cheap after the first call per process (integrity.py)."""
    seen: set[str] = set()
    todo = [snap]
    while todo:
        s = todo.pop()
        if s.id in seen:
            continue
        seen.add(s.id)
        integrity.verify_dir(s.id, s.criu_dir, s.meta.get("checksums"))
        for need in sorted({s.parent, *s.meta.get("refs", [])} - {None}):
            if flatten.needs(s, need):
                try:
                    todo.append(SnapshotStore(s._p).get(need))
                except SnapshotError as e:
                    raise SnapshotError(f"snapshot {snap.id} needs snapshot {need}, which is unusable: {e}") from e


def reseal(snap: Snapshot) -> None:
    """Record the checksums of a snapshot's images again, after rewriting them on purpose
    (flattening, :func:`delta.materialize`); a snapshot without sums stays without."""
    if "checksums" not in snap.meta:
        return
    snap.meta["checksums"] = integrity.checksums(snap.criu_dir)
    on_disk = json.loads((snap.path / "meta.json").read_text())
    on_disk["checksums"] = snap.meta["checksums"]
    _write_meta(snap.path, on_disk)


# taking a snapshot ---------------------------------------------------------------------
def take(ws: Workspace, *, tags: dict | None = None, ephemeral: bool = False) -> Snapshot:
    """Snapshot a live workspace: freeze, snapshot the upper layer, dump, thaw.

    The source keeps running unchanged; on any failure (the freeze included) it is thawed and
    the partial snapshot removed, and the error names the CRIU log (kept under
    ``$BUNSHIN_RUN/logs``). A dump that fails only because a task could not be seized (a task
    frozen in uninterruptible sleep) is tried again, up to ``BUNSHIN_DUMP_TRIES`` times.
    """
    p = ws._p
    rec = ws._rec
    parent = SnapshotStore(p).get(rec.snapshot) if rec.snapshot else None
    snap_id = f"snap-{secrets.token_hex(4)}"
    path = p.snapshots / snap_id
    path.mkdir(parents=True)
    times: dict[str, float] = {}
    try:
        # until meta.json is written the directory is marked in progress, locked by us and by
        # CRIU: `bunshin gc` never sweeps it while either runs, and thaws the source after both
        with dumping.in_progress(path, ws.id) as lock_fd:
            _make_images_dir(path / "criu")
            # a share clone's pages it never wrote stay in the parent's images (delta.dump_delta)
            delta_args, delta_env = delta.dump_delta(rec, parent.id if parent else None, p)
            dump_env = dict(os.environ, **criu_env(p), **memory.registry.dump_env(p), **delta_env)
            ws._quiesce_agent()
            tries = dump_tries()
            for attempt in range(1, tries + 1):
                proc = _freeze_and_dump(ws, path, times, dump_env, delta_args, lock_fd)
                if proc.returncode == 0:
                    break
                log_path = _keep_log(p, path / "criu" / "dump.log", f"{snap_id}-dump.log")
                if attempt < tries and _seize_failed(log_path):
                    log.warning("snapshot %s of %s: CRIU could not seize a task (%s), try %d of %d; log: %s",
                                snap_id, ws.id, _last_error(log_path), attempt, tries, log_path)
                    _clear_attempt(path)
                    continue
                raise ForkError(f"CRIU dump of workspace {ws.id} failed ({_exit_text(proc.returncode)}): "
                                f"{_last_error(log_path)}; log: {log_path}")
            times["dump_tries"] = attempt
            meta = {
                "id": snap_id, "parent": parent.id if parent else None, "workspace": ws.id,
                "image": rec.image, "image_path": rec.image_path, "layer": rec.layer,
                "memory_mode": rec.memory_mode, "depth": parent.depth + 1 if parent else 0,
                "userns_base": rec.userns_base,  # the id map its processes and files have
                "limits": rec.limits.as_dict() if rec.limits else None,  # inherited by every clone
                "ref_depth": _ref_depth(rec, parent),
                "created": time.time(), "ephemeral": ephemeral, "tags": tags or {}, "timings": times,
            }
            flatten.on_take(path, meta, p)  # past the depth limit: take the ancestors' page files over
            snap = Snapshot(path, meta, p)
            meta["criu_bytes"] = snap.size()
            t = time.perf_counter()
            meta["checksums"] = integrity.checksums(path / "criu")  # after flatten: the final images
            times["checksum_ms"] = _ms(t)
            _write_meta(path, meta)
            dumping.done(path)
    except BaseException:
        _remove_dir(path, p)
        raise
    return snap


def dump_tries() -> int:
    """How often a dump that failed to seize a task is tried (``BUNSHIN_DUMP_TRIES``, default 4)."""
    return config.dump_tries()


def _make_images_dir(criu_dir: Path) -> None:
    """Make the directory CRIU writes the images to (a test puts a small filesystem here)."""
    criu_dir.mkdir()


def _freeze_and_dump(ws: Workspace, path: Path, times: dict[str, float], env: dict, delta_args: list[str],
                     lock_fd: int) -> subprocess.CompletedProcess:
    """Freeze the workspace, snapshot its files and dump it; it is thawed whatever happens
    (a freeze that times out or fails included)."""
    p, rec, cg = ws._p, ws._rec, ws.cgroup
    t0 = time.perf_counter()
    proc = lock = None
    try:
        times["refreezes"] = _freeze_seizable(cg, ws.id)
        dumping.fault_in_parasite_pages(cg.pids())  # ptrace can't fault in a dropped uffd page there
        times["freeze_ms"] = _ms(t0)
        t = time.perf_counter()
        pool.snapshot_subvolume(Path(rec.subvolume), path / "fs", readonly=True)
        times["files_ms"] = _ms(t)
        t = time.perf_counter()
        freezer = cg.dirs[0] if unified() else cg.dirs[1]
        dump_env = env
        lock = network_lock(rec.pid1)  # read frozen: no connection comes or goes meanwhile
        proc = subprocess.run(
            [str(p.criu), "dump", "-t", str(rec.pid1), "-D", str(path / "criu"), *DUMP_FLAGS, *delta_args,
             *(_device_mounts(dump=True) if rec.userns_base is not None else []),
             "--network-lock", lock,
             "--freeze-cgroup", str(freezer), "-o", "dump.log", f"-v{dump_verbosity()}"],
            capture_output=True, text=True, env=dump_env,
            pass_fds=(lock_fd,),  # CRIU holds the in-progress lock too: outliving us, it still counts
        )
        times["dump_ms"] = _ms(t)
    finally:
        if lock == "nftables" and (proc is None or proc.returncode != 0):  # a killed CRIU leaves its lock
            dumping.remove_network_locks(rec.pid1)
        t = time.perf_counter()
        cg.thaw()
        times["thaw_ms"] = _ms(t)
        times["frozen_ms"] = _ms(t0)
    return proc


#: how often the freeze is redone when a task is frozen where CRIU cannot stop it
_REFREEZES = 100


def _freeze_seizable(cg: Cgroup, ws_id: str) -> int:
    """Freeze, and if a task is frozen where CRIU's seize cannot stop it (a vfork parent
    waiting for its child, state D; see :mod:`bunshin_gym.workspace.dumping`), thaw for a
    moment so the child can exec and freeze again. Returns how often it froze again."""
    for i in range(_REFREEZES):
        cg.freeze()
        stuck = dumping.unseizable(cg.pids())
        if not stuck:
            return i
        log.debug("%s: frozen with unseizable tasks %s; thawing a moment (try %d)", ws_id, stuck, i + 1)
        cg.thaw()
        time.sleep(min(0.001 * (i + 1), 0.02))
    log.warning("%s: tasks %s stay unseizable after %d freezes; dumping anyway", ws_id, stuck, _REFREEZES)
    return _REFREEZES


#: CRIU log lines of a dump that failed to seize a task: another freeze and dump can succeed
_SEIZE_ERRORS = ("Unseizable non-zombie", "Timeout reached", "task not stopped after seize",
                 "found while seizing", "Unable to freeze cgroup", "Task pid reused while suspending",
                 # the parasite's page dropped again after it was read in (CRIU thaws to seize)
                 "POKEDATA failed: Input/output error")


def _seize_failed(log_path: Path) -> bool:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return False
    return any(e in text for e in _SEIZE_ERRORS)


def _clear_attempt(path: Path) -> None:
    """Remove what a failed dump attempt wrote (images, the files snapshot) for the next one."""
    if (path / "fs").exists():
        pool.delete_subvolume(path / "fs")
    for f in (path / "criu").iterdir():
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        else:
            f.unlink()


def _ref_depth(rec: records.Record, parent: Snapshot | None) -> int:
    """How many ancestors' page files a new snapshot of this workspace may reference: a clone
    restored with pages mapped from its snapshot keeps those mappings when dumped again, so
    its snapshots need their ancestors (kept alive by the parent chain) until flattened past
    MAX_DEPTH."""
    if parent is None or not memory.for_record(rec).maps_images:
        return 0
    return parent.meta.get("ref_depth", 0) + 1


# restoring -----------------------------------------------------------------------------
def _lay_files(snap: Snapshot, recs: list[records.Record]) -> None:
    """Each clone's file system: a btrfs snapshot of the snapshot's, with the disk quota.

    All at once, from threads: a subvolume snapshot waits for a transaction commit, and
    concurrent ones join the same commit (16 in a row took 0.7-2.2 s on a busy host, each
    commit also carrying the writes of restores already running)."""
    def lay(rec: records.Record) -> None:
        sub = Path(rec.subvolume)
        pool.snapshot_subvolume(snap.fs, sub)
        pool.limit_subvolume(sub, Limits.parse(rec.limits).disk)  # charged for what it writes

    if len(recs) == 1:
        lay(recs[0])
        return
    with ThreadPoolExecutor(max_workers=min(16, len(recs)), thread_name_prefix="bunshin-lay") as ex:
        for future in [ex.submit(lay, rec) for rec in recs]:
            future.result()  # the first failure is raised once all are done: none left running


def _start_clones(snap: Snapshot, recs: list[records.Record],
                  backend: memory.MemoryBackend) -> list[subprocess.Popen]:
    """Record, cgroup, files and ``criu restore`` of each clone, the clones side by side in
    threads (not clones of a backend that restores them one by one, after its helper).

    Done one clone after the other, this was most of a fan-out's wall time: each clone's
    record write, subvolume snapshot (a transaction commit) and uffd monitor start waits on
    something, ~0.1 s a clone on a busy host, while the restores already started had the
    CPUs. Work for all clones (the /.snap view, the tmpfs image copy) is done first, once.
    If a clone fails to start, the restores that did start are stopped and reaped, and the
    first error is raised (the caller reclaims every clone)."""
    p = snap._p
    view = views.view_for(snap)  # once for all clones: what they may see at /.snap
    backend.prepare(snap, p)  # e.g. share's tmpfs copy of the images, made once

    def start(rec: records.Record) -> subprocess.Popen:
        records.save(rec, p)
        Cgroup.create(rec.cgroup, Limits.parse(rec.limits))
        _lay_files(snap, [rec])
        return _start_restore(snap, rec, p, None, view)

    with ThreadPoolExecutor(max_workers=min(8, len(recs)), thread_name_prefix="bunshin-clone") as ex:
        futures = [ex.submit(start, rec) for rec in recs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().kill()
                _outputs(f.result())
        raise errors[0]
    return [f.result() for f in futures]


def _start_restore(snap: Snapshot, rec: records.Record, p: Paths, helper: records.Record | None = None,
                   view: Path | None = None) -> subprocess.Popen:
    """Start ``criu restore`` of a clone whose files are laid (:func:`_lay_files`); returns
    at once. ``view`` is the snapshot's /.snap view (made here when the caller has none);
    ``helper`` what the clone's memory backend made for the fork (the kmod holder)."""
    sub = Path(rec.subvolume)
    logs = p.run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    layer = rec.layer
    plan = memory.for_record(rec).restore(snap, rec, p, helper)
    env = dict(os.environ, **criu_env(p), **plan.env)
    lower = idmap.lower_image(rec.image_path, rec.userns_base)
    cmd = [
        f"{layer}/.bunshin/init", "restore", str(sub / "root"), f"{layer}:{lower}",
        str(sub / "upper"), str(sub / "work"), "1" if plan.ksm else "0",
        *Cgroup(rec.cgroup).procs_files, "--",
        # -W: CRIU writes its stats-restore file into the work dir, not into the immutable snapshot
        str(p.criu), "restore", "-D", str(plan.images), "-W", str(logs), "--restore-detached",
        "--root", str(sub / "root"),
        "--pidfile", str(logs / f"{rec.id}.pid"), "--tcp-established", "--file-locks",
        "--external", f"mnt[snap]:{view or views.view_for(snap)}", "--manage-cgroups=ignore",
        *(_device_mounts(dump=False) if rec.userns_base is not None else []),
        "-o", str(logs / f"{rec.id}-restore.log"), "-v4", *plan.args,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_restore(rec: records.Record, proc: subprocess.Popen, p: Paths) -> None:
    out, err = _outputs(proc)
    logs = p.run / "logs"
    log = logs / f"{rec.id}-restore.log"
    memory.for_record(rec).restored(rec, proc.returncode == 0, p, log)  # may refuse the clone
    if proc.returncode != 0:
        raise ForkError(f"CRIU restore of {rec.id} from snapshot {rec.snapshot} failed "
                        f"({_exit_text(proc.returncode)}): {_last_error(log) or err.strip()}; log: {log}")
    pidfile = logs / f"{rec.id}.pid"
    rec.pid1 = int(pidfile.read_text())
    rec.pid1_start = records.proc_start_time(rec.pid1)
    pidfile.unlink()
    log.unlink(missing_ok=True)
    records.save(rec, p)


def _outputs(proc: subprocess.Popen, grace: float = 2.0) -> tuple[str, str]:
    """What the restore printed, once it exited. Not "until its pipes close": when CRIU is
    killed mid-restore, the tasks it had forked (half-restored, reclaimed with the clone's
    cgroup) still hold the pipes, and waiting for their end would hang the fork forever."""
    while True:
        try:
            return proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            if proc.poll() is not None:
                break
    try:
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        log.warning("restore (pid %d) exited %s; other processes keep its output open", proc.pid, proc.returncode)
        return "", "(the restore exited; half-restored tasks kept its output open)"


def restore_in_place(ws: Workspace, snap: Snapshot, ready_timeout: float = 30.0) -> None:
    """Rollback: replace a workspace's processes and files with a snapshot's, same handle and id.

    Nothing of the workspace is touched until the snapshot has been restored and its agent
    answers: the snapshot is verified, restored beside the workspace (a subvolume and cgroup
    of its own, under a temporary record), and only then swapped in; the old processes and
    files are reclaimed after. A rollback that fails (a deleted or corrupt snapshot, a full
    disk, CRIU) leaves the workspace running as it was.
    """
    from bunshin_gym.workspace.client import AgentClient
    from bunshin_gym.workspace.workspace import reclaim

    rec, p = ws._rec, ws._p
    if snap.meta["image_path"] != rec.image_path:
        raise SnapshotError(f"snapshot {snap.id} is of image {snap.image}, workspace {ws.id} runs {rec.image}")
    verify(snap)
    helper = memory.backend(rec.memory_mode).helper(snap, p)  # before anything is made
    me = os.getpid()
    new_id = f"ws-{secrets.token_hex(4)}"
    new = records.Record(
        id=new_id, image=rec.image, image_path=rec.image_path, layer=snap.meta["layer"],
        subvolume=str(p.workspaces / new_id), cgroup=new_id, memory_mode=rec.memory_mode, snapshot=snap.id,
        userns_base=snap.meta.get("userns_base"), owner=me, owner_start=records.proc_start_time(me),
        created=time.time(), **records.made_by_me(), limits=rec.limits,
    )
    try:
        records.save(new, p)
        Cgroup.create(new.cgroup, Limits.parse(new.limits))
        _lay_files(snap, [new])
        _finish_restore(new, _start_restore(snap, new, p, helper), p)
        AgentClient(new.pid1, ws.id).wait_ready(ready_timeout)  # the client is dropped: nothing to close
    except BaseException:
        reclaim(new, p)
        raise
    _swap_in(ws, new)


#: record fields that belong to the running processes and files (swapped by a rollback),
#: their uffd monitor and kmod sharing included
_RUN_FIELDS = ("pid1", "pid1_start", "subvolume", "cgroup", "layer", "snapshot", "userns_base", "uffd", "kmod")


def _swap_in(ws: Workspace, new: records.Record) -> None:
    """Make the workspace's record name ``new``'s processes and files, and ``new``'s record the
    old ones (then reclaimed). The temporary record is rewritten first: whatever instant a
    crash comes, every process, subvolume and cgroup is named by some record or swept by gc."""
    rec, p = ws._rec, ws._p
    old = dataclasses.replace(new, **{f: getattr(rec, f) for f in _RUN_FIELDS})
    ws.disconnect()
    records.save(old, p)
    for f in _RUN_FIELDS:
        setattr(rec, f, getattr(new, f))
    records.save(rec, p)
    ws._cgroup = Cgroup(rec.cgroup)
    memory.for_record(rec).adopted(rec)  # e.g. ksmd's user: the restore registered the temporary id
    if old.pid1 is not None and old.running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.pid1, signal.SIGKILL)  # at once: the replaced processes run no further
    ws._reclaim_later(old)  # the wait for them to go and the file system's deletion


#: reclaims of what rollbacks replaced (processes killed, not yet gone), off the caller's
#: path on one thread (they touch the store's bookkeeping: releases, image copies); pending
#: work is finished at interpreter exit (concurrent.futures joins the thread)
_RECLAIM_THREAD = "bunshin-reclaim"
_reclaimer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_RECLAIM_THREAD)
_replaced_lock = threading.Lock()
#: (the snapshot the replaced processes ran from, their reclaim): Snapshot.users() waits for
#: those of its snapshot, so that a snapshot a rollback left is deletable at once
_replaced: list[tuple[str | None, Future]] = []


def reclaim_later(rec: records.Record, p: Paths) -> Future:
    """Reclaim a rollback's replaced workspace state on the reclaim thread."""
    future = _reclaimer.submit(_reclaim_replaced, rec, p)
    with _replaced_lock:
        _replaced[:] = [(s, f) for s, f in _replaced if not f.done()]
        _replaced.append((rec.snapshot, future))
    return future


def wait_replaced(snap_id: str) -> None:
    """Wait for the pending reclaims of replaced states that ran from ``snap_id`` (not on the
    reclaim thread itself: a reclaim releases its snapshot, and would wait for itself)."""
    if threading.current_thread().name.startswith(_RECLAIM_THREAD):
        return
    with _replaced_lock:
        pending = [f for s, f in _replaced if s == snap_id]
    for future in pending:
        future.result()


def _reclaim_replaced(rec: records.Record, p: Paths) -> None:
    from bunshin_gym.workspace.workspace import reclaim

    try:
        reclaim(rec, p)
    except Exception:  # noqa: BLE001 - its record stays: `bunshin gc` retries
        log.exception("reclaiming %s (replaced by a rollback) failed; `bunshin gc` will retry", rec.id)


def stop_processes(rec: records.Record, timeout: float = 10.0, p: Paths | None = None) -> None:
    """Kill every process of a workspace and wait until its cgroup is empty; then its memory
    backend stops what served them (a uffd monitor)."""
    from bunshin_gym.workspace.workspace import _wait_gone

    cg = Cgroup(rec.cgroup)
    running = rec.running()
    if running:
        try:
            os.kill(rec.pid1, signal.SIGKILL)  # PID 1's death kills the whole pid namespace
        except ProcessLookupError:
            pass
    if cg.exists():
        try:  # a frozen task cannot die (cgroup v1): thaw, the pending SIGKILL then lands first
            cg.thaw(timeout=1)
        except (WorkspaceError, OSError):
            pass
    if running:
        _wait_gone(rec.pid1, timeout)
    deadline = time.monotonic() + timeout
    while cg.exists() and cg.pids():
        cg.kill_all()
        if time.monotonic() > deadline:
            raise ForkError(f"workspace {rec.id}: processes {cg.pids()} survive SIGKILL")
        time.sleep(0.001)
    memory.for_record(rec).on_stop(rec, p or paths())  # only once nothing it served runs


def release_snapshot(snap_id: str | None, p: Paths) -> None:
    """Delete an ephemeral snapshot (made by ``Workspace.fork``) once nothing uses it."""
    if not snap_id:
        return
    try:
        snap = SnapshotStore(p).get(snap_id)
    except SnapshotError:
        return
    if snap.meta.get("ephemeral") and not any(snap.users().values()):
        _remove_dir(snap.path, p)
        views.remove(snap.id, p)  # as delete() does: else every ws.fork left its view behind
        for needed in {snap.parent, *snap.meta.get("refs", [])} - {None}:
            release_snapshot(needed, p)


# helpers -------------------------------------------------------------------------------
#: /proc/net/tcp states a dump needs no network lock for: LISTEN, TIME_WAIT, CLOSE
_STILL_TCP_STATES = frozenset({"0A", "06", "07"})


def network_lock(pid1: int) -> str:
    """CRIU's network lock for dumping a frozen workspace: ``nftables`` if it has a TCP
    connection (its rules drop every packet while CRIU reads the connections' state), else
    ``skip``. Adding and removing those rules costs ~20 ms of frozen time, and without a
    connection they protect nothing: frozen processes cannot connect, and a connection an
    outside peer completes meanwhile is in flight, which ``--skip-in-flight`` leaves out.
    CRIU records the choice in the images, so a restore locks exactly when the dump did."""
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid1}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        if any(line.split()[3] not in _STILL_TCP_STATES for line in lines):
            return "nftables"
    return "skip"


def dump_verbosity() -> int:
    """CRIU's log level for dumps, ``BUNSHIN_CRIU_DUMP_VERBOSITY`` (default 3, info). The dump
    runs while the workspace is frozen: debug logging (4) costs about 30 ms of frozen time."""
    return config.criu_dump_verbosity()


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 2)


def _remove_dir(path: Path, p: Paths | None = None) -> None:
    """Delete a snapshot's directory, once every memory backend dropped what it keeps for it
    (kmod holders, share's tmpfs copy of the images)."""
    from bunshin_gym.workspace.workspace import reclaim

    memory.registry.snapshot_removed(path.name, p or paths(), reclaim)
    if (path / "fs").exists():
        pool.delete_subvolume(path / "fs")
    shutil.rmtree(path, ignore_errors=True)


def _write_meta(path: Path, meta: dict) -> None:
    """Write meta.json atomically: a failed write (a full disk) leaves the old one, or none."""
    tmp = path / "meta.json.tmp"
    try:
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path / "meta.json")
    finally:
        tmp.unlink(missing_ok=True)


def _keep_log(p: Paths, log: Path, name: str) -> Path:
    dst = p.run / "logs" / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if log.exists():
        shutil.copy(log, dst)
    else:
        dst.write_text("(CRIU wrote no log)\n")
    return dst


#: CRIU log errors that say nothing about the cause (a summary line, a harmless rlimit probe)
_GENERIC_ERRORS = ("Dumping FAILED", "Restoring FAILED", "RLIMIT_NOFILE", "failed with -1", "Dump files (pid",
                   "tables-restore", "tables-legacy-restore")


def _last_error(log: Path) -> str:
    """The most telling error line of a CRIU log: the first specific one (the cause; later
    errors are mostly the unwinding)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    errs = [ln for ln in lines if "Error" in ln]
    # CRIU's own errors first: tools it runs print theirs too, expected ones included
    # (`ip addr restore` in a fresh netns: "Error: ipv4: Address already assigned.")
    criu = [ln for ln in errs if "Error (criu/" in ln]
    specific = [ln for ln in criu or errs if not any(g in ln for g in _GENERIC_ERRORS)]
    pick = specific or errs or lines[-1:]
    return pick[0].strip()[:300] if pick else ""
