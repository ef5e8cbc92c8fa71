"""Reclaim what crashed controllers left behind (``bunshin gc``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bunshin_gym.config import Paths, criu_env, paths
from bunshin_gym.workspace import cgroups, kmod, memory, pool, records, uffd
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.images import build_lock
from bunshin_gym.workspace.snapshot import _remove_dir, release_snapshot
from bunshin_gym.workspace.workspace import reclaim


@dataclass
class GcReport:
    workspaces: list[str] = field(default_factory=list)
    subvolumes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    partial_images: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)

    def total(self) -> int:
        return sum(len(v) for v in vars(self).values())


def collect(p: Paths | None = None, *, all_workspaces: bool = False) -> GcReport:
    """Reclaim workspaces whose controller died (or all, with ``all_workspaces``), then sweep
    subvolumes and cgroups that no record names."""
    p = p or paths()
    rep = GcReport()
    uffd.check_all(p)  # a clone whose uffd monitor died is stopped (then reclaimed below)
    holders = []
    for rec in records.all_records(p):
        if kmod.is_holder(rec) and not all_workspaces:
            holders.append(rec)  # after the clones: a holder goes with the last kmod clone it serves
        elif all_workspaces or not rec.owner_alive() or (rec.pid1 is not None and not rec.running()):
            reclaim(rec, p)
            rep.workspaces.append(rec.id)
    for rec in holders:
        snap_id = rec.extra[kmod.HOLDER_KEY]
        if not (p.snapshots / snap_id).exists() or (rec.pid1 is not None and not rec.running()):
            reclaim(rec, p)
            rep.workspaces.append(rec.id)
        else:
            rep.workspaces += kmod.close_holders(snap_id, p, unless_used=True)
    # a record is written before its subvolume and cgroup, so reading records after listing
    # them never sweeps a workspace that is being created
    subvols = sorted(p.workspaces.iterdir()) if pool.is_mounted(p.pool) else []
    cgs = cgroups.list_names()
    known = records.all_ids(p)
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
        rep.snapshots = _sweep_snapshots(p)
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


def _sweep_snapshots(p: Paths) -> list[str]:
    """Ephemeral snapshots nobody uses, and snapshot directories a crash left incomplete."""
    swept = []
    live = {r.snapshot for r in records.all_records(p) if r.running() and not kmod.is_holder(r)}
    for d in sorted(p.snapshots.iterdir()):
        if d.name.startswith(".") or d.name in live:
            continue
        try:
            age = time.time() - d.stat().st_mtime
        except FileNotFoundError:  # deleted by another process meanwhile
            continue
        if not (d / "meta.json").exists():
            if age > 60:  # an older one is no snapshot in progress
                _remove_dir(d)
                swept.append(d.name)
            continue
        if age < 60:  # a fork may be about to register its clones
            continue
        before = d.exists()
        release_snapshot(d.name, p)
        if before and not d.exists():
            swept.append(d.name)
    memory.ksm_release("", live={r.id for r in records.all_records(p)})
    uffd.sweep(p)
    return swept
