"""``RemoteEnv``: a bunshin env that runs on a ``bunshin serve`` server, stepped over its env
channel (a WebSocket), HTTP for everything else.

    >>> env = gym.make("Bunshin-Shell-v0", server="http://127.0.0.1:49982", token="...")
    >>> obs, info = env.reset(options={"task": "shell/count-files"})
    >>> a, b = env.clone(2)                 # forks on the server, each a RemoteEnv
    >>> snap = env.snapshot(); env.rollback(snap)

It is a ``gymnasium.Env`` with the local envs' ``clone()``, ``snapshot()`` and
``rollback()``. Observations come back byte-for-byte as they are locally, arrays as read-only
numpy arrays: they travel zstd-compressed (:mod:`bunshin_gym.serve.codec`) and, once the env
holds a large array (a screenshot), as its changed rows only, or as "unchanged" (the same
array object comes back; :mod:`bunshin_gym.serve.frames`). Reset, step and rollback go over
the env's channel, kept open (:mod:`bunshin_gym.remote_channel`): on the server's host a Unix
socket served on the env's own thread, else a WebSocket (``channel="websocket"``: always;
``channel=False`` or a server without channels: HTTP, as every other call). The token is ``token=`` or
``$BUNSHIN_SERVE_TOKEN``. While open, a RemoteEnv tells the server it is alive every third of
the server's idle timeout; an env whose client is gone is reclaimed by the server once idle.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import gymnasium as gym
import httpx
import urllib3

from bunshin_gym import config
from bunshin_gym.errors import BunshinError, ResetNeeded
from bunshin_gym.remote_channel import Channel, ChannelError, ChannelRefusal, ChannelUnavailable, LocalChannel
from bunshin_gym.serve import codec
from bunshin_gym.serve.frames import HeldFrames

log = logging.getLogger(__name__)

#: seconds between keepalives at most (a third of the server's idle timeout when shorter)
KEEPALIVE_S = 60.0
#: connections a RemoteEnv and its clones keep open to the server
POOL_SIZE = 128


class RemoteError(BunshinError, RuntimeError):
    """The server refused a request or could not be reached; the message is the server's."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RemoteSnapshot:
    """A snapshot held by the server for an env and its clones."""

    id: str
    steps: int
    done: bool


class _Connection:
    """One HTTP connection pool shared by an env and its clones.

    urllib3, not httpx: a step's round trip through it took ~1.4 ms less at load 8 (5.7 vs
    7.1 ms over the server's own step time, shell env, interleaved), a fifth of what the
    server added. Nothing is retried: a request that may have reached the server (a step)
    must not run twice. A pooled connection the server closed meanwhile (its keep-alive is
    75 s) is found dropped before reuse and replaced.
    """

    def __init__(self, server: str, token: str | None, timeout: float):
        token = token or config.get("BUNSHIN_SERVE_TOKEN")
        if not token:
            raise RemoteError("a RemoteEnv needs a token: token=... or $BUNSHIN_SERVE_TOKEN")
        url = urlsplit(server.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise RemoteError(f"server must be an http:// or https:// URL, not {server!r}")
        self.server, self.token, self.timeout = server, token, timeout  # what a pickled env reconnects with
        self._prefix = url.path
        self._headers = {"Authorization": f"Bearer {token}"}
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        # one connection per thread that steps at once (64 clients share one env's pool in the bench)
        self.http = urllib3.connection_from_url(server, maxsize=POOL_SIZE, block=False, retries=False,
                                                timeout=urllib3.Timeout(connect=timeout, read=timeout))
        self.users = 0
        self.lock = threading.Lock()
        self._local: str | None | bool = False  # the local channel's socket name; False: not asked yet

    def local_channel(self) -> str | None:
        """The name of the server's local-channel socket (asked once), or None: a server
        without one."""
        if self._local is False:
            try:
                name = self.request("GET", "/channel/local")["abstract_socket"]
            except (RemoteError, KeyError, TypeError) as e:
                log.info("%s offers no local channel (%s): WebSocket channels", self.server, e)
                name = None
            self._local = name if isinstance(name, str) and name else None
        return self._local

    def request(self, method: str, path: str, body: dict | None = None, held: HeldFrames | None = None,
                timing: dict[str, float] | None = None) -> Any:
        """One request; its answer's value. ``held``: the frames deltas apply to; ``timing``
        gets where the time went: ``request_s`` (the whole call), ``decode_s`` (here) and
        ``encode_s`` (on the server, from its Server-Timing header)."""
        t0 = time.perf_counter()
        # ASCII JSON: a lone surrogate in an action travels escaped and is the env's to refuse
        data = None if body is None else json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        try:
            r = self.http.request(method, self._prefix + path, body=data, redirect=False,
                                  headers=self._headers if data is None else self._json_headers)
        except urllib3.exceptions.HTTPError as e:
            raise RemoteError(f"{method} {path}: the server could not be reached: {e}") from None
        content = r.data
        if r.status >= 400:
            try:
                error = json.loads(content)
            except ValueError:
                error = None
            error = error if isinstance(error, dict) else {}
            message = error.get("message") or content.decode(errors="replace")
            if r.status == 409 and error.get("error") == "ResetNeeded":
                raise ResetNeeded(message)  # as the local env raises it: a step after the episode's end
            raise RemoteError(f"{method} {path}: {r.status}: {message}", r.status)
        if not r.headers.get("content-type", "").startswith(codec.MEDIA_TYPE):
            return json.loads(content) if content else None
        t1 = time.perf_counter()
        value = codec.decode(content, held)
        if timing is not None:
            done = time.perf_counter()
            timing.update(request_s=done - t0, decode_s=done - t1, **_server_timing(r.headers.get("server-timing")))
        return value

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                self.http.close()


class RemoteEnv(gym.Env):
    """An env made and stepped on a bunshin server.

    Args:
        env_id: a registered bunshin env id (``Bunshin-Shell-v0``, ...).
        server: the server's URL.
        token: the API key (default ``$BUNSHIN_SERVE_TOKEN``).
        timeout: seconds one request may take (a reset of a desktop task takes many).
        ttl: seconds the server keeps the env at most (default: the server's).
        frame_deltas: receive a large array the env already sent as its changes only (default);
            False: whole arrays in every answer.
        channel: reset, step and rollback over a channel kept open to the env: True (default)
            a local one (a Unix socket served on the env's own thread) where the server is on
            this host, else a WebSocket; ``"websocket"``: a WebSocket always; False: over HTTP
            like every other call.
        **kwargs: the env's own keyword arguments (``task``, ``limits``, ...).
    """

    metadata = {"render_modes": []}

    def __init__(self, env_id: str, server: str, *, token: str | None = None, timeout: float = 600.0,
                 ttl: float | None = None, frame_deltas: bool = True, channel: bool | str = True,
                 _attach: tuple[_Connection, dict] | None = None, _held: HeldFrames | None = None, **kwargs: Any):
        self.env_id = env_id
        self.server = server
        if channel not in (True, False, "websocket"):
            raise RemoteError(f'channel must be True, False or "websocket", not {channel!r}')
        #: the env's channel: None until the first hot call opens it, or when not used
        self._channel: Channel | LocalChannel | None = None
        self._use_channel = channel
        #: the large arrays this handle received last, by place: the bases of the next answer's deltas
        self._held: HeldFrames | None = (_held or HeldFrames()) if frame_deltas else None
        if _attach is not None:
            self._conn, desc = _attach
        else:
            self._conn = _Connection(server, token, timeout)
            body: dict[str, Any] = {"env_id": env_id, "kwargs": kwargs}
            if ttl is not None:
                body["ttl"] = ttl
            try:
                desc = self._conn.request("POST", "/envs", body)
            except BaseException:
                self._conn.http.close()
                raise
        with self._conn.lock:
            self._conn.users += 1
        # the connection is released once: by close()/detach(), else when the env is collected
        self._release = weakref.finalize(self, self._conn.release)
        self.remote_id: str = desc["id"]
        self.observation_space = codec.space_from_json(desc["observation_space"]) or gym.spaces.Space()
        self.action_space = codec.space_from_json(desc["action_space"]) or gym.spaces.Space()
        self._desc = desc
        self._closed = False
        #: timings of the last step: the server's own (``step_s``, ...), the server's encoding of
        #: the answer (``encode_s``), its decoding here (``decode_s``), the whole call (``request_s``) and,
        #: over the channel, the server's time on the request from receipt to answer (``server_s``)
        self.last_step_timing: dict[str, float] = {}
        self._stop = threading.Event()
        idle = desc.get("idle_timeout") or 0
        every = min(KEEPALIVE_S, idle / 3) if idle else KEEPALIVE_S
        self._keepalive = threading.Thread(target=_keepalive, args=(weakref.ref(self), self._stop, every),
                                           name=f"remote-env-{self.remote_id}", daemon=True)
        self._keepalive.start()

    def _call(self, method: str, what: str, body: dict | None = None) -> Any:
        if self._closed:
            raise RemoteError(f"RemoteEnv {self.remote_id} is closed")
        path = f"/envs/{self.remote_id}" + (f"/{what}" if what else "")
        return self._conn.request(method, path, body)

    def _observe(self, what: str, body: dict, timing: dict | None = None) -> dict:
        """A request whose answer carries an observation: it names the arrays held here.
        Over the env's channel unless it is off; HTTP for a server that has none."""
        if self._closed:
            raise RemoteError(f"RemoteEnv {self.remote_id} is closed")
        if self._held is not None:
            body = {**body, "frames": self._held.ids()}
        if self._use_channel:
            if self._channel is None:
                self._channel = self._new_channel(local=self._use_channel is True)
            prepare = self._held.prepare if self._held is not None else None
            t0 = time.perf_counter()
            try:
                try:
                    data, server_s, encode_s = self._channel.call(what, body, prepare)
                except ChannelUnavailable as e:
                    # not on the server's host (or not in its network namespace): nothing was sent
                    log.info("%s: %s; a WebSocket channel instead", self.remote_id, e)
                    self._use_channel = "websocket"
                    self._channel = self._new_channel(local=False)
                    data, server_s, encode_s = self._channel.call(what, body, prepare)
            except ChannelRefusal as e:
                if e.status == 409 and e.error == "ResetNeeded":
                    raise ResetNeeded(str(e)) from None  # as the local env raises it
                raise RemoteError(f"{what}: {e.status}: {e}", e.status) from None
            except ChannelError as e:
                if e.status != 403:
                    raise RemoteError(f"{what}: {e}", e.status) from None
                # refused before anything was sent: a server without env channels
                log.info("%s has no env channel (%s): HTTP from now on", self.server, e)
                self._use_channel = False
            else:
                t1 = time.perf_counter()
                value = codec.decode(data, self._held)
                if timing is not None:
                    done = time.perf_counter()
                    timing.update(request_s=done - t0, decode_s=done - t1, server_s=server_s, encode_s=encode_s)
                return value
        return self._conn.request("POST", f"/envs/{self.remote_id}/{what}", body, self._held, timing)

    def _new_channel(self, local: bool) -> Channel | LocalChannel:
        conn = self._conn
        name = conn.local_channel() if local else None
        channel: Channel | LocalChannel
        if name is not None:
            channel = LocalChannel(name, self.remote_id, conn.token, conn.timeout)
        else:
            channel = Channel(conn.server, self.remote_id, conn.token, conn.timeout)
        weakref.finalize(self, channel.close)
        return channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()

    # gymnasium API ---------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        out = self._observe("reset", {"seed": seed, "options": options})
        return out["observation"], out["info"]

    def step(self, action: Any):
        timing: dict[str, float] = {}
        out = self._observe("step", {"action": action}, timing)
        # the server's own timing of the step (step_s, ...), and where the rest went
        self.last_step_timing = {**(out.get("timing") or {}), **timing}
        return out["observation"], out["reward"], out["terminated"], out["truncated"], out["info"]

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        self._close_channel()
        try:
            self._call("DELETE", "")
        except RemoteError as e:
            if e.status != 404:  # already reaped is fine; anything else is worth a line
                log.warning("closing remote env %s: %s", self.remote_id, e)
        finally:
            self._closed = True
            self._release()
        super().close()

    def detach(self) -> None:
        """Drop this handle without closing the env on the server (another handle, or a later
        :meth:`attach`, goes on using it): keepalives stop, the connection is released."""
        if not self._closed:
            self._stop.set()
            self._close_channel()
            self._closed = True
            self._release()

    # handles in other processes (Ray workers) --------------------------------------------
    def __reduce__(self):
        """A RemoteEnv pickles as what reattaches to the same env on the server: its URL, id,
        description and token (the token travels with it: pickle it only where the token may
        go). The copy is the same env: ``close()`` on any handle ends it for all; a worker
        done with its copy lets it go (or calls :meth:`detach`)."""
        if self._closed:
            raise RemoteError(f"RemoteEnv {self.remote_id} is closed: there is nothing to reattach to")
        conn = self._conn
        return _reattach, (self.env_id, conn.server, conn.token, conn.timeout, self._desc)

    @classmethod
    def attach(cls, env_id: str, server: str, remote_id: str, *, token: str | None = None,
               timeout: float = 600.0, frame_deltas: bool = True, channel: bool | str = True) -> RemoteEnv:
        """A handle on env ``remote_id`` already made on ``server`` (by this token's owner),
        e.g. in another process. Its spaces are those of ``env_id``'s local registration."""
        conn = _Connection(server, token, timeout)
        try:
            conn.request("POST", f"/envs/{remote_id}/keepalive")  # there, and ours
            probe = gym.make(env_id)  # no workspace until reset: only the spaces are read
            try:
                spaces = {"observation_space": codec.space_to_json(probe.observation_space),
                          "action_space": codec.space_to_json(probe.action_space)}
            finally:
                probe.close()
        except BaseException:
            conn.http.close()
            raise
        return cls(env_id, server, _attach=(conn, {"id": remote_id, **spaces}), frame_deltas=frame_deltas,
                   channel=channel)

    # fork API --------------------------------------------------------------------------
    def clone(self, n: int = 1, *, lazy: bool = False) -> list[RemoteEnv]:
        """``n`` envs forked on the server from this one's live state."""
        out = self._call("POST", "clone", {"n": n, "lazy": lazy})
        # a clone's frame store on the server starts as a copy of this env's: so may its bases here
        return [RemoteEnv(self.env_id, self.server, _attach=(self._conn, d), frame_deltas=self._held is not None,
                          channel=self._use_channel, _held=self._held.copy() if self._held is not None else None)
                for d in out["envs"]]

    def snapshot(self, **tags: Any) -> RemoteSnapshot:
        out = self._call("POST", "snapshot", {"tags": tags})
        return RemoteSnapshot(out["snapshot"], out["steps"], out["done"])

    def rollback(self, snapshot: RemoteSnapshot | None = None) -> Any:
        """Back to a snapshot (default: right after the last reset); returns its observation."""
        out = self._observe("rollback", {"snapshot": snapshot.id if snapshot else None})
        return out["observation"]

    def __repr__(self) -> str:
        return f"<RemoteEnv {self.env_id} {self.remote_id} on {self.server}>"


def _reattach(env_id: str, server: str, token: str, timeout: float, desc: dict) -> RemoteEnv:
    """Unpickle a RemoteEnv: a new connection to the same env on the server."""
    return RemoteEnv(env_id, server, _attach=(_Connection(server, token, timeout), desc))


class RemoteGroup:
    """A GRPO group run on the server (:class:`~bunshin_gym.rollout.group.GroupVectorEnv`):
    the task set up once, ``num_envs`` forked members, each member's calls served from the
    owner's prefix cache on the server when ``prefix_cache=True`` (it persists across groups),
    and each member's next call speculated on the server while the caller's policy thinks when
    ``speculation=True`` (a selector trained on the owner's trajectory log, which the owner's
    prefix-cached groups write; nothing is speculated before that log has trajectories).

    ``reset(options)`` gives the batched observation; ``step(actions)`` one action per member
    (finished members are skipped, as locally); ``cache_stats`` and ``speculation_stats`` the
    server's counters after the last step.
    """

    def __init__(self, env_id: str, num_envs: int, server: str, *, token: str | None = None,
                 prefix_cache: bool = False, speculation: bool = False, timeout: float = 600.0, **kwargs: Any):
        self._conn = _Connection(server, token, timeout)
        self._conn.users = 1
        try:
            desc = self._conn.request("POST", "/envs/groups", {"env_id": env_id, "num_envs": num_envs,
                                                                "kwargs": kwargs, "prefix_cache": prefix_cache,
                                                                "speculation": speculation})
        except BaseException:
            self._conn.release()
            raise
        self.remote_id, self.num_envs = desc["id"], desc["num_envs"]
        self.cache_stats: dict | None = None
        self.speculation_stats: dict | None = None

    def reset(self, *, options: dict | None = None):
        out = self._conn.request("POST", f"/envs/groups/{self.remote_id}/reset", {"options": options})
        return out["observation"], out["info"]

    def step(self, actions: list):
        out = self._conn.request("POST", f"/envs/groups/{self.remote_id}/step", {"actions": list(actions)})
        self.cache_stats, self.speculation_stats = out["cache"], out.get("speculation")
        return out["observation"], out["reward"], out["terminated"], out["truncated"], out["info"]

    def close(self) -> None:
        if self._conn.users:
            try:
                self._conn.request("DELETE", f"/envs/groups/{self.remote_id}")
            finally:
                self._conn.release()


def _server_timing(header: str | None) -> dict[str, float]:
    """``encode;dur=1.234, x;dur=5`` -> {"encode_s": 0.001234, "x_s": 0.005}; what is not
    understood is left out (the header is informative only)."""
    out = {}
    for metric in (header or "").split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[f"{name}_s"] = float(value) / 1e3
                except ValueError:
                    pass
    return out


def wait_for_server(url: str, proc=None, timeout: float = 60.0) -> None:
    """Wait until ``bunshin serve`` at ``url`` answers its health check; RemoteError if it
    does not within ``timeout`` seconds or its process (``proc``, a Popen) exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 204:
                return
        except httpx.TransportError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise RemoteError(f"the server at {url} did not start")
        time.sleep(0.1)


def _keepalive(ref: weakref.ref, stop: threading.Event, every: float) -> None:
    """Tell the server the env is in use while its client lives (holds no strong reference:
    a dropped, unclosed RemoteEnv stops its keepalives and the server reaps it)."""
    while not stop.wait(every):
        env = ref()
        if env is None or env._closed:
            return
        try:
            env._call("POST", "keepalive")
        except RemoteError as e:
            log.warning("keepalive of remote env %s: %s", env.remote_id, e)
        del env
