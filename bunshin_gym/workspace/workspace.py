"""The two handles: ``Workspace``, a live container made from an image and driven through its
in-workspace agent, and ``Snapshot``, a frozen state of one that clones are forked from.

A workspace is an overlay of its image (read-only subvolume) and a writable upper layer
(its own subvolume), in fresh mount, pid, net, ipc and uts namespaces, with only ``lo``,
a memory and freezer cgroup, and PID 1 = ``/.bunshin/init``, which runs the agent.

The handles live in one module because each makes the other (a workspace's snapshot, a
snapshot's clones); what they do is below them: :mod:`.forking` takes snapshots and restores
clones and rollbacks, :mod:`.teardown` takes workspaces down, :mod:`.snapshots` keeps the
snapshot store. ``bunshin_gym.workspace.snapshot`` is the snapshot handle's import path.

Example:
    >>> from bunshin_gym.workspace import Workspace
    >>> with Workspace.create("base") as ws:
    ...     print(ws.exec("echo hello; uname -n").text)
    ...     snap = ws.snapshot()                 # source frozen only while dumping
    ...     a, b = snap.fork(2)                  # two live clones, fresh namespaces each
    ...     ws.rollback(snap)
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.config import Limits, Paths, at_workspace_nice, paths
from bunshin_gym.workspace import forking, hostlimits, idmap, memory, pool, records, spares, teardown
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.client import AgentClient, ExecResult
from bunshin_gym.workspace.errors import AgentError, ForkError, SnapshotError, WorkspaceClosed, WorkspaceError
from bunshin_gym.workspace.images import ImageStore
from bunshin_gym.workspace.memory import DEFAULT_MODE, MemoryMode
from bunshin_gym.workspace.memstat import rollup
from bunshin_gym.workspace.runtime import ensure_runtime
from bunshin_gym.workspace.snapshots import flatten, store, views
from bunshin_gym.workspace.snapshots.stored import StoredSnapshot
from bunshin_gym.workspace.teardown import reclaim

__all__ = ["MemoryStats", "Snapshot", "SnapshotStore", "Workspace", "disk_full_in", "limits_hit", "reclaim"]


@dataclass
class MemoryStats:
    """Memory of a workspace's processes (bytes), read from /proc/PID/smaps_rollup."""

    pss: int
    rss: int
    private: int
    processes: int
    cgroup: int

    def as_mb(self) -> dict:
        return {k: round(v / 2**20, 1) if k != "processes" else v for k, v in vars(self).items()}


#: a request to the agent within this many seconds of a passed :meth:`Workspace.check` does
#: not check again (the env checks before each action, and the action's request follows)
_RECHECK_AFTER_S = 0.05

#: how long a request that failed to reach the agent waits for PID 1 to exit before it calls
#: the failure a channel error rather than the workspace's death (see Workspace._death_while)
_DEATH_WAIT_S = 2.0


class Workspace:
    """A running workspace. Create with :meth:`create`, reach an existing one with :meth:`attach`."""

    def __init__(self, record: records.Record, p: Paths):
        self._rec = record
        self._p = p
        self._cgroup = Cgroup(record.cgroup)
        self._client = AgentClient(record.pid1, record.id) if record.pid1 else None
        self._closed = False
        self._checked_at = float("-inf")  # when check() last passed (time.monotonic)
        self._reclaims: list[Future] = []  # of what rollbacks replaced (see _reclaim_later)

    # life cycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, image: str = "base", *, memory_mode: str = DEFAULT_MODE, detached: bool = False,
               ready_timeout: float = 30.0, ws_id: str | None = None, hostname: str | None = None,
               limits: Limits | dict | None = None) -> Workspace:
        """Start a workspace from an image (which must be built: ``bunshin image build``).

        Args:
            image: image name (``bunshin image ls``).
            detached: keep it running after this process exits (``bunshin ws start``);
                otherwise ``bunshin gc`` reclaims it once this process is gone.
            memory_mode: how clones of this workspace get their memory (see
                :mod:`bunshin_gym.workspace.memory`): "share" (default), "ksm", "copy",
                or the unsafe opt-in "map-anon".
            ready_timeout: seconds to wait for the agent to answer.
            ws_id: the workspace id (default: a random ``ws-xxxxxxxx``).
            hostname: the workspace's host name (default: its id). Envs give a fixed one, so
                that two workspaces of one task look the same to the agent.
            limits: memory, pids and disk limits (a :class:`~bunshin_gym.config.Limits` or a
                dict such as ``{"memory": "2G"}``; the rest from ``BUNSHIN_WS_*``, defaults
                8G, 4096, 8G). Its snapshots carry them to every clone.
        """
        mode = MemoryMode.parse(memory_mode)
        limits = Limits.parse(limits)
        p = pool.require_pool()
        hostlimits.prepare_host()
        image_path = ImageStore(p).get(image)
        layer = ensure_runtime(p)
        ws_id = ws_id or f"ws-{secrets.token_hex(4)}"
        sub = p.workspaces / ws_id
        if records.load(ws_id, p) is not None or sub.exists() or Cgroup(ws_id).exists():
            # reclaiming the failed create would destroy the workspace that has this id
            raise WorkspaceError(f"workspace id {ws_id!r} is already in use")
        me = os.getpid()
        # owned by this process until create returns, detached too: a create cut short (this
        # process killed at any point) leaves a record whose owner is dead, which gc reclaims
        rec = records.Record(
            id=ws_id, image=image, image_path=str(image_path), subvolume=str(sub), cgroup=ws_id,
            owner=me, owner_start=records.proc_start_time(me),
            created=time.time(), layer=str(layer), memory_mode=mode.value,
            limits=limits,
        )
        ids = idmap.current()
        rec.userns_base = ids.base if ids else None
        records.save(rec, p)
        ws = cls(rec, p)
        try:
            pool.create_subvolume(sub)
            pool.limit_subvolume(sub, limits.disk)
            for d in ("upper", "work", "root"):
                (sub / d).mkdir()
            idmap.own_dirs(ids, sub / "upper", sub / "work")
            lower = idmap.lower_image(image_path, rec.userns_base)
            cg = Cgroup.create(ws_id, limits)
            proc = subprocess.run(
                at_workspace_nice(
                    [str(layer / ".bunshin" / "init"), "launch", str(sub / "root"), f"{layer}:{lower}",
                     str(sub / "upper"), str(sub / "work"), str(views.empty_view(p)), hostname or ws_id,
                     idmap.launch_arg(ids), *cg.procs_files]),
                capture_output=True, text=True, timeout=60,
            )
            if proc.returncode != 0:
                raise WorkspaceError(f"{ws_id}: starting from image {image!r} failed: {proc.stderr.strip()}")
            rec.pid1 = int(proc.stdout)
            rec.pid1_start = records.proc_start_time(rec.pid1)
            records.save(rec, p)
            ws._connect(ready_timeout)
            if detached:  # handed over: it runs on after this process, until stopped
                rec.owner = rec.owner_start = None
                records.save(rec, p)
        except BaseException:
            ws.close()
            raise
        return ws

    @classmethod
    def attach(cls, ws_id: str) -> Workspace:
        """A handle on a running workspace started elsewhere (another process, the CLI)."""
        p = paths()
        rec = records.load(ws_id, p)
        if rec is None:
            known = ", ".join(r.id for r in records.all_records(p)) or "none"
            raise WorkspaceError(f"no workspace {ws_id!r}; running: {known}")
        if not rec.running():
            raise WorkspaceClosed(f"workspace {ws_id} is not running (reclaim it with: bunshin gc)")
        return cls(rec, p)

    def _connect(self, timeout: float = 30.0, client: AgentClient | None = None) -> None:
        """Connect to the agent and wait until it answers; ``client``: a connection it answered
        on already (a restore's, see :func:`~.forking.restore_beside`), kept instead of a new one."""
        if client is not None:
            client.rename(self.id)
            self._client = client
            return
        self._client = AgentClient(self._rec.pid1, self.id)
        self._client.wait_ready(timeout)

    def close(self) -> None:
        """Stop every process and reclaim the cgroup, the upper layer and the record."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.disconnect()
        self._wait_reclaims()
        reclaim(self._rec, self._p)

    def _reclaim_later(self, rec: records.Record) -> None:
        """Reclaim what a rollback replaced (its processes already killed) off the caller's
        path: waiting for a user-namespaced workspace's processes and mounts to go takes
        ~70 ms, deleting its layer more. :meth:`close` waits for it; after a crash its record
        (owned by this process) leads ``bunshin gc`` to it."""
        self._reclaims = [f for f in self._reclaims if not f.done()]
        self._reclaims.append(teardown.reclaim_later(rec, self._p))

    def _wait_reclaims(self) -> None:
        for future in self._reclaims:
            future.result()  # _reclaim_replaced logs its own failures
        self._reclaims = []

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid {self._rec.pid1}"
        return f"<Workspace {self.id} image={self.image} {state}>"

    # properties ----------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def image(self) -> str:
        return self._rec.image

    @property
    def pid(self) -> int:
        """Host pid of the workspace's PID 1."""
        self._check_open()
        return self._rec.pid1

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def upper(self) -> Path:
        """The writable layer (a btrfs subvolume): everything the workspace wrote."""
        return Path(self._rec.subvolume) / "upper"

    @property
    def cgroup(self) -> Cgroup:
        return self._cgroup

    @property
    def limits(self) -> Limits:
        """The memory, pids and disk limits this workspace was started (or restored) with."""
        return Limits.parse(self._rec.limits)

    def limit_state(self, disk: bool = True) -> dict[str, int]:
        """Counters to tell whether an action hit a limit (compare two readings with
        :func:`limits_hit`): kernel OOM kills, refused forks and, with ``disk``, the bytes
        charged to the disk quota and its cap (~0.15 ms more; read it when an action's output
        says a write failed, see :func:`disk_full_in`)."""
        self._check_open()
        state = dict(self._cgroup.limit_events())
        if disk:
            usage = pool.disk_usage(Path(self._rec.subvolume))
            state["disk_used"], state["disk_limit"] = usage or (0, 0)
        return state

    def _check_open(self) -> None:
        if self._closed:
            raise WorkspaceClosed(f"workspace {self.id} is closed")

    def _agent(self) -> _DeathReporting:
        # a check made a moment ago (the env's, before this step's action) is not made again:
        # it reads /proc and the cgroup, the largest cost of a short command's round trip
        if time.monotonic() - self._checked_at > _RECHECK_AFTER_S:
            self.check()
        self._checked_at = float("-inf")  # used once: the next request checks again
        if self._client is None:
            raise WorkspaceError(f"workspace {self.id} has no agent")
        return _DeathReporting(self, self._client)

    def check(self) -> None:
        """Raise :class:`WorkspaceClosed`, saying why, when the workspace can no longer be used:
        closed, its processes killed (PID 1 gone), or its uffd monitor dead (the clone is then
        stopped at once: it must not read stale memory). Envs call it before every step, since
        some steps reach the workspace through their own channels (X, the browser driver)."""
        self._check_open()
        if why := memory.for_record(self._rec).health(self._rec, self._p):  # e.g. its uffd monitor died
            raise WorkspaceClosed(why)
        if self._rec.pid1 is not None and not self._rec.running():
            raise WorkspaceClosed(self._died())
        self._checked_at = time.monotonic()

    def _died(self) -> str:
        return (f"workspace {self.id} is no longer running: its processes were killed (PID 1, host pid "
                f"{self._rec.pid1}, is gone); close it")

    def _death_while(self, op: str | None, error: WorkspaceError) -> WorkspaceClosed | None:
        """After a request failed to reach the agent: WorkspaceClosed if the reason is that the
        workspace died (killed mid-request, or its uffd monitor gone), else None. PID 1 dies a
        moment after the agent when the whole workspace is killed, later on a busy host (as PID
        1 of its namespace it exits only once every other process in it is reaped; 0.2 s was
        too short under a loaded CI run): wait for it up to _DEATH_WAIT_S. Only a failed request
        pays this wait, and only while PID 1 lives."""
        if why := memory.for_record(self._rec).health(self._rec, self._p):
            return WorkspaceClosed(f"{why} (during {op}: {error})")
        if self._rec.pid1 is None or not teardown.wait_gone(self._rec.pid1, _DEATH_WAIT_S) or self._rec.running():
            return None
        return WorkspaceClosed(f"{self._died()} (during {op}: {error})")

    # commands and files --------------------------------------------------------------
    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 120.0, env: dict | None = None,
             cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
             check: bool = False, max_output: int | None = None) -> ExecResult:
        """Run a command to completion inside the workspace.

        Args:
            cmd: a shell command line (run by ``/bin/sh -c``) or an argv list.
            timeout: seconds; on expiry only this command's process group is killed and
                the result has ``timed_out=True``. None waits forever.
            env: variables added to the base environment.
            cwd: working directory (default: the user's home).
            user: run as this user (default root).
            stdin: bytes fed to the command's standard input.
            check: raise :class:`WorkspaceError` on a non-zero exit or a timeout.
            max_output: bytes kept of each output stream (default 1 MiB,
                :data:`~bunshin_gym.workspace.client.MAX_OUTPUT`); past it the head and the
                tail are kept with a ``[... output cut: N bytes not shown ...]`` marker between.
        """
        req = _command(cmd)
        req.update(op="exec", timeout=timeout, env=env, cwd=cwd, user=user, max_output=max_output)
        reply, (out, err) = self._agent().request(req, [stdin] if stdin is not None else [])
        res = ExecResult(reply["exit_code"], out, err, reply["timed_out"], reply["duration"])
        if check and not res.ok:
            why = "timed out" if res.timed_out else f"exited {res.exit_code}"
            raise WorkspaceError(f"{self.id}: {cmd!r} {why}: {err.decode(errors='replace')[-2000:]}")
        return res

    def spawn(self, cmd: str | Sequence[str], *, env: dict | None = None, cwd: str | None = None,
              user: str | None = None, log: str | None = None) -> int:
        """Start a long-running process (service, app) and return its pid inside the workspace."""
        req = _command(cmd)
        req.update(op="spawn", env=env, cwd=cwd, user=user, log=log)
        return self._agent().request(req)[0]["pid"]

    def read_file(self, path: str) -> bytes:
        return self._agent().request({"op": "read_file", "path": path})[1][0]

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, owner: str | None = None,
                   mkdirs: bool = True) -> None:
        if isinstance(data, str):
            data = data.encode()
        self._agent().request({"op": "write_file", "path": path, "mode": mode, "owner": owner,
                               "mkdirs": mkdirs}, [data])

    def disconnect(self) -> None:
        """Drop the controller's connection; the next request reconnects."""
        if self._client is not None:
            self._client.disconnect()

    def _quiesce_agent(self, timeout: float = 5.0) -> None:
        """Drop our connection and wait until the agent has closed its end too: CRIU cannot
        dump a unix connection whose peer is outside the workspace.

        The server end of a connection accepted from the host belongs to the host's network
        namespace (the kernel creates it in the connecting socket's), so we look for
        sockets held by the workspace's processes that appear in our own namespace's table.
        """
        self.disconnect()
        deadline = time.monotonic() + timeout
        while True:
            held = _socket_inodes(self.pids())
            host = {ln.split()[6] for ln in Path("/proc/self/net/unix").read_text().splitlines()[1:]}
            if not held & host:
                return
            if time.monotonic() > deadline:
                raise WorkspaceError(f"workspace {self.id}: connections to the host stay open "
                                     f"(socket inodes {sorted(held & host)}); cannot snapshot")
            time.sleep(0.0005)

    # fork ----------------------------------------------------------------------------
    def snapshot(self, *, tags: dict | None = None, held: bool = False) -> Snapshot:
        """Freeze, dump (the source keeps running), snapshot the files, thaw.

        Args:
            tags: free-form metadata stored with the snapshot (task, tool-call signature).
            held: this process releases the snapshot when it is done with it (an env's boot
                and reset snapshots); if it dies first, ``bunshin gc`` releases it. By default
                a snapshot is kept until it is deleted.
        """
        self._check_open()
        return self._take(tags=tags, held=held)

    def _take(self, *, tags: dict | None = None, ephemeral: bool = False, held: bool = False) -> Snapshot:
        stored = forking.take(self._rec, self._p, quiesce=self._quiesce_agent, tags=tags, ephemeral=ephemeral,
                              held=held)
        return Snapshot(stored.path, stored.metadata, self._p)

    def fork(self, n: int = 1, *, mode: str | None = None) -> list[Workspace]:
        """``n`` live clones of this workspace as it is now (a snapshot, then its fork).

        The snapshot lives as long as a clone needs it and is deleted after.
        """
        self._check_open()
        snap = self._take(ephemeral=True)
        try:
            return snap.fork(n, mode=mode)
        finally:
            teardown.release_snapshot(snap.id, self._p)

    def rollback(self, snap: Snapshot | str | None = None) -> None:
        """Return in place to a snapshot's state; this handle (and its id) stays valid.

        Args:
            snap: a snapshot (or its id) of this workspace's image; default: the snapshot
                this workspace was restored from.
        """
        self._check_open()
        if snap is None:
            if not self._rec.snapshot:
                raise SnapshotError(f"workspace {self.id} was not restored from a snapshot; "
                                    "give rollback() one")
            snap = self._rec.snapshot
        if isinstance(snap, str):
            snap = SnapshotStore(self._p).get(snap)
        old = self._rec.snapshot
        # a spare made ahead (prepare_rollback) skips the restore; else the workspace stays
        # untouched until the restore beside it is up
        new, client = spares.take(self._rec, snap.id, self._p) or forking.restore_beside(self._rec, snap, self._p)
        self.disconnect()
        replaced = forking.swap_in(self._rec, new, self._p)
        self._cgroup = Cgroup(self._rec.cgroup)
        self._reclaim_later(replaced)  # the wait for them to go and the file system's deletion
        self._connect(client=client)
        if old != snap.id:
            teardown.release_snapshot(old, self._p)

    def prepare_rollback(self, snap: Snapshot | str) -> None:
        """Restore ``snap`` now, frozen, so that a later :meth:`rollback` to it (of this
        workspace or another of the same image, memory mode and limits) only thaws and swaps
        it in (:mod:`~bunshin_gym.workspace.spares`). It holds the memory of a restored clone
        until taken or discarded (``spares.discard``). This workspace is not touched.

        >>> ws.prepare_rollback(snap)      # off the critical path, e.g. while a policy thinks
        >>> ws.rollback(snap)              # thaw and swap: no CRIU restore here
        """
        self._check_open()
        if isinstance(snap, str):
            snap = SnapshotStore(self._p).get(snap)
        spares.prepare(self._rec, snap, self._p)

    @property
    def base_snapshot(self) -> str | None:
        """Id of the snapshot this workspace was restored from (None for a fresh one)."""
        return self._rec.snapshot

    # freezer and memory --------------------------------------------------------------
    def freeze(self) -> None:
        self._check_open()
        self._cgroup.freeze()

    def thaw(self) -> None:
        self._check_open()
        self._cgroup.thaw()

    def pids(self) -> list[int]:
        """Host pids of every process in the workspace."""
        self._check_open()
        return self._cgroup.pids()

    def memory(self) -> MemoryStats:
        """Sum of PSS, RSS and private bytes over the workspace's processes."""
        pids = self.pids()
        total = rollup(pids)
        return MemoryStats(pss=total["Pss"], rss=total["Rss"],
                           private=total["Private_Clean"] + total["Private_Dirty"],
                           processes=len(pids), cgroup=self._cgroup.memory_usage())


#: what a command prints when a write failed for lack of space (EDQUOT, ENOSPC)
_DISK_FULL_TEXT = (b"Disk quota exceeded", b"No space left on device")


def limits_hit(before: dict[str, int], after: dict[str, int], limits: Limits, output: bytes = b"") -> list[str]:
    """Sentences, for an observation, naming each limit a workspace hit between two
    :meth:`Workspace.limit_state` readings (``output``: what the action printed)."""
    notes = []
    if (n := after["oom_kill"] - before["oom_kill"]) > 0:
        notes.append(f"the workspace hit its memory limit ({_size(limits.memory)}): the kernel killed "
                     f"{n} process{'es' if n > 1 else ''} (out of memory)")
    if after["pids_max"] > before["pids_max"]:
        notes.append(f"the workspace hit its process limit ({limits.pids} processes and threads): "
                     "a fork was refused")
    used, cap = after.get("disk_used", 0), after.get("disk_limit", 0)
    # the kernel refuses a write that would pass the cap, so usage stops a little below it
    if cap and (used >= cap - (4 << 20) or (any(t in output for t in _DISK_FULL_TEXT) and used >= cap * 0.9)):
        notes.append(f"the workspace's disk quota is full ({_size(used)} of {_size(cap)} written): "
                     "writes fail with 'Disk quota exceeded'; delete files to free space")
    return notes


def disk_full_in(output: bytes) -> bool:
    """Whether an action's output says a write failed for lack of space (EDQUOT, ENOSPC)."""
    return any(t in output for t in _DISK_FULL_TEXT)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


class _DeathReporting:
    """An agent client whose connection failures say so when the workspace died meanwhile:
    :class:`WorkspaceClosed` (an error an env turns into an error observation), not a bare
    connection error."""

    def __init__(self, ws: Workspace, client: AgentClient):
        self._ws = ws
        self._client = client

    def request(self, header: dict, blobs: Sequence[bytes] = (), **kw) -> tuple[dict, list[bytes]]:
        try:
            return self._client.request(header, blobs, **kw)
        except AgentError:
            raise  # it ran inside the workspace and failed there
        except WorkspaceError as e:
            closed = self._ws._death_while(header.get("op"), e)
            if closed is not None:
                raise closed from e
            raise


def _command(cmd: str | Sequence[str]) -> dict:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("empty command")
        return {"cmd": cmd}
    argv = [str(a) for a in cmd]
    if not argv or not argv[0]:
        raise ValueError("empty command")
    return {"argv": argv}


def _socket_inodes(pids: list[int]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    return found


class Snapshot(StoredSnapshot):
    """A frozen, immutable state of a workspace that clones can be forked from (a snapshot
    directory of the store, :class:`~.snapshots.stored.StoredSnapshot`, plus what uses it)."""

    def fork(self, n: int = 1, *, mode: str | MemoryMode | None = None,
             detached: bool = False, _holder: bool = False) -> list[Workspace]:
        """Restore ``n`` live clones concurrently, each in fresh namespaces and its own cgroup.

        Args:
            n: number of clones.
            mode: memory mode of the clones (default: the snapshot's).
            detached: keep the clones after this process exits (CLI use).
            _holder: restore the snapshot's kmod holder (stopped before it runs; see kmod.py).
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        mode = MemoryMode.parse(mode or self.mode)
        backend = memory.backend(mode)
        forking.check_fork(self, backend)  # before anything is made
        recs = forking.clone_records(self, n, mode, detached=detached, holder=_holder)
        # spares made ahead (prepare_rollback) are clones already restored: taken first
        spare_of = {} if detached or _holder else self._take_spares(recs)
        clones = [Workspace(spare_of[rec.id][0] if rec.id in spare_of else rec, self._p) for rec in recs]
        try:
            if len(spare_of) < n:
                forking.restore_clones(self, [rec for rec in recs if rec.id not in spare_of], backend)
            for rec, ws in zip(recs, clones, strict=True):
                if not _holder:
                    ws._connect(client=spare_of[rec.id][1] if rec.id in spare_of else None)
        except BaseException as e:
            for ws in clones:
                ws.close()
            if isinstance(e, OSError):  # e.g. a file of the fork gone under it: say which fork
                raise ForkError(f"fork of {n} from snapshot {self.id} failed: {type(e).__name__}: {e}") from e
            raise
        return clones

    # usage and deletion --------------------------------------------------------------
    def users(self) -> dict[str, list[str]]:
        """Live workspaces restored from this snapshot, and child snapshots that need it."""
        return store.Store(self._p).users(self.id)

    def flatten(self) -> dict:
        """Make this snapshot need no other snapshot: take over the ancestors' page files its
        images name and rewrite the images (:mod:`bunshin_gym.workspace.snapshots.flatten`)."""
        return flatten.flatten_snapshot(self)

    def prepare_spares(self, n: int = 1, *, mode: str | MemoryMode | None = None) -> None:
        """Restore ``n`` clones now and keep them frozen, so that a later :meth:`fork` (or a
        rollback to this snapshot) takes them instead of restoring
        (:mod:`~bunshin_gym.workspace.spares`). Each holds a restored clone's memory until
        taken or discarded (deleting the snapshot discards them).

        >>> snap.prepare_spares(2)         # off the critical path
        >>> a, b, c = snap.fork(3)         # a and b were restored already: thawed, c restored
        """
        mode = MemoryMode.parse(mode or self.mode)
        forking.check_fork(self, memory.backend(mode))
        for template in forking.clone_records(self, n, mode):  # only their image, mode and limits are used
            spares.prepare(template, self, self._p)

    def _take_spares(self, recs: list[records.Record]) -> dict[str, tuple[records.Record, AgentClient]]:
        """Spares of this snapshot that fit these clone records (each with the connection its
        agent answered on), by the record each replaces."""
        taken = {}
        for rec in recs:
            spare = spares.take(rec, self.id, self._p)
            if spare is None:
                break
            taken[rec.id] = spare
        return taken

    def keep(self, by: str | os.PathLike | None = None) -> None:
        """Keep this snapshot past the process that holds it (``snapshot(held=True)``): its
        new owner deletes it when done with it. ``by``: the owner's directory; once it is
        removed, ``bunshin gc`` deletes the snapshot (nothing else would know of it)."""
        store.Store(self._p).keep(self, by)

    def delete(self) -> None:
        """Delete the snapshot; refused while a clone or a child snapshot uses it (its
        spares, restores made ahead for rollbacks, are reclaimed first)."""
        spares.discard(self.id, self._p)
        teardown.delete_snapshot(self, self._p)

    def release(self) -> None:
        """Delete the snapshot now if nothing uses it, else as soon as nothing does (it becomes
        ephemeral: the last user's close, or ``bunshin gc``, deletes it). Its spares go now."""
        spares.discard(self.id, self._p)
        teardown.release_snapshot(self, self._p)


class SnapshotStore(store.Store):
    """The snapshots on this host, as :class:`Snapshot` handles (:class:`~.snapshots.store.Store`)."""

    snapshot_type = Snapshot
