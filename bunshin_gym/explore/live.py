"""Live workspaces for the explorer: ``bunshin ws ls`` with memory, the snapshots, and a
read-only view of a desktop workspace's screen.

Memory per workspace is summed over its cgroup's processes from ``smaps_rollup`` (cheap
enough to refresh every few seconds): PSS, RSS, private (pages only this process maps) and
shared (RSS less private: pages it shares, with its snapshot's other clones among others).

The screen is read from the workspace's X socket (resolved inside its root without following
its symlinks, as the desktop env does) with a connection that lives for one capture: an open
connection from outside would make a snapshot of that workspace fail (CRIU refuses a unix
connection that leaves the workspace), so the view holds none between two frames.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

X_SOCKET = "/tmp/.X11-unix/X0"  # as envs/osworld/desktop.py
_screen_lock = threading.Lock()  # one capture at a time: a frame is up to 33 MB


def workspaces() -> list[dict]:
    """Every workspace record, with its state and memory (running ones)."""
    from bunshin_gym.workspace import records
    from bunshin_gym.workspace.cgroups import Cgroup
    from bunshin_gym.workspace.memstat import rollup

    out = []
    for r in records.all_records():
        running = r.running()
        row: dict[str, Any] = {"id": r.id, "image": r.image, "pid": r.pid1, "state": "running" if running else "dead",
                               "owner": "detached" if r.owner is None else f"pid {r.owner}"
                               + ("" if r.owner_alive() else " (gone)"),
                               "created": r.created, "snapshot": r.snapshot, "memory_mode": r.memory_mode,
                               "memory": None, "desktop": False}
        if running:
            try:
                pids = Cgroup(r.cgroup).pids()
                m = rollup(pids)
                private = m["Private_Clean"] + m["Private_Dirty"]
                row["memory"] = {"processes": len(pids), "pss": m["Pss"], "rss": m["Rss"], "private": private,
                                 "shared": max(0, m["Rss"] - private)}
                row["desktop"] = _has_screen(r.pid1)
            except OSError as e:  # going away while we read it
                log.debug("workspace %s: memory not readable: %s", r.id, e)
        out.append(row)
    return out


def snapshots(limit: int = 500) -> list[dict]:
    """The snapshot store: each snapshot's parent, image, size of its own images (a delta for
    a clone's snapshot) and the live clones restored from it."""
    from bunshin_gym.workspace import records
    from bunshin_gym.workspace.snapshot import SnapshotStore

    running = [r for r in records.all_records() if r.running()]
    out = []
    for s in SnapshotStore().list()[:limit]:
        try:
            size = s.size()
        except OSError:  # deleted while we list
            continue
        out.append({"id": s.id, "parent": s.parent, "image": s.meta.get("image"), "depth": s.depth,
                    "created": s.meta.get("created"), "bytes": size, "memory_mode": s.meta.get("memory_mode"),
                    "clones": [r.id for r in running if r.snapshot == s.id]})
    return out


def _has_screen(pid1: int | None) -> bool:
    from bunshin_gym.workspace.inroot import RootedPath

    if not pid1:
        return False
    try:
        return RootedPath(pid1, X_SOCKET).exists()
    except OSError:
        return False


def screen_jpeg(ws_id: str, *, max_side: int = 1280, quality: int = 75) -> bytes:
    """One frame of a running desktop workspace's screen, as JPEG.

    Raises:
        LookupError: no such workspace, or it is not running or has no screen.
        OSError: the X server did not answer (it is inside the workspace and not trusted).
    """
    from PIL import Image

    from bunshin_gym.envs.osworld.xclient import XScreen
    from bunshin_gym.workspace import records
    from bunshin_gym.workspace.inroot import RootedPath

    rec = records.load(ws_id)
    if rec is None:
        raise LookupError(f"no workspace {ws_id!r}")
    if not rec.running():
        raise LookupError(f"workspace {ws_id} is not running")
    if not _has_screen(rec.pid1):
        raise LookupError(f"workspace {ws_id} has no X display")
    with _screen_lock:
        scr = XScreen(RootedPath(rec.pid1, X_SOCKET), timeout=5.0)
        try:
            rgb = scr.capture()
        finally:
            scr.close()
    img = Image.fromarray(rgb)
    img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
