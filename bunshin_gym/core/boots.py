"""Boot snapshots shared by the envs of one process.

An env boots its workspace once (a desktop, a shop and its browser: seconds) and snapshots
that booted state; later resets roll back to it. Without sharing, every env of a family
does this on its own: a training run's GRPO groups, one env each, boot the same services
side by side, and every group's root is a fresh workspace whose snapshot holds all of its
memory, so the share clones of two groups map two full page images of the same boot.

With sharing, the first env of a kind (same family, image, memory mode, limits and
:meth:`~bunshin_gym.core.env.WorkspaceEnv.boot_config`) boots a workspace, snapshots it and
closes it; every env of that kind, the first one included, then starts from a fork of that
one snapshot. A root forked in share mode writes only what its task's set-up changes, and
the snapshot its members fork is a delta over the boot image: one boot image in memory for
all the groups of a kind, not one per group. A fork of the boot snapshot is what every
later reset of an env already was (a rollback to it), so nothing a program observes
changes.

The snapshot is deleted when the last env that holds it closes (as the store deletes
anything: once no clone or child snapshot needs it), unless a :func:`keep` block is open:
a program that makes and closes envs over and over (an epoch's groups, an evaluation's
tasks one after another) keeps its boots for the block, as a trainer that keeps its envs
does, instead of booting again each time. An env that boots while another
boots the same kind waits for that boot instead of running its own; a boot that fails
fails the envs that waited for it, each with that error.

Example:
    >>> a = gym.make("Bunshin-OSWorld-v0"); b = gym.make("Bunshin-OSWorld-v0")
    >>> a.reset(options={"task": t1}); b.reset(options={"task": t2})   # one desktop boot
    >>> boots.held()                                                    # {key: 2}
    >>> with boots.keep():                  # an evaluation: one boot for all its tasks
    ...     for t in tasks:
    ...         env = gym.make("Bunshin-OSWorld-v0"); env.reset(options={"task": t}); env.close()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    users: int = 0
    snapshot: Any = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)


_lock = threading.Lock()
_entries: dict[Hashable, _Entry] = {}
_keeping = 0  # keep() blocks open now


def acquire(key: Hashable, boot: Callable[[], Any]) -> Any:
    """The boot snapshot of kind ``key``, made by ``boot()`` if no env holds one (while
    another env makes it, wait for that); the caller holds it until :func:`release`."""
    with _lock:
        entry = _entries.get(key)
        first = entry is None
        if first:
            entry = _entries[key] = _Entry()
        entry.users += 1
    if first:
        try:
            entry.snapshot = boot()
        except BaseException as e:
            entry.error = e
            with _lock:
                if _entries.get(key) is entry:
                    del _entries[key]  # the next env of this kind boots again
            raise
        finally:
            entry.ready.set()
        return entry.snapshot
    entry.ready.wait()
    if entry.error is not None:
        raise entry.error
    return entry.snapshot


def release(key: Hashable) -> None:
    """One holder of kind ``key`` is done; the last one deletes the snapshot (deferred by
    the store while a clone or child snapshot still needs it)."""
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            return
        entry.users -= 1
        if entry.users > 0 or _keeping:
            return
        del _entries[key]
    _delete(entry)


@contextmanager
def keep() -> Iterator[None]:
    """Within the block, a boot snapshot whose last env closes stays for the next env of its
    kind (no boot again); at the end of the outermost block, those no env holds then are
    released. Blocks may nest and may be open on several threads."""
    global _keeping
    with _lock:
        _keeping += 1
    try:
        yield
    finally:
        with _lock:
            _keeping -= 1
            idle = [k for k, e in _entries.items() if e.users == 0] if not _keeping else []
            dropped = [_entries.pop(k) for k in idle]
        for entry in dropped:
            _delete(entry)


def _delete(entry: _Entry) -> None:
    if entry.snapshot is not None:
        try:
            entry.snapshot.release()
        except Exception:  # noqa: BLE001 - gone already or unreadable: `bunshin gc` reclaims it
            log.warning("the shared boot snapshot %s could not be released", entry.snapshot.id, exc_info=True)


def held() -> dict[Hashable, int]:
    """Kinds with a shared boot snapshot now, and how many env lineages hold each (0: kept
    by a :func:`keep` block only)."""
    with _lock:
        return {k: e.users for k, e in _entries.items()}
