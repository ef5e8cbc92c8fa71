"""The Bunshin-WebArena-v0 part of ``bunshin bench env``: step latency and clone memory.

Measures, on one shop episode: reset latency (rollback to the booted snapshot, task set-up,
reset snapshot), step latency over a fixed cycle of WebArena actions (by action kind),
and, for each memory mode and clone count, the time to clone the live episode, each clone
taking three steps of its own (category page, add to cart, cart page), and the clones'
memory: distinct resident pages counted once (``unique``) and the sum of PSS.

Example:
    >>> from bunshin_gym.envs.webarena.bench import bench_webarena
    >>> res = bench_webarena(steps=20, counts=(1, 4), modes=("copy",))
"""

from __future__ import annotations

import time

import gymnasium as gym

from bunshin_gym.bench.report import summary, table
from bunshin_gym.workspace.memstat import group_memory, used_memory

TASK = "webarena/1025"
LATENCY_ACTIONS = ["click [link 'Electronics']", "click [link 'Headphones']", "click [link 'Price: Low to High']",
                   "go_back", "type [searchbox 'Search'] [kettle] [1]", "scroll [down]",
                   "goto [__SHOPPING__/checkout/cart/]", "click [link 'store logo']"]
CLONE_ACTIONS = ["click [link 'Electronics']", "click [button 'Add to Cart' #1]", "click [link 'My Cart (3 items)']"]


def bench_webarena(steps: int = 40, counts: tuple[int, ...] = (1, 8, 16), modes: tuple[str, ...] = ("share", "copy"),
                   task: str = TASK, resets: int = 5) -> dict:
    """Run the benchmark; returns the results (printed as tables too)."""
    res: dict = {"env": "Bunshin-WebArena-v0", "task": task, "counts": list(counts), "clones": {}}
    env = gym.make("Bunshin-WebArena-v0", max_steps=10**6)
    try:
        t0 = time.perf_counter()
        env.reset(options={"task": task})
        res["first_reset_s"] = round(time.perf_counter() - t0, 2)
        reset_s = []
        for _ in range(resets):
            t0 = time.perf_counter()
            env.reset(options={"task": task})
            reset_s.append(time.perf_counter() - t0)
        res["reset"] = summary(reset_s)
        by_kind: dict[str, list[float]] = {}
        errors = 0
        for i in range(steps):
            action = LATENCY_ACTIONS[i % len(LATENCY_ACTIONS)]
            t0 = time.perf_counter()
            info = env.step(action)[4]
            by_kind.setdefault(action.split(" [")[0].split()[0], []).append(time.perf_counter() - t0)
            errors += "error" in info
        res["step"] = summary([x for v in by_kind.values() for x in v])
        res["step_by_action"] = {k: summary(v) for k, v in by_kind.items()}
        res["step_errors"] = errors
        observe = []
        for _ in range(10):
            t0 = time.perf_counter()
            env.unwrapped.observe()
            observe.append(time.perf_counter() - t0)
        res["observe"] = summary(observe)
        env.reset(options={"task": task})
        res["source_mb"] = group_memory(env.unwrapped.workspace.pids()).as_mb()
        for mode in modes:
            res["clones"][mode] = {}
            for n in counts:
                row = _clones(env, mode, n)
                res["clones"][mode][str(n)] = row
                print(f"  clones {mode:>5} n={n:<2} fan-out {row['fanout_s']:6.2f} s  unique "
                      f"{row['after_activity']['unique']:8.1f} MB  pss {row['after_activity']['pss']:8.1f} MB",
                      flush=True)
    finally:
        env.close()
    _print(res)
    return res


def _clones(env: gym.Env, mode: str, n: int) -> dict:
    used0 = used_memory()
    t0 = time.perf_counter()
    clones = env.unwrapped.clone(n, mode=mode)
    fanout = time.perf_counter() - t0
    try:
        after_restore = group_memory([p for c in clones for p in c.workspace.pids()])
        errors = 0
        t0 = time.perf_counter()
        for c in clones:
            for action in CLONE_ACTIONS:
                errors += "error" in c.step(action)[4]
        steps_s = time.perf_counter() - t0
        time.sleep(2.0)  # let the browsers settle
        after = group_memory([p for c in clones for p in c.workspace.pids()])
        host = (used_memory() - used0) / 2**20
    finally:
        for c in clones:
            c.close()
    return {"fanout_s": round(fanout, 2), "clone_steps_s": round(steps_s, 2), "clone_step_errors": errors,
            "after_restore": after_restore.as_mb(), "after_activity": after.as_mb(),
            "per_clone_unique_mb": round(after.unique / n / 2**20, 1), "host_used_delta_mb": round(host, 1)}


def _print(res: dict) -> None:
    rows = [["reset (rollback + set-up + snapshot)", res["reset"]["median_ms"], res["reset"]["p90_ms"]],
            ["observe (aria snapshot -> tree)", res["observe"]["median_ms"], res["observe"]["p90_ms"]],
            ["step, all actions", res["step"]["median_ms"], res["step"]["p90_ms"]]]
    rows += [[f"  {k}", v["median_ms"], v["p90_ms"]] for k, v in res["step_by_action"].items()]
    print()
    print(table(rows, ["measure", "median ms", "p90 ms"]))
    mrows = [[mode, n, row["fanout_s"], row["after_restore"]["unique"], row["after_activity"]["unique"],
              row["per_clone_unique_mb"], row["after_activity"]["pss"], row["host_used_delta_mb"]]
             for mode, by_n in res["clones"].items() for n, row in by_n.items()]
    print()
    print(f"clones of {res['task']} (source: unique {res['source_mb']['unique']} MB, "
          f"PSS {res['source_mb']['pss']} MB, {res['source_mb']['processes']} processes)")
    print(table(mrows, ["mode", "n", "fan-out s", "unique MB restored", "unique MB after steps", "MB per clone",
                        "sum PSS MB", "host used +MB"]))
