"""The env API: any registered bunshin env, made on the server and stepped over HTTP
(:class:`bunshin_gym.remote.RemoteEnv` is its client).

Requests are JSON; answers that carry observations are frames of
:mod:`bunshin_gym.serve.codec` (arrays as compressed bytes). A reset, step or rollback
request may name the large arrays its client holds (``"frames": {place: id}``): its answer
then sends those that did not change as "same" and the others as changed rows
(:mod:`bunshin_gym.serve.frames`). An env and its clones share one table of snapshots, so a
clone can roll back to a snapshot its parent took.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from bunshin_gym.config import Limits
from bunshin_gym.registration import CLASSES as ENVS
from bunshin_gym.serve import codec
from bunshin_gym.serve.auth import Principal
from bunshin_gym.serve.env_thread import EnvThread
from bunshin_gym.serve.frames import FrameStore
from bunshin_gym.serve.registry import Lease, NotFound, Registry, ServeError, json_object

log = logging.getLogger(__name__)

#: keyword arguments a client may not pass: they would run code or reach files on the server
FORBIDDEN_KWARGS = {"server", "workspace_factory", "cache", "speculation", "cache_dir", "step_log",
                    "member_wrappers"}
#: a task named by a client: a shipped task id (a path would make the server read its files)
TASK_ID = re.compile(r"[a-z][a-z0-9_]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_task(spec: Any) -> None:
    """A task given through the API is a shipped task's id or a task dict, never a path."""
    if spec is None or isinstance(spec, dict):
        return
    if not isinstance(spec, str) or not TASK_ID.fullmatch(spec) or ".." in spec or spec.endswith(".json"):
        raise ServeError(f"task {spec!r}: give a shipped task id (family/name) or a task object", 400)


@dataclass
class EnvLease(Lease):
    """One env (one workspace) held for a client."""

    env_id: str = ""
    env: Any = None
    #: snapshots by id, shared by the env and every clone of it
    snapshots: dict[str, Any] = field(default_factory=dict)
    #: the large arrays recently sent for this env (a clone's starts as a copy of its parent's)
    frames: FrameStore = field(default_factory=FrameStore)
    #: the one thread that runs this env's calls. glibc gives each thread its own malloc arena:
    #: a screenshot made and freed by whichever pool thread was free came from an arena without
    #: a free chunk of its size, ~1000 page faults (~5 ms, measured) a desktop step; on one
    #: thread its memory is reused, as in-process. The same thread reads and answers the env's
    #: local channels' requests (:mod:`bunshin_gym.serve.env_thread`)
    runner: EnvThread = field(default_factory=EnvThread)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this env's thread; NotFound once the env is closed."""
        try:
            future = self.runner.submit(fn, *args)
        except RuntimeError:  # shut down: closed meanwhile
            raise NotFound(f"no env {self.id!r}") from None
        return await asyncio.wrap_future(future)

    def reclaim(self) -> None:
        env, self.env = self.env, None
        self.frames.clear()
        self.runner.shutdown(wait=False)  # its thread ends after the call it may be running
        if env is not None:
            env.close()


@dataclass
class GroupLease(Lease):
    """A GRPO group (:class:`~bunshin_gym.rollout.group.GroupVectorEnv`) run on the server,
    its members' calls served from the owner's prefix cache when asked."""

    env_id: str = ""
    group: Any = None

    def reclaim(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


def frame(data: bytes, encode_s: float | None = None) -> Response:
    """An answer holding an encoded frame (:func:`bunshin_gym.serve.codec.encode`); the time
    its encoding took goes in a standard ``Server-Timing`` header (what the client profiles)."""
    headers = {"Server-Timing": f"encode;dur={encode_s * 1e3:.3f}"} if encode_s is not None else None
    return Response(content=data, media_type=codec.MEDIA_TYPE, headers=headers)


def bases_of(body: dict) -> dict[str, str] | None:
    """The arrays a request says its client holds ({place: id}); None when it names none
    (a client without frame deltas: whole arrays, nothing kept for it)."""
    held = body.get("frames")
    if held is None:
        return None
    if not isinstance(held, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in held.items()):
        raise ServeError("frames must be an object of array ids by place ({\"/observation/screenshot\": id})", 400)
    return held


def encode_for(lease: EnvLease, value: dict, bases: dict[str, str] | None) -> tuple[bytes, float]:
    """An env's answer, its large arrays as deltas against ``bases`` when the client names
    any (a desktop's screenshot by what the env says it drew since), and the seconds
    encoding it took."""
    t0 = time.perf_counter()
    if bases is None:
        data = codec.encode(value)
    else:
        damage = getattr(lease.env.unwrapped, "screenshot_damage", None)
        data = codec.encode(value, store=lease.frames, bases=bases,
                            damage={"/observation/screenshot": damage} if damage is not None else None)
    return data, time.perf_counter() - t0


def _locked(lease: EnvLease, fn: Callable[..., Any], *args: Any) -> Any:
    with lease.lock:
        if lease.closed:
            raise NotFound(f"no env {lease.id!r}")
        return fn(*args)


# the hot calls (an observation in the answer), shared by the HTTP routes and the env channel
# (:mod:`bunshin_gym.serve.channel`): each checks its body, then gives the work to run on the
# env's thread, which returns the encoded answer and the seconds its encoding took
def reset_work(lease: EnvLease, body: dict) -> Callable[[], tuple[bytes, float]]:
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise ServeError("options must be an object", 400)
    check_task((options or {}).get("task"))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ServeError(f"seed must be an integer, got {seed!r}", 400)
    bases = bases_of(body)

    def work() -> tuple[bytes, float]:
        obs, info = _locked(lease, lambda: lease.env.reset(seed=seed, options=options))
        return encode_for(lease, {"observation": obs, "info": info}, bases)

    return work


def step_work(lease: EnvLease, body: dict) -> Callable[[], tuple[bytes, float]]:
    if "action" not in body:
        raise ServeError("the body needs an action", 400)
    bases = bases_of(body)

    def work() -> tuple[bytes, float]:
        # the frame is encoded here too: comparing a screenshot must not hold the event loop
        obs, reward, terminated, truncated, info = _locked(lease, lease.env.step, body["action"])
        return encode_for(lease, {"observation": obs, "reward": float(reward), "terminated": bool(terminated),
                                  "truncated": bool(truncated), "info": info,
                                  "timing": getattr(lease.env, "last_step_timing", {})}, bases)

    return work


def rollback_work(lease: EnvLease, body: dict) -> Callable[[], tuple[bytes, float]]:
    snap_id, bases = body.get("snapshot"), bases_of(body)
    snap = None
    if snap_id is not None:
        snap = lease.snapshots.get(snap_id) if isinstance(snap_id, str) else None
        if snap is None:
            raise NotFound(f"no snapshot {snap_id!r} of env {lease.id} or its clones")

    def work() -> tuple[bytes, float]:
        obs = _locked(lease, lambda: lease.env.rollback(snap))
        return encode_for(lease, {"observation": obs, "steps": lease.env.unwrapped.steps}, bases)

    return work


#: the hot calls by name (what the env channel's requests name as ``op``)
HOT_CALLS: dict[str, Callable[[EnvLease, dict], Callable[[], tuple[bytes, float]]]] = {
    "reset": reset_work, "step": step_work, "rollback": rollback_work}


async def run_hot(lease: EnvLease, work: Callable[[], tuple[bytes, float]]) -> tuple[bytes, float]:
    """A hot call's work on the env's thread; then, off the answer's path, the digest of an
    array it sent to be checked (:meth:`~bunshin_gym.serve.frames.FrameStore.settle`)."""
    out = await lease.run(work)
    if lease.frames.pending():
        try:
            lease.runner.submit(lease.frames.settle)
        except RuntimeError:  # the env was closed meanwhile
            pass
    return out


def router(service) -> APIRouter:
    r = APIRouter(prefix="/envs")
    registry: Registry = service.registry
    registry_lock = threading.Lock()
    auth = Depends(service.principal)

    def _lease(env_id: str, who: Principal) -> EnvLease:
        return registry.get(env_id, who, kind=EnvLease)

    def _add(who: Principal, env_name: str, env: Any, memory: int, ttl: float | None,
             snapshots: dict, store: FrameStore | None = None) -> EnvLease:
        lease = EnvLease(id=f"env-{secrets.token_hex(8)}", owner=who,
                         end_at=None if not ttl else time.time() + ttl, idle_timeout=service.config.idle_timeout,
                         workspaces=1, memory=memory, env_id=env_name, env=env, snapshots=snapshots,
                         frames=store or FrameStore())
        return registry.add(lease)

    def _describe(lease: EnvLease) -> dict:
        env = lease.env
        return {"id": lease.id, "env_id": lease.env_id, "idle_timeout": lease.idle_timeout,
                "observation_space": codec.space_to_json(getattr(env, "observation_space", None)),
                "action_space": codec.space_to_json(getattr(env, "action_space", None)),
                "metadata": {k: v for k, v in (getattr(env, "metadata", None) or {}).items()
                             if isinstance(v, (str, int, float, bool, list))}}

    def _make(who: Principal, body: dict) -> EnvLease:
        env_name = body.get("env_id")
        if env_name not in ENVS:
            raise NotFound(f"unknown env {env_name!r}; known: {', '.join(sorted(ENVS))}")
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ServeError("kwargs must be an object", 400)
        bad = FORBIDDEN_KWARGS & set(kwargs)
        if bad:
            raise ServeError(f"kwargs {sorted(bad)} cannot be set through the server", 400)
        check_task(kwargs.get("task"))
        ttl = body.get("ttl", service.config.env_ttl)
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl < 0):
            raise ServeError(f"ttl must be a number of seconds, got {ttl!r}", 400)
        try:
            memory = Limits.parse(kwargs.get("limits")).memory
        except (TypeError, ValueError) as e:
            raise ServeError(f"limits: {e}", 400) from None
        registry.reserve(who, 1, memory)
        try:
            env = gym.make(env_name, **kwargs)
        except TypeError as e:
            registry.unreserve(who, 1, memory)
            raise ServeError(f"{env_name}: {e}", 400) from None
        except BaseException:
            registry.unreserve(who, 1, memory)
            raise
        return _add(who, env_name, env, memory, ttl, {})

    @r.post("", status_code=201)
    async def make(request: Request, who: Principal = auth) -> JSONResponse:
        lease = await asyncio.to_thread(_make, who, await json_object(request))
        log.info("env %s (%s) made for %s", lease.id, lease.env_id, who.name)
        return JSONResponse(_describe(lease), status_code=201)

    @r.get("")
    async def list_envs(who: Principal = auth) -> JSONResponse:
        return JSONResponse([{"id": x.id, "env_id": x.env_id, "kind": "env" if isinstance(x, EnvLease) else "group"}
                             for x in registry.list(who) if isinstance(x, (EnvLease, GroupLease))])

    @r.post("/{env_id}/reset")
    async def reset(env_id: str, request: Request, who: Principal = auth) -> Response:
        lease = _lease(env_id, who)
        return frame(*await run_hot(lease, reset_work(lease, await json_object(request))))

    @r.post("/{env_id}/step")
    async def step(env_id: str, request: Request, who: Principal = auth) -> Response:
        lease = _lease(env_id, who)
        return frame(*await run_hot(lease, step_work(lease, await json_object(request))))

    def _clone(lease: EnvLease, n: int, lazy: bool) -> list[EnvLease]:
        who = lease.owner
        registry.reserve(who, n, n * lease.memory)
        try:
            clones = _locked(lease, lambda: lease.env.clone(n, lazy=lazy))
        except BaseException:
            registry.unreserve(who, n, n * lease.memory)
            raise
        ttl = None if lease.end_at is None else max(1.0, lease.end_at - time.time())
        return [_add(who, lease.env_id, env, lease.memory, ttl, lease.snapshots, lease.frames.fork())
                for env in clones]

    @r.post("/{env_id}/clone", status_code=201)
    async def clone(env_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        lease = _lease(env_id, who)
        body = await json_object(request)
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise ServeError(f"n must be an integer from 1 to 256, got {n!r}", 400)
        clones = await lease.run(_clone, lease, n, bool(body.get("lazy")))
        return JSONResponse({"envs": [_describe(c) for c in clones]}, status_code=201)

    @r.post("/{env_id}/snapshot", status_code=201)
    async def snapshot(env_id: str, request: Request, who: Principal = auth) -> JSONResponse:
        lease = _lease(env_id, who)
        tags = (await json_object(request)).get("tags") or {}
        if not isinstance(tags, dict):
            raise ServeError("tags must be an object", 400)
        snap = await lease.run(_locked, lease, lambda: lease.env.snapshot(**tags))
        lease.snapshots[snap.id] = snap
        return JSONResponse({"snapshot": snap.id, "steps": snap.steps, "done": snap.done}, status_code=201)

    @r.post("/{env_id}/rollback")
    async def rollback(env_id: str, request: Request, who: Principal = auth) -> Response:
        lease = _lease(env_id, who)
        return frame(*await run_hot(lease, rollback_work(lease, await json_object(request))))

    # groups ------------------------------------------------------------------------------
    caches: dict[str, Any] = {}  # owner -> PrefixCache: shared by an owner's groups, across epochs

    def _cache(who: Principal):
        from bunshin_gym.rollout import PrefixCache, TrajectoryLog

        with registry_lock:
            if who.name not in caches:
                root = service.config.state_path / "prefix-cache" / who.name
                # the cache logs every call: what the owner's speculation selector learns from
                caches[who.name] = PrefixCache(root, log=TrajectoryLog(root / "log.jsonl"))
            return caches[who.name]

    def _speculation(who: Principal):
        """Speculation with a selector trained on the owner's trajectory log so far (None while
        it is empty: nothing to predict from); trained again for each group, so later groups
        learn from earlier ones, as the rollout engine's epochs do."""
        from bunshin_gym.rollout import SpecToolSelector, Speculation, TrajectoryLog

        log_path = _cache(who).log.path
        entries = TrajectoryLog.load(log_path) if log_path.exists() else []
        if not entries:
            return None
        return Speculation(SpecToolSelector.train(entries), durations=TrajectoryLog.durations(entries),
                           episode_times=TrajectoryLog.episode_times(entries))

    def _make_group(who: Principal, body: dict) -> GroupLease:
        from bunshin_gym.rollout.group import GroupVectorEnv

        env_name, kwargs = body.get("env_id"), body.get("kwargs") or {}
        if env_name not in ENVS:
            raise NotFound(f"unknown env {env_name!r}; known: {', '.join(sorted(ENVS))}")
        if not isinstance(kwargs, dict) or FORBIDDEN_KWARGS & set(kwargs):
            raise ServeError(f"kwargs must be an object without {sorted(FORBIDDEN_KWARGS)}", 400)
        check_task(kwargs.get("task"))
        n = body.get("num_envs")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise ServeError(f"num_envs must be an integer from 1 to 256, got {n!r}", 400)
        memory = Limits.parse(kwargs.get("limits")).memory
        registry.reserve(who, n + 1, (n + 1) * memory)
        try:
            if not isinstance(body.get("speculation", False), bool):
                raise ServeError("speculation must be true or false", 400)
            cache = _cache(who) if body.get("prefix_cache") else None
            spec = _speculation(who) if body.get("speculation") else None
            group = GroupVectorEnv(env_name, n, cache=cache, speculation=spec, **kwargs)
        except TypeError as e:
            registry.unreserve(who, n + 1, (n + 1) * memory)
            raise ServeError(f"{env_name}: {e}", 400) from None
        except BaseException:
            registry.unreserve(who, n + 1, (n + 1) * memory)
            raise
        lease = GroupLease(id=f"grp-{secrets.token_hex(8)}", owner=who, end_at=time.time() + service.config.env_ttl
                           if service.config.env_ttl else None, idle_timeout=service.config.idle_timeout,
                           workspaces=n + 1, memory=(n + 1) * memory, env_id=env_name, group=group)
        return registry.add(lease)

    @r.post("/groups", status_code=201)
    async def make_group(request: Request, who: Principal = auth) -> JSONResponse:
        lease = await asyncio.to_thread(_make_group, who, await json_object(request))
        return JSONResponse({"id": lease.id, "env_id": lease.env_id, "num_envs": lease.group.num_envs,
                             "idle_timeout": lease.idle_timeout}, status_code=201)

    @r.post("/groups/{group_id}/reset")
    async def group_reset(group_id: str, request: Request, who: Principal = auth) -> Response:
        lease = registry.get(group_id, who, kind=GroupLease)
        body = await json_object(request)
        def work() -> bytes:
            obs, info = _locked(lease, lambda: lease.group.reset(options=body.get("options")))
            return codec.encode({"observation": obs, "info": info})

        return frame(await asyncio.to_thread(work))

    @r.post("/groups/{group_id}/step")
    async def group_step(group_id: str, request: Request, who: Principal = auth) -> Response:
        lease = registry.get(group_id, who, kind=GroupLease)
        actions = (await json_object(request)).get("actions")
        if not isinstance(actions, list) or len(actions) != lease.group.num_envs:
            raise ServeError(f"actions must be a list of {lease.group.num_envs} actions", 400)
        def work() -> bytes:
            obs, rewards, terms, truncs, infos = _locked(lease, lease.group.step, actions)
            cache, spec = lease.group.cache, lease.group.speculation
            return codec.encode({"observation": obs, "reward": rewards, "terminated": terms, "truncated": truncs,
                                 "info": infos, "cache": vars(cache.stats) if cache is not None else None,
                                 "speculation": vars(spec.stats) if spec is not None else None})

        return frame(await asyncio.to_thread(work))

    @r.delete("/groups/{group_id}", status_code=204)
    async def close_group(group_id: str, who: Principal = auth) -> Response:
        registry.get(group_id, who, kind=GroupLease)
        await asyncio.to_thread(registry.close, group_id, why="closed by its owner")
        return Response(status_code=204)

    @r.post("/{env_id}/keepalive", status_code=204)
    async def keepalive(env_id: str, who: Principal = auth) -> Response:
        _lease(env_id, who)  # touches it
        return Response(status_code=204)

    @r.delete("/{env_id}", status_code=204)
    async def close(env_id: str, who: Principal = auth) -> Response:
        _lease(env_id, who)
        await asyncio.to_thread(registry.close, env_id, why="closed by its owner")
        return Response(status_code=204)

    return r
