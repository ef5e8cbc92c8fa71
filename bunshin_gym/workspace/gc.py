"""Reclaim what crashed controllers left behind (``bunshin gc``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from bunshin_gym.config import Paths, cgroup_root, criu_env, paths
from bunshin_gym.workspace import cgroups, dumping, memory, pool, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.errors import SnapshotError, WorkspaceError
from bunshin_gym.workspace.images import build_lock
from bunshin_gym.workspace.snapshots import store, views
from bunshin_gym.workspace.teardown import reclaim, remove_snapshot_dir

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    workspaces: list[str] = field(default_factory=list)
    subvolumes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    partial_images: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    thawed: list[str] = field(default_factory=list)  # sources a dead controller's dump left frozen
    caches: list[str] = field(default_factory=list)

    def total(self) -> int:
        return sum(len(v) for v in vars(self).values())


def sweep_refusal(p: Paths) -> str | None:
    """Why sweeping what no record names would be unsafe here (None: it is safe).

    A sweep kills every cgroup under this process's cgroup root, and deletes every subvolume
    and snapshot of ``p``'s pool, that ``p``'s records do not name. The cgroup root is read
    once, at import (``cgroups.CGROOT``), with the run directory of that moment: a caller that
    changed ``BUNSHIN_RUN`` or ``BUNSHIN_CGROUP_ROOT`` since, or passes another run directory,
    would see every live workspace of the machine as left over, and kill it."""
    if p.run != cgroups.RUN_DIR:
        return f"the run directory {p.run} is not the one this process started with ({cgroups.RUN_DIR})"
    if cgroup_root() != cgroups.CGROOT:
        return (f"BUNSHIN_CGROUP_ROOT is {cgroup_root()} now, but this process's cgroups are under "
                f"{cgroups.CGROOT} (read at start)")
    return None


def collect(p: Paths | None = None, *, all_workspaces: bool = False) -> GcReport:
    """Reclaim workspaces whose controller died (or all, with ``all_workspaces``), then sweep
    subvolumes, cgroups and snapshots that no record names: only with the run directory and
    cgroup root this process started with (:func:`sweep_refusal`; run ``bunshin gc`` with the
    other environment instead)."""
    p = p or paths()
    rep = GcReport()
    for rec in records.all_records(p):  # a clone whose uffd monitor died is stopped (then reclaimed below)
        memory.for_record(rec).health(rec, p)
    for rec in records.all_records(p):
        if memory.for_record(rec).collected_later(rec) and not all_workspaces:
            continue  # a backend's helper (a kmod holder): after the clones it serves, below
        if all_workspaces or not rec.owner_alive() or (rec.pid1 is not None and not rec.running()) \
                or rec.abandoned():  # a half-restored clone (detached too) whose maker was killed
            reclaim(rec, p)
            rep.workspaces.append(rec.id)
    rep.workspaces += memory.registry.collect(p, reclaim)
    if (why := sweep_refusal(p)) is not None:
        log.warning("gc: reclaimed the workspaces of %s's records; not sweeping what no record names: %s",
                    p.run, why)
        return rep
    # a record is written before its subvolume and cgroup, so reading records after listing
    # them never sweeps a workspace that is being created (nor one a rollback moved into a
    # subvolume and cgroup named after the restore)
    subvols = sorted(p.workspaces.iterdir()) if pool.is_mounted(p.pool) else []
    cgs = cgroups.list_names()
    known = records.all_names(p)
    for sub in subvols:
        if sub.name not in known:
            pool.delete_subvolume(sub)
            rep.subvolumes.append(sub.name)
    for name in sorted(cgs - known):
        cg = Cgroup(name)
        cg.kill_all()
        cg.remove()
        rep.cgroups.append(name)
    if pool.is_mounted(p.pool):
        rep.snapshots = _sweep_snapshots(p, rep.thawed)
        rep.caches += [f"snap-view {v}" for v in views.sweep(p)]  # views of deleted snapshots
        cleared = pool.clear_stale_qgroups(p.pool)  # quota groups of subvolumes deleted since
        if cleared:
            log.info("removed %d stale quota groups", cleared)
        with build_lock(p, blocking=False) as held:
            for tmp in sorted(p.images.glob(".build-*")) if held else []:
                pool.delete_subvolume(tmp)
                rep.partial_images.append(tmp.name)
    current = criu_env(p).get("CRIU_KDAT_CACHE")
    for kdat in sorted(p.run.glob("criu-*.kdat*")):  # of an earlier boot or CRIU build
        if str(kdat) != current:
            kdat.unlink(missing_ok=True)
            rep.caches.append(kdat.name)
    return rep


def _sweep_snapshots(p: Paths, thawed: list[str]) -> list[str]:
    """Ephemeral snapshots nobody uses, held ones whose holder died (released as it would
    have: deleted, or ephemeral while something uses them), and snapshot directories a crash
    left incomplete (their source, frozen for the dump, is thawed first; ``thawed`` gets its
    id). A directory whose dump is still running (its in-progress lock held by the controller
    or its CRIU) is never touched."""
    swept = []
    snapshots = store.Store(p)
    live = {r.snapshot for r in records.all_records(p) if r.running() and not r.holder_of}  # holders serve, not use
    for d in sorted(p.snapshots.iterdir()):
        if d.name.startswith(".") or d.name in live:
            continue
        try:
            age = time.time() - d.stat().st_mtime
        except FileNotFoundError:  # deleted by another process meanwhile
            continue
        progress, ws_id = dumping.state(d)
        if progress == "running":
            continue
        if progress == "abandoned":
            if ws_id and _thaw_source(ws_id, p):
                thawed.append(ws_id)
            if (d / "meta.json").exists():  # complete; its maker died before dropping the marker
                dumping.done(d)
            else:
                remove_snapshot_dir(d, p)
                swept.append(d.name)
                continue
        if not (d / "meta.json").exists():
            if age > 60:  # an older one is no snapshot in progress
                remove_snapshot_dir(d, p)
                swept.append(d.name)
            continue
        if age < 60:  # a fork may be about to register its clones
            continue
        before = d.exists()
        try:
            snap = snapshots.get(d.name)
        except SnapshotError:
            continue  # corrupt: kept for its owner to see (`bunshin snap ls` names it)
        # an ephemeral one goes once nobody uses it; a held one whose holder died (an env's
        # boot and reset snapshots) is released as its holder would have done
        if snap.metadata.ephemeral or snap.abandoned():
            snapshots.release(snap, reclaim)
        if before and not d.exists():
            swept.append(d.name)
    memory.registry.sweep(p)  # ksmd's users, uffd monitor files and image copies of workspaces gone
    return swept


def _thaw_source(ws_id: str, p: Paths) -> bool:
    """Thaw a workspace a dead controller's dump left frozen (True if it was frozen), without
    the network lock its killed CRIU may have left."""
    rec = records.load(ws_id, p)
    if rec is None or not rec.running():
        return False
    dumping.remove_network_locks(rec.pid1)  # the dump is abandoned: no CRIU runs on it
    cg = Cgroup(rec.cgroup)
    try:
        was_frozen = cg.is_frozen()  # FREEZING (a freeze cut short) is thawed too
        cg.thaw()
    except (OSError, WorkspaceError) as e:
        log.warning("gc: cannot thaw workspace %s, left frozen by an interrupted snapshot: %s", ws_id, e)
        return False
    return was_frozen
