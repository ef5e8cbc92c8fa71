"""What the server holds for its clients: leases (E2B sandboxes, env workspaces), each with
an owner, a time to live and an idle timeout; per-owner quotas; and the reaper that closes
whatever a client left behind.

A lease's ``close()`` reclaims everything it holds (workspaces, snapshots). The reaper runs
in its own thread and closes leases past their end or idle for longer than their idle
timeout, so a client that disappears (killed, network gone) leaves nothing behind once its
idle timeout has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from bunshin_gym.errors import BunshinError
from bunshin_gym.serve.auth import Principal

log = logging.getLogger(__name__)


class ServeError(BunshinError):
    """A request that cannot be served: ``status`` is the HTTP status to answer with."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


async def json_object(request) -> dict:
    """A request's body as a JSON object ({} when empty); ServeError 400 when it is not one."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise ServeError(f"the body is not JSON: {e}", 400) from None
    if not isinstance(body, dict):
        raise ServeError("the body must be a JSON object", 400)
    return body


class NotFound(ServeError):
    status = 404


class QuotaExceeded(ServeError):
    status = 429


class Conflict(ServeError):
    status = 409


@dataclass
class Lease:
    """Something a client holds on the server. Subclasses implement :meth:`reclaim`."""

    id: str
    owner: Principal
    #: epoch seconds at which it ends (its TTL); None: no end
    end_at: float | None
    #: seconds without a request after which it is reaped; 0: never
    idle_timeout: float
    #: what it counts against its owner's quota: live workspaces and their memory limits
    workspaces: int = 1
    memory: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def expiry(self, now_wall: float, now_mono: float) -> str | None:
        """Why the reaper should take it now, or None."""
        if self.end_at is not None and now_wall >= self.end_at:
            return "its timeout passed"
        if self.idle_timeout and now_mono - self.last_used >= self.idle_timeout:
            return f"idle for {now_mono - self.last_used:.0f} s (idle timeout {self.idle_timeout:g} s)"
        return None

    def on_expiry(self, registry: Registry, why: str) -> None:
        """What the reaper does with an expired lease: close it (sandboxes may pause instead)."""
        registry.close(self.id, why=why)

    def reclaim(self) -> None:
        raise NotImplementedError


class Registry:
    """The leases of one server, by id, with per-owner usage for the quotas."""

    def __init__(self, reap_interval: float = 1.0):
        self._leases: dict[str, Lease] = {}
        self._usage: dict[str, list[int]] = {}  # owner name -> [workspaces, memory]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reap_interval = reap_interval
        self._reaper: threading.Thread | None = None
        #: called after any change (the server persists its state there)
        self.on_change = lambda: None

    # quotas ------------------------------------------------------------------------------
    def reserve(self, owner: Principal, workspaces: int, memory: int) -> None:
        """Count ``workspaces`` and ``memory`` against ``owner``'s quota, or raise
        :class:`QuotaExceeded` (nothing counted then)."""
        if owner.max_memory and workspaces and memory <= 0:
            raise QuotaExceeded(f"quota: {owner.name} has a memory quota, so its workspaces need a memory "
                                "limit (limits={'memory': ...}), not an unlimited one")
        with self._lock:
            used = self._usage.setdefault(owner.name, [0, 0])
            if owner.max_workspaces and used[0] + workspaces > owner.max_workspaces:
                raise QuotaExceeded(f"quota exceeded: {owner.name} holds {used[0]} of {owner.max_workspaces} "
                                    f"workspaces, {workspaces} more asked")
            if owner.max_memory and used[1] + memory > owner.max_memory:
                raise QuotaExceeded(f"quota exceeded: {owner.name} holds {used[1] >> 20} MiB of "
                                    f"{owner.max_memory >> 20} MiB of workspace memory, {memory >> 20} MiB more asked")
            used[0] += workspaces
            used[1] += memory

    def unreserve(self, owner: Principal, workspaces: int, memory: int) -> None:
        with self._lock:
            used = self._usage.setdefault(owner.name, [0, 0])
            used[0] = max(0, used[0] - workspaces)
            used[1] = max(0, used[1] - memory)

    def usage(self, owner: Principal) -> tuple[int, int]:
        with self._lock:
            ws, mem = self._usage.get(owner.name, [0, 0])
            return ws, mem

    # leases ------------------------------------------------------------------------------
    def add(self, lease: Lease) -> Lease:
        """Register a lease whose usage was already reserved."""
        with self._lock:
            self._leases[lease.id] = lease
        self.on_change()
        return lease

    def get(self, lease_id: str, owner: Principal | None = None, kind: type[Lease] = Lease) -> Lease:
        """The lease, touched; :class:`NotFound` if unknown, closed, of another kind or owned
        by someone else (the same answer: ids of others' leases are not confirmed)."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or lease.closed or not isinstance(lease, kind) or (
                owner is not None and lease.owner.name != owner.name):
            raise NotFound(f"no {kind.__name__.lower()} {lease_id!r}")
        lease.touch()
        return lease

    def list(self, owner: Principal | None = None, kind: type[Lease] = Lease) -> list[Lease]:
        with self._lock:
            leases = list(self._leases.values())
        return [x for x in leases if isinstance(x, kind) and not x.closed
                and (owner is None or x.owner.name == owner.name)]

    def close(self, lease_id: str, *, why: str = "closed by its owner") -> bool:
        """Close a lease and give its quota back; False if there was none."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        with lease.lock:
            if lease.closed:
                return False
            lease.closed = True
            try:
                lease.reclaim()
            except Exception:  # noqa: BLE001 - a failed reclaim must not keep the quota or stop the reaper
                log.exception("closing %s failed (bunshin gc reclaims what is left)", lease_id)
            finally:
                self.unreserve(lease.owner, lease.workspaces, lease.memory)
        log.info("closed %s (%s)", lease_id, why)
        self.on_change()
        return True

    def close_all(self) -> None:
        for lease in self.list():
            self.close(lease.id, why="server shutdown")

    # reaper ------------------------------------------------------------------------------
    def start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_loop, name="bunshin-serve-reaper", daemon=True)
            self._reaper.start()

    def stop_reaper(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=30)
            self._reaper = None

    def reap_once(self) -> list[str]:
        """Handle every expired lease now; returns their ids."""
        now_wall, now_mono = time.time(), time.monotonic()
        taken = []
        for lease in self.list():
            why = lease.expiry(now_wall, now_mono)
            if why is None:
                continue
            if not lease.lock.acquire(blocking=False):
                continue  # in use right now (a long command, a fork): not idle
            try:
                log.info("reaping %s of %s: %s", lease.id, lease.owner.name, why)
                lease.on_expiry(self, why)
            except Exception:  # noqa: BLE001 - the reaper must outlive any one lease
                log.exception("reaping %s failed", lease.id)
            finally:
                lease.lock.release()
            taken.append(lease.id)
        return taken

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._reap_interval):
            self.reap_once()
