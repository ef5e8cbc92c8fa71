"""Live workspaces for the explorer: ``bunshin ws ls`` with memory, the snapshots, and a
read-only view of a desktop workspace's screen.

Memory per workspace and per snapshot, shared and private, is counted by
:mod:`bunshin_gym.explore.memory` (physical pages, each once); one look serves the workspace
and the snapshot lists asked for together (:data:`SURVEY_TTL_S`).

The screen is read from the workspace's X socket (resolved inside its root without following
its symlinks, as the desktop env does) with a connection that lives for one capture: an open
connection from outside would make a snapshot of that workspace fail (CRIU refuses a unix
connection that leaves the workspace), so the view holds none between two frames.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

from bunshin_gym.explore import memory

log = logging.getLogger(__name__)

X_SOCKET = "/tmp/.X11-unix/X0"  # as envs/osworld/desktop.py
_screen_lock = threading.Lock()  # one capture at a time: a frame is up to 33 MB
#: how long one memory survey answers for: the page asks for workspaces and snapshots together
SURVEY_TTL_S = 2.0
_survey_lock = threading.Lock()
_last_survey: tuple[float, memory.Survey] | None = None


def current_survey(max_age: float = SURVEY_TTL_S) -> memory.Survey:
    """A memory survey at most ``max_age`` seconds old (one at a time: each reads every page
    table of the workspaces)."""
    global _last_survey
    with _survey_lock:
        if _last_survey is None or time.monotonic() - _last_survey[0] > max_age:
            _last_survey = (time.monotonic(), memory.survey())
        return _last_survey[1]


def workspaces() -> list[dict]:
    """Every workspace record, with its state and memory (running ones)."""
    from bunshin_gym.workspace import records

    mem = current_survey().workspaces
    out = []
    for r in records.all_records():
        running = r.running()
        row: dict[str, Any] = {"id": r.id, "image": r.image, "pid": r.pid1, "state": "running" if running else "dead",
                               "owner": "detached" if r.owner is None else f"pid {r.owner}"
                               + ("" if r.owner_alive() else " (gone)"),
                               "created": r.created, "snapshot": r.snapshot, "memory_mode": r.memory_mode,
                               "memory": None, "desktop": False}
        if running:
            row["memory"] = mem.get(r.id)  # None: started after the survey, or going away
            row["desktop"] = _has_screen(r.pid1)
        out.append(row)
    return out


def snapshots(limit: int = 500) -> list[dict]:
    """The snapshot store: each snapshot's parent, image, size of its own images (a delta for
    a clone's snapshot), the live clones restored from it, and its memory: ``memory`` is its
    tmpfs image copy split into pages mapped by live clones and pages it alone holds (None:
    no copy, no share clone was made of it)."""
    from bunshin_gym.workspace import records
    from bunshin_gym.workspace.snapshot import SnapshotStore

    running = [r for r in records.all_records() if r.running()]
    images = current_survey().snapshots
    out = []
    for s in SnapshotStore().list()[:limit]:
        try:
            size = s.size()
        except OSError:  # deleted while we list
            continue
        out.append({"id": s.id, "parent": s.parent, "image": s.meta.get("image"), "depth": s.depth,
                    "created": s.meta.get("created"), "bytes": size, "memory_mode": s.meta.get("memory_mode"),
                    "clones": [r.id for r in running if r.snapshot == s.id], "memory": images.get(s.id)})
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
