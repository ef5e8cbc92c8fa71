"""``bunshin bench serve``: what ``bunshin serve`` adds over calling the library in-process.

- shell step latency: the same shell env and action (``true``) in-process, as a RemoteEnv
  over its env channel (the default: on this host a local channel, a Unix socket served on
  the env's own thread), over a WebSocket channel (``channel="websocket"``, the default for
  a client on another host) and over HTTP (``channel=False``, the path before channels),
  rounds interleaved; the goal is at most 5 ms added at the median. The round trips of an
  authenticated HTTP no-op request and of a message each channel's server refuses at once
  are measured too (what each transport costs);
- desktop step latency: an OSWorld computer_13 step (action + 1920x1080 screenshot)
  in-process, over the local channel (screenshots as the rectangles X says were drawn), over
  a WebSocket channel, over HTTP, and over the local channel receiving whole screenshots
  (``frame_deltas=False``, what deltas save), rounds interleaved; the goal is a remote
  median at most 1.2x the in-process one. The steps are a mouse move and a shift key, which
  draw nothing (no pixels travel); the same is measured alternated step by step, and for
  steps that draw (a character typed into the editor, then erased: a few rows travel).
  Where the remote time goes is measured at both ends: the env's step in the server, the
  server's encoding of the answer, the rest of the server's time on the request (channels:
  parsing it; over a WebSocket also the hop to the env's thread and back), the client's decoding, and the rest
  (the transport and the client);
- fork of 16: ``Sandbox.fork(count=16)`` through the E2B SDK against ``snapshot().fork(16)``
  of a workspace in-process (one freeze, 16 copies, both);
- throughput: 64 client threads, each stepping its own RemoteEnv (a clone of one env) as fast
  as answers come, for a fixed time: steps per second held by one server, and errors.

The server runs as its own process (``python -m bunshin_gym.serve``) on a free loopback port.

Example:
    >>> from bunshin_gym.bench import serve
    >>> serve.run("bench/results/serve.json")
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium as gym

from bunshin_gym.bench.report import summary, table, write
from bunshin_gym.remote import RemoteError, wait_for_server

SHELL_TASK = "shell/count-files"
DESKTOP_TASK = "osworld/editor-append-item"
#: a desktop step that draws (the editor task has its file open and focused), then one that
#: takes it back: each changes a few rows of the screenshot
DRAWING_ACTIONS = ({"action_type": "TYPING", "text": "x"}, {"action_type": "PRESS", "key": "backspace"})


class _Server:
    def __init__(self, tmp: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = "bench-" + os.urandom(12).hex()
        (tmp / "tokens.json").write_text(json.dumps({"tokens": [{"token": self.token, "name": "bench"}]}))
        self.log = open(tmp / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bunshin_gym.serve", "--port", str(self.port), "--token-file",
             str(tmp / "tokens.json"), "--state-dir", str(tmp / "state"), "--close-on-exit", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for_server(self.url, self.proc, timeout=300)  # a loaded 2-core host imports slowly
        except RemoteError as e:
            raise RuntimeError(f"{e}; see {tmp / 'server.log'}") from None

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _steps(env: gym.Env, actions: list, timings: list[float], parts: list[dict] | None = None) -> None:
    for a in actions:
        t0 = time.perf_counter()
        _, _, _, _, info = env.step(a)
        timings.append(time.perf_counter() - t0)
        if parts is not None:
            parts.append(dict(env.unwrapped.last_step_timing))
        if "error" in info:
            raise RuntimeError(f"step {a!r} failed: {info['error']}")


def _call(fn, *args):
    return fn(*args)


class _OwnThread:
    """Runs the in-process env's calls on a thread of their own, as the server runs each
    env's (``EnvLease.runner``): glibc gives each thread its own malloc arena, and a desktop
    env sharing the bench's main thread with the remote handles' 6 MB frames took page
    faults it does not take alone (8.5 vs 3.8 ms a step, measured). Timed on that thread."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, "bench-in-process")

    def __call__(self, fn, *args):
        return self._pool.submit(fn, *args).result()

    def close(self) -> None:
        self._pool.shutdown()


def breakdown(parts: list[dict]) -> dict:
    """What the server added to each remote step, the step's own time taken away (median
    ``request - step``, and of ``request / step``: not thrown off by a baseline measured on
    other steps), and medians (ms) of where a remote step's time went: the env's step in the server
    (``server_step``), encoding the answer there, the rest of the server's time on the
    request (channel only: its ``server_s`` less those two), decoding it here, and the rest
    of the call (the transport and the client; over HTTP also the server's routing and
    thread hop, which it does not time): ``request - server - decode``."""
    def med(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 3)

    keys = ("step_s", "encode_s", "decode_s", "request_s")
    parts = [p for p in parts if all(k in p for k in keys)]
    if not parts:
        return {}
    server = [p.get("server_s", p["step_s"] + p["encode_s"]) for p in parts]
    return {"added_ms": med([p["request_s"] - p["step_s"] for p in parts]),
            "ratio_to_own_step": round(statistics.median(p["request_s"] / p["step_s"] for p in parts), 3),
            "server_step_ms": med([p["step_s"] for p in parts]),
            "server_encode_ms": med([p["encode_s"] for p in parts]),
            # over HTTP the server does not time the request as a whole: its other time is in the rest
            "server_other_ms": med([s - p["step_s"] - p["encode_s"] for s, p in zip(server, parts, strict=True)])
            if all("server_s" in p for p in parts) else None,
            "client_decode_ms": med([p["decode_s"] for p in parts]),
            "transport_and_client_ms": med([p["request_s"] - s - p["decode_s"]
                                            for s, p in zip(server, parts, strict=True)])}


def _round_trips(remote, websocket, n: int) -> tuple[list[float], list[float], list[float]]:
    """Round trips of an authenticated HTTP no-op (a keepalive) and of a message the server
    refuses at once (an unknown op) over ``remote``'s channel and ``websocket``'s, interleaved."""
    from bunshin_gym.remote_channel import ChannelRefusal

    http, channel, ws = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        remote._call("POST", "keepalive")
        http.append(time.perf_counter() - t0)
        for env, ts in ((remote, channel), (websocket, ws)):
            t0 = time.perf_counter()
            try:
                env._channel.call("nop", {})
            except ChannelRefusal:
                pass
            ts.append(time.perf_counter() - t0)
    return http, channel, ws


def shell_step(server: _Server, steps: int, rounds: int) -> dict:
    local = gym.make("Bunshin-Shell-v0", max_steps=10**6)
    remote = gym.make("Bunshin-Shell-v0", server=server.url, token=server.token, max_steps=10**6)
    ws = gym.make("Bunshin-Shell-v0", server=server.url, token=server.token, channel="websocket", max_steps=10**6)
    http = gym.make("Bunshin-Shell-v0", server=server.url, token=server.token, channel=False, max_steps=10**6)
    envs = (local, remote, ws, http)
    times: tuple[list[float], ...] = ([], [], [], [])
    own = _OwnThread()
    try:
        own(lambda: local.reset(options={"task": SHELL_TASK}))
        for env in envs[1:]:
            env.reset(options={"task": SHELL_TASK})
        actions = ["true"] * steps
        for env in envs:
            (own if env is local else _call)(_steps, env, actions[:3], [])  # warm: connections, first requests
        for _ in range(rounds):
            for env, ts in zip(envs, times, strict=True):
                (own if env is local else _call)(_steps, env, actions, ts)
        floor_http, floor_channel, floor_ws = _round_trips(remote.unwrapped, ws.unwrapped, steps * rounds)
        channel_kind = type(remote.unwrapped._channel).__name__
    finally:
        for env in envs:
            env.close()
        own.close()
    out = {"in_process": summary(times[0]), "remote": summary(times[1]), "remote_websocket": summary(times[2]),
           "remote_http": summary(times[3]), "channel": channel_kind, "http_round_trip": summary(floor_http),
           "channel_round_trip": summary(floor_channel), "websocket_round_trip": summary(floor_ws)}
    out["added_median_ms"] = round(out["remote"]["median_ms"] - out["in_process"]["median_ms"], 3)
    out["added_median_ms_websocket"] = round(out["remote_websocket"]["median_ms"] - out["in_process"]["median_ms"], 3)
    out["added_median_ms_http"] = round(out["remote_http"]["median_ms"] - out["in_process"]["median_ms"], 3)
    out["goal_added_median_ms"] = 5.0
    return out


def desktop_step(server: _Server, steps: int, rounds: int) -> dict:
    kwargs = dict(action_space="computer_13", require_a11y_tree=False, max_steps=10**6)
    remote_kw = dict(server=server.url, token=server.token, **kwargs)
    names = ("in_process", "remote", "remote_websocket", "remote_http", "remote_whole_frames")
    envs = (gym.make("Bunshin-OSWorld-v0", **kwargs), gym.make("Bunshin-OSWorld-v0", **remote_kw),
            gym.make("Bunshin-OSWorld-v0", channel="websocket", **remote_kw),
            gym.make("Bunshin-OSWorld-v0", channel=False, **remote_kw),
            gym.make("Bunshin-OSWorld-v0", frame_deltas=False, **remote_kw))
    times: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list[dict]] = {n: [] for n in names[1:]}
    own = _OwnThread()
    local = envs[0]
    try:
        own(lambda: local.reset(options={"task": DESKTOP_TASK}))
        for env in envs[1:]:
            env.reset(options={"task": DESKTOP_TASK})
        actions = [{"action_type": "MOVE_TO", "x": 200 + 40 * (i % 20), "y": 700 + 10 * (i % 7)} if i % 2 else
                   {"action_type": "PRESS", "key": "shift"} for i in range(steps)]
        for env in envs:  # warm: connections, first requests, the first whole frame
            (own if env is local else _call)(_steps, env, actions[:3], [])
        for _ in range(rounds):
            for name, env in zip(names, envs, strict=True):
                (own if env is local else _call)(_steps, env, actions, times[name], parts.get(name))
        # the same steps alternated one by one, in-process then through the local channel: each
        # pair shares the host's moment, and each call starts with caches the other step used, as
        # a training loop's calls do (between them the policy runs); blocks of 20 steps of one
        # env measured 1.13x-1.53x on the same quiet host, pairs 1.27x-1.33x
        paired: dict[str, list[float]] = {"in_process": [], "remote": []}
        for _ in range(rounds):
            for a in actions:
                own(_steps, local, [a], paired["in_process"])
                _steps(envs[1], [a], paired["remote"])
        # steps that draw: a character typed into the editor, then taken back, so pixels
        # change and travel as rectangles (the steps above draw nothing: no pixels travel)
        drawing: dict[str, list[float]] = {"in_process": [], "remote": []}
        drawing_parts: list[dict] = []
        for _ in range(rounds):
            for a in DRAWING_ACTIONS * (steps // 2 or 1):
                own(_steps, local, [a], drawing["in_process"])
                _steps(envs[1], [a], drawing["remote"], drawing_parts)
    finally:
        for env in envs:
            env.close()
        own.close()
    out: dict = {name: summary(times[name]) for name in names}
    for name in names[1:]:
        out[f"{name}_breakdown"] = breakdown(parts[name])
    local_ms = out["in_process"]["median_ms"]
    out["ratio_median"] = round(out["remote"]["median_ms"] / local_ms, 3)
    out["ratio_median_websocket"] = round(out["remote_websocket"]["median_ms"] / local_ms, 3)
    out["ratio_median_http"] = round(out["remote_http"]["median_ms"] / local_ms, 3)
    out["ratio_median_whole_frames"] = round(out["remote_whole_frames"]["median_ms"] / local_ms, 3)
    out["goal_ratio_median"] = 1.2
    out["paired"] = _pairs(paired)
    out["paired_drawing"] = dict(_pairs(drawing), remote_breakdown=breakdown(drawing_parts))
    return out


def _pairs(times: dict[str, list[float]]) -> dict:
    """Steps alternated one by one in-process and remote: both sides' summaries and the median
    of the pairs' ratios."""
    return {"in_process": summary(times["in_process"]), "remote": summary(times["remote"]),
            "median_of_ratios": round(statistics.median(
                r / i for i, r in zip(times["in_process"], times["remote"], strict=True)), 3)}


def fork16(server: _Server, n: int, rounds: int) -> dict:
    from e2b import Sandbox

    from bunshin_gym.workspace import Workspace

    opts = {"api_url": server.url, "sandbox_url": server.url, "api_key": server.token}
    api, local = [], []
    sb = Sandbox.create("base", **opts)
    ws = Workspace.create("base")
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            forks = sb.fork(count=n)
            api.append(time.perf_counter() - t0)
            bad = [f for f in forks if isinstance(f, Exception)]
            for f in forks:
                if not isinstance(f, Exception):
                    f.kill()
            if bad:
                raise RuntimeError(f"{len(bad)} of {n} forks failed: {bad[0]}")
            t0 = time.perf_counter()
            clones = ws.fork(n)
            local.append(time.perf_counter() - t0)
            for c in clones:
                c.close()
    finally:
        sb.kill()
        ws.close()
    out = {"n": n, "api_e2b_sdk": summary(api), "in_process": summary(local)}
    out["ratio_median"] = round(out["api_e2b_sdk"]["median_ms"] / out["in_process"]["median_ms"], 3)
    return out


def throughput(server: _Server, clients: int, seconds: float) -> dict:
    from bunshin_gym.remote import RemoteEnv

    root = RemoteEnv("Bunshin-Shell-v0", server.url, token=server.token, max_steps=10**6)
    envs = [root]
    try:
        root.reset(options={"task": SHELL_TASK})
        envs += root.clone(clients - 1)
        counts = [0] * clients
        errors: list[str] = []
        latencies: list[float] = []
        lock = threading.Lock()
        start = threading.Barrier(clients + 1)
        stop_at = [0.0]

        def client(i: int) -> None:
            start.wait()
            mine = []
            while time.perf_counter() < stop_at[0]:
                t0 = time.perf_counter()
                try:
                    _, _, _, _, info = envs[i].step("true")
                    if "error" in info:
                        raise RuntimeError(info["error"])
                    counts[i] += 1
                    mine.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        stop_at[0] = time.perf_counter() + seconds
        t0 = time.perf_counter()
        start.wait()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    finally:
        for e in envs:
            e.close()
    return {"clients": clients, "seconds": round(elapsed, 2), "steps": sum(counts),
            "steps_per_s": round(sum(counts) / elapsed, 1), "errors": len(errors), "first_errors": errors[:5],
            "step_latency": summary(latencies) if latencies else None,
            "slowest_client_steps": min(counts), "fastest_client_steps": max(counts)}


def run(json_path: str | None = None, *, steps: int = 20, rounds: int = 3, desktop: bool = True,
        fork_n: int = 16, clients: int = 64, seconds: float = 20.0) -> dict:
    results: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bunshin-bench-serve-") as tmp:
        server = _Server(Path(tmp))
        try:
            print("shell step latency ...", flush=True)
            results["shell_step"] = shell_step(server, steps, rounds)
            if desktop:
                print("desktop step latency ...", flush=True)
                results["desktop_step"] = desktop_step(server, steps, rounds)
            print(f"fork of {fork_n} ...", flush=True)
            results["fork"] = fork16(server, fork_n, rounds)
            print(f"throughput with {clients} clients ...", flush=True)
            results["throughput"] = throughput(server, clients, seconds)
        finally:
            server.stop()
    results["load_after"] = os.getloadavg()
    sh = results["shell_step"]
    rows = [["shell step", sh["in_process"]["median_ms"], sh["remote"]["median_ms"],
             f"+{sh['added_median_ms']} ms (goal <= 5)"],
            ["  over a WebSocket", sh["in_process"]["median_ms"], sh["remote_websocket"]["median_ms"],
             f"+{sh['added_median_ms_websocket']} ms"],
            ["  over HTTP", sh["in_process"]["median_ms"], sh["remote_http"]["median_ms"],
             f"+{sh['added_median_ms_http']} ms"]]
    if desktop:
        d = results["desktop_step"]
        rows.append(["desktop step", d["in_process"]["median_ms"], d["remote"]["median_ms"],
                     f"{d['ratio_median']}x (goal <= 1.2x)"])
        pair = d["paired"]
        rows.append(["  steps alternated", pair["in_process"]["median_ms"], pair["remote"]["median_ms"],
                     f"{pair['median_of_ratios']}x (median of the pairs' ratios)"])
        draw = d["paired_drawing"]
        rows.append(["  steps that draw", draw["in_process"]["median_ms"], draw["remote"]["median_ms"],
                     f"{draw['median_of_ratios']}x (pairs: a character typed, then erased)"])
        rows.append(["  over a WebSocket", d["in_process"]["median_ms"], d["remote_websocket"]["median_ms"],
                     f"{d['ratio_median_websocket']}x"])
        rows.append(["  over HTTP", d["in_process"]["median_ms"], d["remote_http"]["median_ms"],
                     f"{d['ratio_median_http']}x"])
        rows.append(["  whole frames", d["in_process"]["median_ms"], d["remote_whole_frames"]["median_ms"],
                     f"{d['ratio_median_whole_frames']}x (no deltas)"])
    f = results["fork"]
    rows.append([f"fork {fork_n}", f["in_process"]["median_ms"], f["api_e2b_sdk"]["median_ms"],
                 f"{f['ratio_median']}x"])
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in results["load_before"])
          + ", after " + " ".join(f"{x:.2f}" for x in results["load_after"]))
    print(table(rows, ["median ms", "in-process", "through the server", ""]))
    print(f"\nround trips (median ms): HTTP no-op {sh['http_round_trip']['median_ms']}, "
          f"{sh['channel']} message {sh['channel_round_trip']['median_ms']}, "
          f"WebSocket message {sh['websocket_round_trip']['median_ms']}")
    if desktop:
        parts = [["local channel", *d["remote_breakdown"].values()],
                 ["WebSocket channel", *d["remote_websocket_breakdown"].values()],
                 ["HTTP", *d["remote_http_breakdown"].values()],
                 ["local, whole frames", *d["remote_whole_frames_breakdown"].values()],
                 ["local, steps that draw", *d["paired_drawing"]["remote_breakdown"].values()]]
        print("\nwhere a remote desktop step's time went (medians, ms; 'added' and 'x own step': the call's "
              "time less, and over, the same step's time in the server)")
        print(table(parts, ["", "added", "x own step", "server step", "server encode", "server other",
                            "client decode", "transport and client"]))
    t = results["throughput"]
    print(f"\n{t['clients']} clients: {t['steps_per_s']} steps/s over {t['seconds']} s, {t['errors']} errors")
    return write("serve", results, json_path)
