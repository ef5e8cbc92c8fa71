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
#: how long one memory survey answers for at least: the page asks for workspaces and snapshots
#: together, every 5 s
SURVEY_TTL_S = 2.0
#: ... and at least this many times what it took: a host of desktops takes seconds to survey,
#: and the page must not keep a core busy with it
SURVEY_COST_FACTOR = 4.0
_survey_lock = threading.Lock()  # one survey at a time
_last_survey: memory.Survey | None = None


def current_survey(running: set[str] | frozenset[str] = frozenset()) -> memory.Survey:
    """A recent memory survey, meant to have looked at the ``running`` workspaces.

    The last one answers while it is fresh: for :data:`SURVEY_COST_FACTOR` times what it took
    (at least :data:`SURVEY_TTL_S`), or, when a running workspace is missing from it, for only
    as long as it took (a host where tests come and go would otherwise be surveyed without
    a pause). A stale one still answers while a newer one is being taken, unless a workspace is
    missing from it: then the request waits for the new one. ``taken`` says how old it is."""
    global _last_survey
    last = _last_survey
    complete = last is not None and running <= last.seen
    if last is not None:
        fresh_for = max(SURVEY_TTL_S, (SURVEY_COST_FACTOR if complete else 1.0) * last.seconds)
        if time.time() - last.taken < fresh_for:
            return last
    if not _survey_lock.acquire(blocking=not complete):
        return last  # another request is taking the next one
    try:
        if _last_survey is last or not running <= _last_survey.seen:  # none newer answers
            _last_survey = memory.survey()
        return _last_survey
    finally:
        _survey_lock.release()


def survey_time() -> dict:
    """When the memory numbers now served were taken (``time.time()``), and in how many seconds."""
    last = _last_survey
    return {"taken": last.taken, "seconds": last.seconds} if last is not None else {"taken": None, "seconds": None}


def workspaces() -> list[dict]:
    """Every workspace record, with its state and memory (running ones)."""
    from bunshin_gym.workspace import records

    recs = records.all_records()
    mem = current_survey({r.id for r in recs if r.running()}).workspaces
    out = []
    for r in recs:
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
    images = current_survey({r.id for r in running}).snapshots
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
