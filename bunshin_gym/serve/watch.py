"""Directory watchers (envd's ``WatchDir``, ``CreateWatcher``, ``GetWatcherEvents``) by
polling: the server lists the watched tree through the workspace's agent and reports what
changed between two listings.

Why polling and not inotify: the workspace's seccomp filter refuses ``inotify_init`` on
purpose (bunshin-init.c: an inotify instance cannot be checkpointed by CRIU, so a workspace
holding one could no longer be snapshotted, paused or forked). Watching from the controller
instead (inotify or fanotify on the workspace's upper layer) would see the tree as root from
outside, where every name in it is the workspace's to choose, and would miss the lower
(image) layer. A listing made inside the workspace, as the request's user, by ``find``
(which never follows a symlink below the watched directory) sees exactly what that user
sees, holds nothing that a snapshot must carry, and costs one agent request per poll.

What polling cannot see: a change undone before the next listing (a file made and removed
in between), and several writes to one file between two listings, which are one ``WRITE``.
A rename is reported as ``RENAME`` of the old name and ``CREATE`` of the new one (as envd's
inotify does) when the same inode moved within the watched tree.

Watchers made with ``CreateWatcher`` outlive a server restart: each is written to the
server's state directory (:class:`WatcherStore`) when made and whenever a poll changes its
listing, and a restarted server gives a reattached sandbox its watchers back, so the next
``GetWatcherEvents`` reports what changed meanwhile. A streamed ``WatchDir`` ends with its
connection anyway.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from e2b.envd.filesystem.filesystem_pb import EventType

from bunshin_gym.serve.registry import NotFound, QuotaExceeded, ServeError

log = logging.getLogger(__name__)

#: the most entries one watched tree may hold (a listing is at most ~1 MB then)
MAX_ENTRIES = 10_000
#: watchers one sandbox may hold at once
MAX_WATCHERS = 16
#: polling of a streamed watch: first interval, growth while nothing changes, cap (seconds)
POLL_FIRST, POLL_GROWTH, POLL_MAX = 0.1, 1.5, 1.0

#: lists DIR as ``inode type size mtime mode relative-name`` records, NUL-terminated; exit 2:
#: no such directory, 3: not a directory, 5: the user may not list it
LISTER = r"""
dir=$1; limit=$2; depth=$3
[ -e "$dir" ] || exit 2
[ -d "$dir" ] || exit 3
[ -r "$dir" ] && [ -x "$dir" ] || exit 5
find -H "$dir" -mindepth 1 $depth -printf '%i %y %s %T@ %m %P\0' 2>/dev/null | head -z -n "$limit"
"""

#: an entry: (inode, type letter, size, mtime, mode)
Entry = tuple[int, str, int, str, str]


@dataclass
class Watcher:
    """One watched directory of a sandbox and what it held at the last listing."""

    path: str
    recursive: bool
    user: str
    entries: dict[str, Entry] = field(default_factory=dict)
    id: str = field(default_factory=lambda: secrets.token_hex(8))


def parse_listing(raw: bytes, path: str) -> dict[str, Entry]:
    records = raw.split(b"\0")
    if records and records[-1] == b"":
        records.pop()
    if len(records) > MAX_ENTRIES:
        raise ServeError(f"{path} holds more than {MAX_ENTRIES} entries: too many to watch", 400)
    entries: dict[str, Entry] = {}
    for record in records:
        parts = record.decode(errors="surrogateescape").split(" ", 5)
        if len(parts) != 6 or not parts[0].isdigit():
            continue  # a line find could not finish (a name it could not stat)
        ino, kind, size, mtime, mode, name = parts
        entries[name] = (int(ino), kind, int(size) if size.isdigit() else 0, mtime, mode)
    return entries


def list_tree(sb, watcher: Watcher) -> dict[str, Entry]:
    """What the watched directory holds now (``sb``: a :class:`~bunshin_gym.serve.sandbox.Sandbox`)."""
    depth = "" if watcher.recursive else "-maxdepth 1"
    with sb.lock:
        res = sb.workspace().exec(["/bin/sh", "-c", LISTER, "sh", watcher.path, str(MAX_ENTRIES + 1), depth],
                                  user=watcher.user, timeout=60, max_output=64 << 20)
    if res.exit_code == 2:
        raise NotFound(f"{watcher.path}: no such directory")
    if res.exit_code == 3:
        raise ServeError(f"{watcher.path} is not a directory", 400)
    if res.exit_code == 5:
        raise ServeError(f"{watcher.path}: {watcher.user} may not list it", 403)
    if res.timed_out:
        raise ServeError(f"listing {watcher.path} took over a minute: too large to watch", 400)
    return parse_listing(res.stdout, watcher.path)


def diff(old: dict[str, Entry], new: dict[str, Entry]) -> list[tuple[str, EventType]]:
    """The events that turn listing ``old`` into listing ``new``."""
    events: list[tuple[str, EventType]] = []
    removed = sorted(old.keys() - new.keys())
    added = sorted(new.keys() - old.keys())
    added_by_inode = {new[name][:2]: name for name in added}
    for name in removed:
        moved_to = added_by_inode.pop(old[name][:2], None)
        if moved_to is not None:
            events += [(name, EventType.RENAME), (moved_to, EventType.CREATE)]
            added.remove(moved_to)
        else:
            events.append((name, EventType.REMOVE))
    for name in added:
        events.append((name, EventType.CREATE))
        if new[name][1] == "f" and new[name][2] > 0:
            events.append((name, EventType.WRITE))  # made with content: inotify says both
    for name in sorted(old.keys() & new.keys()):
        (ino0, kind0, size0, mtime0, mode0), (ino1, kind1, size1, mtime1, mode1) = old[name], new[name]
        if kind0 != kind1:
            events += [(name, EventType.REMOVE), (name, EventType.CREATE)]
            continue
        if kind1 != "d" and (ino0, size0, mtime0) != (ino1, size1, mtime1):
            events.append((name, EventType.WRITE))
        if mode0 != mode1:
            events.append((name, EventType.CHMOD))
    return events


def add_watcher(watchers: dict[str, Watcher], watcher: Watcher) -> None:
    if len(watchers) >= MAX_WATCHERS:
        raise QuotaExceeded(f"a sandbox holds at most {MAX_WATCHERS} watchers: stop one first")
    watchers[watcher.id] = watcher


class WatcherStore:
    """The watchers of each sandbox on disk: ``ROOT/SANDBOX/WATCHER.json`` holding its path,
    recursion, user and last listing, each replaced atomically."""

    def __init__(self, root: Path):
        self.root = root

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def save(self, sandbox_id: str, watcher: Watcher) -> None:
        d = self._dir(sandbox_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{watcher.id}.tmp"
        tmp.write_text(json.dumps({"path": watcher.path, "recursive": watcher.recursive, "user": watcher.user,
                                   "entries": watcher.entries}))
        os.replace(tmp, d / f"{watcher.id}.json")

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        (self._dir(sandbox_id) / f"{watcher_id}.json").unlink(missing_ok=True)

    def load(self, sandbox_id: str) -> dict[str, Watcher]:
        """The watchers saved for a sandbox (one that cannot be read is left out, logged)."""
        out: dict[str, Watcher] = {}
        for f in sorted(self._dir(sandbox_id).glob("*.json")):
            try:
                d = json.loads(f.read_text())
                entries = {name: (int(e[0]), str(e[1]), int(e[2]), str(e[3]), str(e[4]))
                           for name, e in d["entries"].items()}
                out[f.stem] = Watcher(str(d["path"]), bool(d["recursive"]), str(d["user"]), entries, id=f.stem)
            except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                log.warning("watcher %s of sandbox %s cannot be read back (%s): dropped", f.stem, sandbox_id, e)
        return out

    def keep_only(self, sandbox_ids: set[str]) -> None:
        """Forget the watchers of every sandbox not in ``sandbox_ids`` (closed, reaped)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.is_dir() and d.name not in sandbox_ids:
                shutil.rmtree(d, ignore_errors=True)
