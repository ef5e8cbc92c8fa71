"""Forking: taking a snapshot of a live workspace, restoring clones from one, and a rollback's
restore beside a workspace and swap into it.

Everything here works on records (:mod:`.records`) and stored snapshots
(:mod:`.snapshots.stored`); the ``Workspace`` and ``Snapshot`` handles (``workspace.py``) call
it and wrap what it made. On failure it leaves nothing behind: a snapshot being taken is
removed, clones that did not come up are the caller's to reclaim (their records exist from the
start, so ``bunshin gc`` finds them after a crash).

Example (what ``ws.snapshot()`` and ``snap.fork(2)`` do):
    >>> stored = take(ws._rec, ws._p, quiesce=ws._quiesce_agent)   # source frozen only while dumping
    >>> recs = clone_records(stored, 2, MemoryMode.SHARE)
    >>> restore_clones(stored, recs, memory.backend("share"))        # two live clones
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bunshin_gym import config
from bunshin_gym.config import Limits, Paths, criu_env
from bunshin_gym.workspace import dumping, fanout, hostlimits, idmap, memory, pool, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.client import AgentClient
from bunshin_gym.workspace.errors import ForkError, SnapshotError
from bunshin_gym.workspace.snapshots import delta, flatten, integrity, lineage, store, views
from bunshin_gym.workspace.snapshots import meta as meta_file
from bunshin_gym.workspace.snapshots.meta import SnapshotMeta
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot
from bunshin_gym.workspace.teardown import reclaim, remove_snapshot_dir

log = logging.getLogger(__name__)

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


# taking a snapshot ---------------------------------------------------------------------
def take(rec: records.Record, p: Paths, *, quiesce: Callable[[], None], tags: dict | None = None,
         ephemeral: bool = False, held: bool = False) -> StoredSnapshot:
    """Snapshot a live workspace: freeze, snapshot the upper layer, dump, thaw. ``quiesce``
    drops the controller's connections into the workspace (CRIU cannot dump them) right before.

    The source keeps running unchanged; on any failure (the freeze included) it is thawed and
    the partial snapshot removed, and the error names the CRIU log (kept under
    ``$BUNSHIN_RUN/logs``). A dump that fails only because a task could not be seized (a task
    frozen in uninterruptible sleep) is tried again, up to ``BUNSHIN_DUMP_TRIES`` times.
    ``held``: this process releases the snapshot when done with it (``SnapshotMeta.holder``).
    """
    parent = store.Store(p).get(rec.snapshot) if rec.snapshot else None
    snap_id = f"snap-{secrets.token_hex(4)}"
    path = p.snapshots / snap_id
    path.mkdir(parents=True)
    times: dict[str, float] = {}
    try:
        # until meta.json is written the directory is marked in progress, locked by us and by
        # CRIU: `bunshin gc` never sweeps it while either runs, and thaws the source after both
        with dumping.in_progress(path, rec.id) as lock_fd:
            _make_images_dir(path / "criu")
            # a share clone's pages it never wrote stay in the parent's images (delta.dump_delta)
            delta_args, delta_env = delta.dump_delta(rec, parent.id if parent else None, p)
            dump_env = dict(os.environ, **criu_env(p), **memory.registry.dump_env(p), **delta_env)
            quiesce()
            tries = dump_tries()
            for attempt in range(1, tries + 1):
                proc = _freeze_and_dump(rec, p, path, times, dump_env, delta_args, lock_fd)
                if proc.returncode == 0:
                    break
                log_path = _keep_log(p, path / "criu" / "dump.log", f"{snap_id}-dump.log")
                if attempt < tries and _seize_failed(log_path):
                    log.warning("snapshot %s of %s: CRIU failed where another try can succeed (%s), try %d of %d; "
                                "log: %s",
                                snap_id, rec.id, _last_error(log_path), attempt, tries, log_path)
                    _clear_attempt(path)
                    if f"{_DEAD_PARASITE}: thread" in log_path.read_text(errors="replace"):
                        time.sleep(_DEAD_PARASITE_WAIT)
                    continue
                raise ForkError(f"CRIU dump of workspace {rec.id} failed ({_exit_text(proc.returncode)}): "
                                f"{_last_error(log_path)}; log: {log_path}")
            times["dump_tries"] = attempt
            meta = SnapshotMeta.new(
                id=snap_id, parent=parent.id if parent else None, workspace=rec.id,
                image=rec.image, image_path=rec.image_path, layer=rec.layer,
                memory_mode=rec.memory_mode, depth=parent.depth + 1 if parent else 0,
                userns_base=rec.userns_base,  # the id map its processes and files have
                limits=rec.limits.as_dict() if rec.limits else None,  # inherited by every clone
                ref_depth=lineage.ref_depth(rec, parent),
                created=time.time(), ephemeral=ephemeral, tags=tags or {}, timings=times,
            )
            if held:
                me = os.getpid()
                meta.holder = [me, records.proc_start_time(me)]
            flatten.on_take(path, meta, p)  # past the depth limit: take the ancestors' page files over
            snap = StoredSnapshot(path, meta, p)
            meta.criu_bytes = snap.size()
            t = time.perf_counter()
            meta.checksums = integrity.checksums(path / "criu")  # after flatten: the final images
            times["checksum_ms"] = _ms(t)
            meta_file.write(path, meta)
            dumping.done(path)
    except BaseException:
        remove_snapshot_dir(path, p)
        raise
    return snap


def dump_tries() -> int:
    """How often a dump that failed to seize a task is tried (``BUNSHIN_DUMP_TRIES``, default 4)."""
    return config.dump_tries()


def _make_images_dir(criu_dir: Path) -> None:
    """Make the directory CRIU writes the images to (a test puts a small filesystem here)."""
    criu_dir.mkdir()


def _freeze_and_dump(rec: records.Record, p: Paths, path: Path, times: dict[str, float], env: dict,
                     delta_args: list[str], lock_fd: int) -> subprocess.CompletedProcess:
    """Freeze the workspace, snapshot its files and dump it; it is thawed whatever happens
    (a freeze that times out or fails included). With a CRIU that has the dump gate, CRIU is
    started first and does its start-up while the workspace still runs."""
    cg = Cgroup(rec.cgroup)
    background = config.background_dump() and dumping.background_available(p)
    if dumping.gate_available(p):
        return _freeze_and_dump_gated(rec, p, path, times, env, delta_args, lock_fd, cg, background)
    t0 = time.perf_counter()
    proc = lock = thawed = None
    try:
        lock = _freeze_and_snapshot_files(rec, cg, path, times, t0)
        t = time.perf_counter()
        # at the workspace's niceness, not its maker's: the workspace is frozen until CRIU has what it needs
        cmd = config.at_workspace_nice(dump_command(rec, p, path / "criu", cg.freezer_dir(), lock, delta_args))
        if background:  # thawed once CRIU has the metadata; pages after
            proc, thawed = dumping.run_in_background(cmd, env, (lock_fd,))
        else:
            # CRIU holds the in-progress lock too: outliving us, it still counts
            proc = dumping.run_dump(cmd, env, (lock_fd,))
        times["dump_ms"] = _ms(t)
    finally:
        _after_dump(rec, cg, proc, lock, t0, thawed, times)
    return proc


def _freeze_and_dump_gated(rec: records.Record, p: Paths, path: Path, times: dict[str, float], env: dict,
                           delta_args: list[str], lock_fd: int, cg: Cgroup,
                           background: bool) -> subprocess.CompletedProcess:
    """:func:`_freeze_and_dump` with CRIU started before the freeze (criu/patches/0029): its
    start-up runs while the workspace does, then it waits at its gate for the network lock
    chosen frozen."""
    # at the workspace's niceness, not its maker's; the lock method comes through the gate;
    # CRIU holds the in-progress lock too: outliving us, it still counts
    cmd = config.at_workspace_nice(dump_command(rec, p, path / "criu", cg.freezer_dir(), None, delta_args))
    t = time.perf_counter()
    gate = dumping.GatedDump(cmd, env, (lock_fd,), background=background)
    if not gate.ready():  # it failed starting up: the workspace was never frozen
        return gate.finish()[0]
    t0 = time.perf_counter()
    times["start_ms"] = _ms(t)  # CRIU's start-up, before the freeze
    proc = lock = thawed = None
    try:
        lock = _freeze_and_snapshot_files(rec, cg, path, times, t0)
        t = time.perf_counter()
        gate.go(lock)
        proc, thawed = gate.finish()
        times["dump_ms"] = _ms(t)
    finally:
        if proc is None:  # failed before the go: CRIU stops at the gate, having touched nothing
            gate.finish()
        _after_dump(rec, cg, proc, lock, t0, thawed, times)
    return proc


def _freeze_and_snapshot_files(rec: records.Record, cg: Cgroup, path: Path, times: dict[str, float],
                               t0: float) -> str:
    """The frozen steps before CRIU's own: freeze where CRIU can seize every task, fault in the
    pages its parasite pokes, snapshot the files; returns the network lock method to dump with,
    read frozen (no connection comes or goes meanwhile)."""
    times["refreezes"] = _freeze_seizable(cg, rec.id)
    dumping.fault_in_parasite_pages(cg.pids())  # ptrace can't fault in a dropped uffd page there
    times["freeze_ms"] = _ms(t0)
    t = time.perf_counter()
    pool.snapshot_subvolume(Path(rec.subvolume), path / "fs", readonly=True)
    times["files_ms"] = _ms(t)
    return network_lock(rec.pid1)


def _after_dump(rec: records.Record, cg: Cgroup, proc: subprocess.CompletedProcess | None, lock: str | None,
                t0: float, thawed: float | None, times: dict[str, float]) -> None:
    """Thaw the workspace after a dump, removing a network lock a failed CRIU left."""
    if lock == "nftables" and (proc is None or proc.returncode != 0):  # a killed CRIU leaves its lock
        dumping.remove_network_locks(rec.pid1)
    t = time.perf_counter()
    cg.thaw()
    times["thaw_ms"] = _ms(t)
    times["frozen_ms"] = _ms(t0)
    if thawed is not None:  # the source ran while its pages were written: frozen only until then
        times["frozen_ms"] = round((thawed - t0) * 1000, 3)
        times["background_ms"] = _ms(thawed)


def dump_command(rec: records.Record, p: Paths, images: Path, freezer: Path, lock: str | None,
                 delta_args: list[str] | None = None) -> list[str]:
    """``criu dump`` of a workspace frozen through ``freezer`` into ``images``; ``lock``: the
    network lock method (None: given at the dump gate, :class:`dumping.GatedDump`)."""
    return [str(p.criu), "dump", "-t", str(rec.pid1), "-D", str(images), *DUMP_FLAGS, *(delta_args or []),
            *(_device_mounts(dump=True) if rec.userns_base is not None else []),
            *(["--network-lock", lock] if lock else []),
            "--freeze-cgroup", str(freezer), "-o", "dump.log", f"-v{dump_verbosity()}"]


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


#: CRIU's log line where a killed CRIU's parasite area was in a task (criu/patches/0035)
_DEAD_PARASITE = "killed CRIU's parasite area"
#: how long a thread still leaving such an area may take (its wait there is 1 s)
_DEAD_PARASITE_WAIT = 0.4

#: CRIU log lines of a dump that failed to seize a task: another freeze and dump can succeed
_SEIZE_ERRORS = ("Unseizable non-zombie", "Timeout reached", "task not stopped after seize",
                 "found while seizing", "Unable to freeze cgroup", "Task pid reused while suspending",
                 # the parasite's page dropped again after it was read in (CRIU thaws to seize)
                 "POKEDATA failed: Input/output error",
                 # a CRIU killed mid-dump left its parasite's area in a task: this CRIU unmapped
                 # it, or waits for a thread to leave it (criu/patches/0035)
                 _DEAD_PARASITE)


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


# restoring -----------------------------------------------------------------------------
def clone_records(snap: StoredSnapshot, n: int, mode: memory.MemoryMode, *, detached: bool = False,
                  holder: bool = False) -> list[records.Record]:
    """The records of ``n`` clones of ``snap`` about to be restored (nothing saved yet)."""
    me = os.getpid()
    recs = []
    for _ in range(n):
        ws_id = f"ws-{secrets.token_hex(4)}"
        recs.append(records.Record(
            id=ws_id, image=snap.image, image_path=snap.metadata.image_path, layer=snap.metadata.layer,
            subvolume=str(snap._p.workspaces / ws_id), cgroup=ws_id, memory_mode=mode.value,
            snapshot=snap.id, userns_base=snap.metadata.userns_base, owner=None if detached else me,
            owner_start=None if detached else records.proc_start_time(me), created=time.time(),
            **records.made_by_me(),  # gc reclaims a half-restored clone once we are gone
            # clones keep the snapshot's limits (older snapshots: the defaults)
            limits=Limits.parse(snap.metadata.limits or Limits.from_env()),
            holder_of=snap.id if holder else None,
        ))
    return recs


def check_fork(snap: StoredSnapshot, backend: memory.MemoryBackend) -> None:
    """What a fork checks before anything is made: the mode is usable here, the host is
    prepared, and the snapshot's images (and those it needs) are intact."""
    backend.check_available(snap._p)
    hostlimits.prepare_host()
    verify(snap)


def restore_clones(snap: StoredSnapshot, recs: list[records.Record], backend: memory.MemoryBackend) -> None:
    """Record, cgroup, files and ``criu restore`` of each clone, then wait for every restore.
    Raises the first :class:`ForkError` (naming the others) once all are done; the caller
    reclaims every clone then. How: :func:`fanout.current` (``fanout.BEFORE``: as before it)."""
    options = fanout.current()
    if options.overlap_prepare and not backend.one_by_one:
        _fan_out(snap, recs, backend, options)
        return
    p = snap._p
    if backend.one_by_one or len(recs) == 1:
        for rec in recs:
            with fanout.phase("setup", rec.id):
                records.save(rec, p)
                Cgroup.create(rec.cgroup, Limits.parse(rec.limits))
        helper = backend.helper(snap, p)  # once the clones' records keep it from `bunshin gc`
        with fanout.phase("view"):
            view = views.view_for(snap)  # once for all clones: what they may see at /.snap
        with fanout.phase("files"):
            _lay_files(snap, recs)
        procs = []
        for rec in recs:
            with fanout.phase("start", rec.id):
                procs.append(_start_restore(snap, rec, p, helper, view, verbosity=options.restore_verbosity))
    else:
        procs = _start_clones(snap, recs, backend, options)
    failed = []  # wait for every restore, so none is left unreaped and unreported
    for rec, proc in zip(recs, procs, strict=True):
        try:
            with fanout.phase("criu", rec.id):
                _finish_restore(rec, proc, p)
        except ForkError as e:
            failed.append(e)
    _raise_first(failed)


def _raise_first(failed: list[BaseException]) -> None:
    if failed:
        more = "".join(f"; also: {e}" for e in failed[1:])
        raise ForkError(f"{failed[0]}{more}") from failed[0]


def _fan_out(snap: StoredSnapshot, recs: list[records.Record], backend: memory.MemoryBackend,
             options: fanout.FanoutOptions) -> None:
    """The clones of a fork, each in a thread of its own from its record to the end of its
    restore; what is done once for all of them (the /.snap view, e.g. share's tmpfs copy of
    the images) runs beside their set-ups, and at most ``options.restore_limit`` restores run
    at a time.

    Measured on a 16-clone desktop fan-out (2 CPUs): the restores are CPU-bound, and the once
    work (~0.3 s) had kept both CPUs waiting before any set-up began. If a clone fails, the
    restores not yet started are not started; those running are waited for; the first error
    is raised once every thread is done (the caller reclaims every clone)."""
    p = snap._p
    failed = threading.Event()

    def view() -> Path:
        with fanout.phase("view"):
            return views.view_for(snap)  # what the clones may see at /.snap

    def prepare() -> None:
        with fanout.phase("prepare"):
            backend.prepare(snap, p)

    slots = threading.BoundedSemaphore(options.restore_limit(len(recs)))
    setups = threading.BoundedSemaphore(max(1, options.setups_at_once))

    def clone(rec: records.Record, viewed: Future, prepared: Future) -> None:
        try:
            with setups:
                with fanout.phase("setup", rec.id):
                    records.save(rec, p)
                    Cgroup.create(rec.cgroup, Limits.parse(rec.limits))
                with fanout.phase("files", rec.id):
                    _lay_files(snap, [rec])
                prepared.result()
                with fanout.phase("backend", rec.id):  # e.g. share's uffd monitor
                    plan = memory.for_record(rec).restore(snap, rec, p, None)
            with fanout.phase("queue", rec.id):  # the wait for a restore slot only
                slots.acquire()
            try:
                if failed.is_set():
                    raise _NotStarted(f"{rec.id}: not restored, another clone of the fork failed")
                with fanout.phase("criu", rec.id):
                    proc = _start_restore(snap, rec, p, None, viewed.result(), plan=plan,
                                          verbosity=options.restore_verbosity)
                    _finish_restore(rec, proc, p)
            finally:
                slots.release()
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max_workers=len(recs) + 2, thread_name_prefix="bunshin-clone") as ex:
        viewed, prepared = ex.submit(view), ex.submit(prepare)
        futures = [ex.submit(clone, rec, viewed, prepared) for rec in recs]
    errors = list({id(e): e for f in [viewed, prepared, *futures] if (e := f.exception()) is not None}.values())
    real = [e for e in errors if not isinstance(e, _NotStarted)]
    if real and not all(isinstance(e, ForkError) for e in real):
        raise next(e for e in real if not isinstance(e, ForkError))  # e.g. KeyboardInterrupt, OSError
    _raise_first(real or errors)


class _NotStarted(ForkError):
    """A clone whose restore was not started because another clone of its fork had failed."""


def verify(snap: StoredSnapshot) -> None:
    """Refuse a snapshot whose images, or those it needs, are damaged (:meth:`store.Store.verify`)."""
    store.Store(snap._p).verify(snap)


def _lay_files(snap: StoredSnapshot, recs: list[records.Record]) -> None:
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


def _start_clones(snap: StoredSnapshot, recs: list[records.Record], backend: memory.MemoryBackend,
                  options: fanout.FanoutOptions) -> list[subprocess.Popen]:
    """Record, cgroup, files and ``criu restore`` of each clone, the clones side by side in
    threads (not clones of a backend that restores them one by one, after its helper).

    Done one clone after the other, this was most of a fan-out's wall time: each clone's
    record write, subvolume snapshot (a transaction commit) and uffd monitor start waits on
    something, ~0.1 s a clone on a busy host, while the restores already started had the
    CPUs. Work for all clones (the /.snap view, the tmpfs image copy) is done first, once.
    If a clone fails to start, the restores that did start are stopped and reaped, and the
    first error is raised (the caller reclaims every clone)."""
    p = snap._p
    with fanout.phase("view"):
        view = views.view_for(snap)  # once for all clones: what they may see at /.snap
    with fanout.phase("prepare"):
        backend.prepare(snap, p)  # e.g. share's tmpfs copy of the images, made once

    def start(rec: records.Record) -> subprocess.Popen:
        with fanout.phase("setup", rec.id):
            records.save(rec, p)
            Cgroup.create(rec.cgroup, Limits.parse(rec.limits))
        with fanout.phase("files", rec.id):
            _lay_files(snap, [rec])
        with fanout.phase("start", rec.id):
            return _start_restore(snap, rec, p, None, view, verbosity=options.restore_verbosity)

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


def _start_restore(snap: StoredSnapshot, rec: records.Record, p: Paths, helper: records.Record | None = None,
                   view: Path | None = None, *, plan: memory.RestorePlan | None = None,
                   verbosity: int | None = None) -> subprocess.Popen:
    """Start ``criu restore`` of a clone whose files are laid (:func:`_lay_files`); returns
    at once. ``view`` is the snapshot's /.snap view (made here when the caller has none);
    ``helper`` what the clone's memory backend made for the fork (the kmod holder); ``plan``
    the backend's restore plan when the caller asked for it already; ``verbosity`` CRIU's log
    level (default: :func:`fanout.current`'s)."""
    sub = Path(rec.subvolume)
    logs = p.run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    layer = rec.layer
    plan = plan or memory.for_record(rec).restore(snap, rec, p, helper)
    verbosity = fanout.current().restore_verbosity if verbosity is None else verbosity
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
        "-o", str(logs / f"{rec.id}-restore.log"), f"-v{verbosity}", *plan.args,
    ]
    # CRIU gives the restored tasks their images' niceness; its own work runs at the workspaces' too
    return subprocess.Popen(config.at_workspace_nice(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


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


def restore_beside(rec: records.Record, snap: StoredSnapshot, p: Paths, ready_timeout: float = 30.0
                   ) -> tuple[records.Record, AgentClient]:
    """A rollback's restore: ``snap`` restored beside the workspace of ``rec`` (a subvolume and
    cgroup of its own, under a temporary record) until its agent answers; returns that record
    and the connection it answered on, for the workspace that takes the restore to keep: the
    agent serves each connection on a thread of its own, which takes a pid in the workspace,
    so a second connection would make the next pid its programs see one higher than a fork
    of the same snapshot gives them (tests/workspace/test_pid_namespace.py).
    Nothing of the workspace is touched: a rollback that fails here (a deleted or corrupt
    snapshot, a full disk, CRIU) leaves it running as it was, and the temporary one reclaimed.
    """
    if snap.metadata.image_path != rec.image_path:
        raise SnapshotError(f"snapshot {snap.id} is of image {snap.image}, workspace {rec.id} runs {rec.image}")
    verify(snap)
    helper = memory.backend(rec.memory_mode).helper(snap, p)  # before anything is made
    me = os.getpid()
    new_id = f"ws-{secrets.token_hex(4)}"
    new = records.Record(
        id=new_id, image=rec.image, image_path=rec.image_path, layer=snap.metadata.layer,
        subvolume=str(p.workspaces / new_id), cgroup=new_id, memory_mode=rec.memory_mode, snapshot=snap.id,
        userns_base=snap.metadata.userns_base, owner=me, owner_start=records.proc_start_time(me),
        created=time.time(), **records.made_by_me(), limits=rec.limits,
    )
    try:
        records.save(new, p)
        Cgroup.create(new.cgroup, Limits.parse(new.limits))
        _lay_files(snap, [new])
        _finish_restore(new, _start_restore(snap, new, p, helper), p)
        client = AgentClient(new.pid1, rec.id)
        client.wait_ready(ready_timeout)
    except BaseException:
        reclaim(new, p)
        raise
    return new, client


#: record fields that belong to the running processes and files (swapped by a rollback),
#: their uffd monitor and kmod sharing included
_RUN_FIELDS = ("pid1", "pid1_start", "subvolume", "cgroup", "layer", "snapshot", "userns_base", "uffd", "kmod")


def swap_in(rec: records.Record, new: records.Record, p: Paths) -> records.Record:
    """Make ``rec`` name ``new``'s processes and files, and return a record of the old ones (to
    be reclaimed; their PID 1 is killed here, so they run no further). The temporary record is
    rewritten first: whatever instant a crash comes, every process, subvolume and cgroup is
    named by some record or swept by gc. The caller has dropped its connections."""
    old = dataclasses.replace(new, **{f: getattr(rec, f) for f in _RUN_FIELDS})
    records.save(old, p)
    for f in _RUN_FIELDS:
        setattr(rec, f, getattr(new, f))
    records.save(rec, p)
    memory.for_record(rec).adopted(rec)  # e.g. ksmd's user: the restore registered the temporary id
    if old.pid1 is not None and old.running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.pid1, signal.SIGKILL)  # at once: the replaced processes run no further
    return old


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
        except (FileNotFoundError, ProcessLookupError):  # no such table; ESRCH: the process is exiting
            continue
        if any(line.split()[3] not in _STILL_TCP_STATES for line in lines):
            return "nftables"
    return "skip"


def dump_verbosity() -> int:
    """CRIU's log level for dumps, ``BUNSHIN_CRIU_DUMP_VERBOSITY`` (default 2: errors and
    warnings, CRIU's own default). The dump runs while the workspace is frozen, and CRIU formats
    and writes each line then: info lines (3) cost a desktop ~17,000 lines and ~80 ms of frozen
    time (312 -> 230 ms, a 300 MB heap 63 -> 56 ms, alternated on one host), debug lines (4) more."""
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
