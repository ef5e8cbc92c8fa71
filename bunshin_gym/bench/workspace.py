"""``bunshin bench workspace``: start time, exec round trip and idle memory of a shell workspace."""

from __future__ import annotations

import time

from bunshin_gym.bench.report import summary, table, write
from bunshin_gym.workspace import Workspace


def run(json_path: str | None = None, starts: int = 20, execs: int = 200, image: str = "base") -> dict:
    print(f"bench workspace: {starts} starts of image {image!r}, {execs} exec round trips")
    start_s, close_s = [], []
    for i in range(starts):
        t0 = time.perf_counter()
        ws = Workspace.create(image)
        start_s.append(time.perf_counter() - t0)
        if i < starts - 1:
            t0 = time.perf_counter()
            ws.close()
            close_s.append(time.perf_counter() - t0)
    try:
        rtt = []
        for _ in range(execs):
            t0 = time.perf_counter()
            ws.exec(["true"])
            rtt.append(time.perf_counter() - t0)
        time.sleep(1.0)
        mem = ws.memory()  # idle: before the large outputs grow the agent's heap
        big = []
        for _ in range(5):
            t0 = time.perf_counter()
            ws.exec("head -c 10000000 /dev/zero")
            big.append(time.perf_counter() - t0)
    finally:
        ws.close()
    res = {
        "image": image,
        "start": summary(start_s),
        "close": summary(close_s),
        "exec_round_trip": summary(rtt),
        "exec_10MB_output": summary(big),
        "idle_memory_mb": mem.as_mb(),
    }
    print(table([
        ["start (create -> agent answers)", res["start"]["median_ms"], res["start"]["p90_ms"]],
        ["close (kill + reclaim)", res["close"]["median_ms"], res["close"]["p90_ms"]],
        ["exec round trip (`true`)", res["exec_round_trip"]["median_ms"], res["exec_round_trip"]["p90_ms"]],
        ["exec with 10 MB of output", res["exec_10MB_output"]["median_ms"], res["exec_10MB_output"]["p90_ms"]],
    ], ["measure", "median ms", "p90 ms"]))
    m = res["idle_memory_mb"]
    print(f"\nidle memory: PSS {m['pss']} MB, private {m['private']} MB, RSS {m['rss']} MB over "
          f"{m['processes']} processes; cgroup charge {m['cgroup']} MB")
    return write("workspace", res, json_path)
