"""``bunshin bench env --env ID``: step latency and clone memory of one env family.

Each env id has its own benchmark function in :data:`BENCHES` (the families' own parts
stay apart); they share the clone-memory measure :func:`clone_memory` and the output
format of :mod:`bunshin_gym.bench.report`.

Bunshin-OSWorld-v0 measures:
- step latency (action + screenshot, ``settle=0``) for both action spaces, with the action
  and screenshot parts apart;
- the accessibility-tree dump per app (Calc, the terminal, the text editor, chromium: one task
  each), the fast walker and the old libatspi walker side by side in turns, whether both
  gave the same XML, and how much private memory the desktop's processes grew per dump;
- memory of 1, 8 and 16 clones of one task's workspace (after reset) in "share" and
  "copy": distinct resident pages of the group counted once and the sum of PSS, right
  after restore and after each clone did one action.

Example:
    >>> from bunshin_gym.bench import env
    >>> env.run("bench/results/env-osworld.json", env_id="Bunshin-OSWorld-v0")
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gymnasium as gym

from bunshin_gym.bench.report import summary, table, write
from bunshin_gym.workspace.memory import MemoryMode
from bunshin_gym.workspace.memstat import group_memory, rollup

KSM_SETTLE_S = 20.0


def _settle(mode: MemoryMode) -> float:
    """Give ksmd time to merge (share and ksm modes) before memory is read."""
    try:
        from bunshin_gym.bench.fork import _ksm_settle
    except ImportError:  # pragma: no cover - fork bench absent
        return 0.0
    return _ksm_settle(mode)


def clone_memory(env: gym.Env, counts: tuple[int, ...], modes: tuple[str, ...],
                 activity: Callable[[gym.Env, int], None]) -> dict:
    """Memory of ``n`` clones of ``env``'s live state for each mode and n."""
    out: dict = {}
    for mode in map(MemoryMode.parse, modes):
        out[mode.value] = {}
        for n in counts:
            print(f"  clones {mode.value:>5} n={n:<2} ", end="", flush=True)
            t0 = time.perf_counter()
            clones = env.clone(n, mode=mode.value)
            fanout = time.perf_counter() - t0
            try:
                settle = _settle(mode)
                after_restore = group_memory([p for c in clones for p in c.unwrapped.workspace.pids()])
                for i, c in enumerate(clones):
                    activity(c, i)
                time.sleep(0.5)
                settle += _settle(mode)
                after = group_memory([p for c in clones for p in c.unwrapped.workspace.pids()])
            finally:
                for c in clones:
                    c.close()
            row = {"fanout_s": round(fanout, 2), "after_restore": after_restore.as_mb(),
                   "after_activity": after.as_mb(), "per_clone_unique_mb": round(after.unique / n / 2**20, 1),
                   "ksm_settle_s": round(settle, 1)}
            out[mode.value][str(n)] = row
            print(f"fan-out {fanout:6.2f} s  unique {after.unique_mb:8.1f} MB  pss {after.as_mb()['pss']:8.1f} MB")
    return out


# Bunshin-OSWorld-v0 -----------------------------------------------------------------------
def _osworld_latency(space: str, task: str, steps: int) -> dict:
    env = gym.make("Bunshin-OSWorld-v0", action_space=space, require_a11y_tree=False, max_steps=10**6)
    try:
        env.reset(options={"task": task})
        u = env.unwrapped
        if space == "pyautogui":
            actions = [f"pyautogui.moveTo({200 + 40 * (i % 20)}, {700 + 10 * (i % 7)})" if i % 2 else
                       "pyautogui.press('shift')" for i in range(steps)]
        else:
            actions = [{"action_type": "MOVE_TO", "x": 200 + 40 * (i % 20), "y": 700 + 10 * (i % 7)} if i % 2 else
                       {"action_type": "PRESS", "key": "shift"} for i in range(steps)]
        for a in actions[:5]:  # warm: connections, first X requests
            env.step(a)
        # steps and screenshots with damage tracking (the default) and with whole-screen reads,
        # in turns on the same desktop, so load on a shared host hits both alike
        step_s: dict[bool, list[float]] = {True: [], False: []}
        shot_s: dict[bool, list[float]] = {True: [], False: []}
        action_s = []
        for a in actions:
            for track in (True, False):
                u.track_damage = track
                u.screenshot()  # a connection of this kind is open and has its first frame
                t0 = time.perf_counter()
                _, _, _, _, info = env.step(a)
                step_s[track].append(time.perf_counter() - t0)
                assert "error" not in info, info
                action_s.append(u.last_step_timing["action_s"])
                t0 = time.perf_counter()
                u.screenshot()
                shot_s[track].append(time.perf_counter() - t0)
        u.track_damage = True
        return {"step": summary(step_s[True]), "step_whole_screen": summary(step_s[False]),
                "action_in_workspace": summary(action_s), "screenshot": summary(shot_s[True]),
                "screenshot_whole_screen": summary(shot_s[False])}
    finally:
        env.close()


#: app -> a task that opens it (the terminal: xterm, which has no AT-SPI: only the other apps)
TREE_TASKS = {"calc": "osworld/calc-max-sales", "terminal": "osworld/terminal-count-lines",
              "text editor": "osworld/editor-fix-port", "chromium": "osworld/chrome-open-about"}
#: old: libatspi, one call at a time; fast: batched D-Bus calls, as a process of its own;
#: served: the fast walker inside the desktop's input server (the env's default: no process start)
WALKERS = ("old", "fast", "served")
#: issue #20's goal for a tree dump (ms)
TREE_GOAL_MS = 200.0


def _tree(u, walker: str) -> str:
    """One dump by ``walker``, given room to finish: 120 s for the walk, and for the old one
    15 s per call (by default it stops after 8 s and waits 1.5 s per call, which on a busy
    host cuts the tree or leaves Calc out: then the two would not give the same content)."""
    from bunshin_gym.envs.osworld import desktop

    if walker == "served":
        return u._client().a11y_tree(120.0)
    res = u.workspace.exec(["python3", f"{desktop.OPT}/a11y_dump.py", "--walker", walker, "--seconds", "120",
                            "--call-timeout", "15"], user=desktop.USER, env=desktop.DESKTOP_ENV, timeout=180)
    return res.text


def _private_bytes(pids: list[int]) -> int:
    r = rollup(pids)
    return r["Private_Clean"] + r["Private_Dirty"]


def _grown_per_dump(u, pids: list[int], walker: str, n: int) -> int:
    """kB of private memory the desktop's processes grew per dump, over ``n`` dumps."""
    before = _private_bytes(pids)
    for _ in range(n):
        _tree(u, walker)
    return round((_private_bytes(pids) - before) / n / 1024)


def osworld_tree(n: int = 3, tasks: dict[str, str] | None = None) -> dict:
    """Accessibility-tree dump time per app, old and fast walker in turns on the same desktop
    (so load on a shared host hits both alike); each walker's first dump is a warm-up (the
    fast walker keeps tables between dumps) and not timed. ``same_xml``: every pair of dumps
    taken in turn was equal. ``private_kb_per_dump``: growth of the desktop processes'
    private memory per dump over ``n`` dumps in a row of one walker, the fast walker's
    before any old one (Calc keeps every cell object an AT-SPI client asks for; the fast
    walker asks its kept ones again, and a new one asked by the old walker retires them)."""
    out: dict = {}
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False)
    try:
        for app, task in (tasks or TREE_TASKS).items():
            print(f"  accessibility tree, {app} ({task}) ...", flush=True)
            env.reset(options={"task": task})
            time.sleep(2)
            u = env.unwrapped
            pids = u.workspace.pids()
            trees = {"fast": _tree(u, "fast")}
            grown = {"fast": _grown_per_dump(u, pids, "fast", n)}
            trees["old"] = _tree(u, "old")
            trees["served"] = _tree(u, "served")
            samples: dict[str, list[float]] = {w: [] for w in WALKERS}
            same = True
            for _ in range(n):
                for w in WALKERS:
                    t0 = time.perf_counter()
                    trees[w] = _tree(u, w)
                    samples[w].append(time.perf_counter() - t0)
                same = same and trees["old"] == trees["fast"] == trees["served"]
            grown["old"] = _grown_per_dump(u, pids, "old", n)
            out[app] = {"task": task, "lines": trees["fast"].count("\n") + 1, "same_xml": same,
                        **{w: summary(samples[w]) for w in WALKERS}, "private_kb_per_dump": grown}
    finally:
        env.close()
    return out


def tree_table(res: dict) -> str:
    rows = [[app, r["lines"], r["old"]["median_ms"], r["fast"]["median_ms"], r.get("served", {}).get("median_ms", "-"),
             round(r["old"]["median_ms"] / max(r.get("served", r["fast"])["median_ms"], 1e-9), 1),
             "yes" if r.get("served", r["fast"])["median_ms"] <= TREE_GOAL_MS else "NO", r["same_xml"],
             r["private_kb_per_dump"]["old"], r["private_kb_per_dump"]["fast"]] for app, r in res.items()]
    return table(rows, ["app", "lines", "old median ms", "fast (process) ms", "served ms", "speed-up",
                        f"<= {TREE_GOAL_MS:.0f} ms", "same XML", "old private kB/dump", "fast private kB/dump"])


def bench_osworld(steps: int = 200, counts: tuple[int, ...] = (1, 8, 16), modes: tuple[str, ...] = ("share", "copy"),
                  task: str = "osworld/editor-append-item") -> dict:
    res: dict = {"env": "Bunshin-OSWorld-v0", "screen": [1920, 1080], "latency": {}}
    for space in ("pyautogui", "computer_13"):
        print(f"  step latency, {space} ({steps} steps) ...", flush=True)
        res["latency"][space] = _osworld_latency(space, task, steps)
    res["a11y_tree"] = osworld_tree()
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False)
    try:
        env.reset(options={"task": task})
        res["memory_task"] = task
        res["source_mb"] = group_memory(env.unwrapped.workspace.pids()).as_mb()
        res["clones"] = clone_memory(env, counts, modes,
                                     lambda c, i: c.step(f"pyautogui.write('clone {i} was here')"))
    finally:
        env.close()
    lat = res["latency"]
    rows = [[f"{space}: {part}", lat[space][part]["median_ms"], lat[space][part]["p90_ms"]]
            for space in lat for part in ("step", "step_whole_screen", "action_in_workspace", "screenshot",
                                         "screenshot_whole_screen")]
    print()
    print(table(rows, ["measure (1920x1080)", "median ms", "p90 ms"]))
    print()
    print("accessibility tree per app (old: libatspi walker; fast: batched D-Bus calls)")
    print(tree_table(res["a11y_tree"]))
    mrows = []
    for mode, by_n in res["clones"].items():
        for n, row in by_n.items():
            mrows.append([mode, n, row["after_restore"]["unique"], row["after_activity"]["unique"],
                          row["per_clone_unique_mb"], row["after_activity"]["pss"], row["fanout_s"]])
    print()
    src = res["source_mb"]
    print(f"clones of {task} (source: unique {src['unique']} MB, {src['processes']} processes)")
    print(table(mrows, ["mode", "n", "unique MB restored", "unique MB after activity", "MB per clone",
                        "sum PSS MB", "fan-out s"]))
    return res


# Bunshin-WebArena-v0 ----------------------------------------------------------------------
def bench_webarena(**kwargs) -> dict:
    """Reset and step latency and clone memory of the shop env; the measure lives with the env
    (:mod:`bunshin_gym.envs.webarena.bench`)."""
    from bunshin_gym.envs.webarena.bench import bench_webarena as run_webarena

    return run_webarena(**kwargs)


#: env id -> its benchmark (keyword arguments: steps, counts, modes, task)
BENCHES: dict[str, Callable[..., dict]] = {
    "Bunshin-OSWorld-v0": bench_osworld,
    "Bunshin-WebArena-v0": bench_webarena,
}


def run(json_path: str | None = None, *, env_id: str, **kwargs) -> dict:
    """Run ``env_id``'s benchmark; ``kwargs`` (steps, counts, modes, task; None = default) go to it."""
    if env_id not in BENCHES:
        raise ValueError(f"no env benchmark for {env_id!r}; available: {', '.join(sorted(BENCHES))}")
    print(f"bench env: {env_id}")
    res = BENCHES[env_id](**{k: v for k, v in kwargs.items() if v is not None})
    return write(f"env-{env_id}", res, json_path)
