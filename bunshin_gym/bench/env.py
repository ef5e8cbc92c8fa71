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
  and the tree's part of env steps with the default observation (the figure issue #20's
  goal is about: what a training step pays), with actions that change the view;
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
#: served-nomemo: the fast walker inside the desktop's input server, asking everything (last
#: session's default); served: the same with the server's memo of what never changes (the
#: env's default now)
WALKERS = ("old", "fast", "served-nomemo", "served")
#: issue #20's goal for a tree dump (ms)
TREE_GOAL_MS = 200.0
#: tree requests whose memory growth is measured
MEMORY_REQUESTS = 20


def _tree(u, walker: str) -> str:
    """One dump by ``walker``, given room to finish: 120 s for the walk, and for the old one
    15 s per call (by default it stops after 8 s and waits 1.5 s per call, which on a busy
    host cuts the tree or leaves Calc out: then the two would not give the same content)."""
    from bunshin_gym.envs.osworld import desktop

    if walker.startswith("served"):
        return u._client().a11y_tree(120.0, memo=walker == "served")
    res = u.workspace.exec(["python3", f"{desktop.OPT}/a11y_dump.py", "--walker", walker, "--seconds", "120",
                            "--call-timeout", "15"], user=desktop.USER, env=desktop.DESKTOP_ENV, timeout=180)
    return res.text


def _private_kb(pids: list[int]) -> int:
    r = rollup(pids)
    return (r["Private_Clean"] + r["Private_Dirty"]) // 1024


def _server_pids(u) -> list[int]:
    from bunshin_gym.envs.osworld import desktop

    pid = u._client().request({"op": "ping"})["pid"]  # in the workspace's pid namespace
    return [p for p in u.workspace.pids() if _ns_pid(p) == pid and desktop.OPT in _cmdline(p)]


def _ns_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _memory_over_requests(u, n: int) -> dict:
    """Private memory (kB) of the workspace's processes before and after ``n`` served tree
    requests, split into the desktop server (the memo's owner) and the rest (the apps,
    which may make objects when asked)."""
    server = _server_pids(u)
    pids = u.workspace.pids()
    rest = [p for p in pids if p not in server]
    before = {"server": _private_kb(server), "apps_and_rest": _private_kb(rest)}
    for _ in range(n):
        _tree(u, "served")
    after = {"server": _private_kb(server), "apps_and_rest": _private_kb(rest)}
    return {"requests": n, "before_kb": before, "after_kb": after,
            "grown_kb": {k: after[k] - before[k] for k in before}}


def _first_tree_of_a_clone(u) -> float:
    """Seconds the first served tree of a clone of ``u``'s live state takes."""
    (twin,) = u.clone(1)
    try:
        t0 = time.perf_counter()
        twin.unwrapped.accessibility_tree(seconds=120.0)  # as an observation: served, else a process
        return time.perf_counter() - t0
    finally:
        twin.close()


#: actions of the steps whose tree is timed (:func:`_tree_in_steps`), in turn: the pointer
#: moves, a key, and the view scrolled away and back (new objects for what comes into view);
#: on Calc also a cell clicked, a value typed and entered (the task's own kind of step)
TREE_STEP_ACTIONS = ("pyautogui.moveTo(640, 480)", "pyautogui.scroll(-3)", "pyautogui.press('shift')",
                     "pyautogui.scroll(3)")
TREE_STEP_ACTIONS_BY_APP = {"calc": ("pyautogui.click(420, 420)", "pyautogui.scroll(-3)", "pyautogui.write('7')",
                                     "pyautogui.press('enter')", "pyautogui.scroll(3)", "pyautogui.press('up')")}


def _tree_in_steps(task: str, actions: tuple[str, ...], n: int) -> dict:
    """The tree's part of ``n`` steps of an env with the default observation (tree included,
    the env's own walker), ``actions`` in turn: what a training step pays for the tree, with
    no other AT-SPI client asking the apps in between (the walkers measured in turns
    disturb each other: the old walker's new cell objects retire Calc's kept ones)."""
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", max_steps=10**6)
    try:
        env.reset(options={"task": task})
        tree_s, step_s = [], []
        for i in range(n):
            _, _, _, _, info = env.step(actions[i % len(actions)])
            assert "error" not in info, info
            timing = env.unwrapped.last_step_timing
            tree_s.append(timing["tree_s"])
            step_s.append(timing["step_s"])
        return {"actions": list(actions), "tree": summary(tree_s), "step": summary(step_s)}
    finally:
        env.close()


def osworld_tree(n: int = 5, tasks: dict[str, str] | None = None, steps: int = 24) -> dict:
    """Accessibility-tree dump time per app, all walkers in turns on the same desktop (so load
    on a shared host hits them alike); each walker's first dump is a warm-up and not timed.
    ``in_steps``: the tree's part of ``steps`` env steps with the default observation (see
    :func:`_tree_in_steps`), each app on a desktop of its own. ``same_xml``: every round
    of dumps taken in turn was equal. ``first_clone_tree_s``: the first tree of a clone
    whose source had never been asked for its tree ("cold": the apps make their accessible
    objects then) and of one whose source had ("warm": what a reset snapshot holds now, see
    ``OSWorldEnv.snapshot``). ``memory``: private memory of the desktop server and of the
    rest over MEMORY_REQUESTS served dumps after the timed ones. ``private_kb_per_dump``:
    growth of the desktop processes' private memory per process dump over ``n`` in a row,
    the fast walker's before any old one (Calc keeps every cell object an AT-SPI client
    asks for; the fast walker asks its kept ones again, and a new one asked by the old
    walker retires them)."""
    out: dict = {}
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False)
    try:
        for app, task in (tasks or TREE_TASKS).items():
            print(f"  accessibility tree, {app} ({task}) ...", flush=True)
            env.reset(options={"task": task})  # no tree asked: require_a11y_tree=False
            time.sleep(2)
            u = env.unwrapped
            first = {"cold": _first_tree_of_a_clone(u)}
            pids = u.workspace.pids()
            trees = {"fast": _tree(u, "fast")}
            first["warm"] = _first_tree_of_a_clone(u)
            before = _private_kb(pids)
            for _ in range(n):
                _tree(u, "fast")
            grown = {"fast": round((_private_kb(pids) - before) / n)}
            for w in WALKERS:
                trees[w] = _tree(u, w)
            samples: dict[str, list[float]] = {w: [] for w in WALKERS}
            same = True
            for _ in range(n):
                for w in WALKERS:
                    t0 = time.perf_counter()
                    trees[w] = _tree(u, w)
                    samples[w].append(time.perf_counter() - t0)
                same = same and len({trees[w] for w in WALKERS}) == 1
            memory = _memory_over_requests(u, MEMORY_REQUESTS)
            before = _private_kb(pids)
            for _ in range(n):
                _tree(u, "old")
            grown["old"] = round((_private_kb(pids) - before) / n)
            out[app] = {"task": task, "lines": trees["served"].count("\n") + 1, "same_xml": same,
                        **{w: summary(samples[w]) for w in WALKERS}, "private_kb_per_dump": grown,
                        "first_clone_tree_s": {k: round(v, 3) for k, v in first.items()}, "memory": memory}
    finally:
        env.close()
    if steps:
        for app, task in (tasks or TREE_TASKS).items():
            print(f"  accessibility tree in {steps} steps, {app} ...", flush=True)
            out[app]["in_steps"] = _tree_in_steps(task, TREE_STEP_ACTIONS_BY_APP.get(app, TREE_STEP_ACTIONS), steps)
    return out


def tree_table(res: dict) -> str:
    rows = []
    for app, r in res.items():
        in_steps = r.get("in_steps", {}).get("tree", {})
        new = in_steps.get("median_ms", r.get("served", r["fast"])["median_ms"])
        first = r.get("first_clone_tree_s", {})
        grown = r.get("memory", {}).get("grown_kb", {})
        rows.append([app, r["lines"], *(r[w]["median_ms"] if w in r else "-" for w in WALKERS),
                     in_steps.get("median_ms", "-"), in_steps.get("p90_ms", "-"),
                     round(r["old"]["median_ms"] / max(new, 1e-9), 1), "yes" if new <= TREE_GOAL_MS else "NO",
                     r["same_xml"], first.get("cold", "-"), first.get("warm", "-"),
                     grown.get("server", "-"), grown.get("apps_and_rest", "-"),
                     r["private_kb_per_dump"]["old"], r["private_kb_per_dump"]["fast"]])
    return table(rows, ["app", "lines", "old ms", "fast (process) ms", "served, no memo ms", "served ms",
                        "in steps ms", "in steps p90 ms", "speed-up", f"<= {TREE_GOAL_MS:.0f} ms", "same XML",
                        "clone 1st cold s", "clone 1st warm s",
                        f"server kB +{MEMORY_REQUESTS} trees", f"rest kB +{MEMORY_REQUESTS} trees",
                        "old private kB/dump", "fast private kB/dump"])


def run_tree(json_path: str | None = None, n: int = 5) -> dict:
    """The accessibility-tree part of the Bunshin-OSWorld-v0 bench alone (with the host's load)."""
    import os

    load0 = os.getloadavg()
    res = osworld_tree(n)
    load1 = os.getloadavg()
    print()
    print(f"accessibility tree per app (load 1/5/15 min: {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f} at start, "
          f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} at end)")
    print(tree_table(res))
    return write("env-Bunshin-OSWorld-v0-a11y-tree", {"a11y_tree": res, "load_start": load0, "load_end": load1},
                 json_path)


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
    print("accessibility tree per app (old: libatspi walker; fast: batched D-Bus calls; served: in the desktop "
          "server, with its memo)")
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


if __name__ == "__main__":  # python -m bunshin_gym.bench.env [JSON]: the accessibility-tree table alone
    import sys

    run_tree(sys.argv[1] if len(sys.argv) > 1 else None)
