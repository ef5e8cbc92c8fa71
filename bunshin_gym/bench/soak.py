"""``bunshin bench soak``: fork/close cycles, then a long mixed workload from many threads, then
a count of everything the run left behind (issue 14).

Phase 1 forks one clone of a base workspace's snapshot, runs a command in it and closes it, N
times, alternating the memory modes copy, share and ksm. Phase 2 runs, for M minutes, T threads
that each make real envs (shell, desktop, web) and do a random mix on them: reset, steps,
clones (stepped, then closed), snapshot / step / rollback, rollback to the reset state. At most
2 desktop and 2 web envs live at once (about 0.5 GB each); the other threads use shell envs.

Leaks are counted right after everything is closed and before any ``gc`` (which would hide
them). Other sessions run workspaces on this host at the same time, so only what this run made
is counted: every record this process saves (as owner or builder) names the workspace ids,
subvolumes, cgroups and uffd monitors of the run, and every snapshot metadata it writes names
the snapshots. Host-wide counts before and after are reported too, for context only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunshin_gym.bench.report import table, write
from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, cgroups, records
from bunshin_gym.workspace.cgroups import Cgroup
from bunshin_gym.workspace.snapshots import meta as snapshot_meta

log = logging.getLogger(__name__)

MODES = ("copy", "share", "ksm")
ENV_KINDS = ("shell", "desktop", "web")
#: at most this many of each heavy kind alive at once (desktops and browsers are ~0.5 GB each)
HEAVY_LIMIT = {"desktop": 2, "web": 2}
PROGRESS_EVERY_S = 30.0
FIRST_MESSAGES = 5


@dataclass
class EnvKind:
    """How to make one kind of env and what cheap actions to step it with."""

    env_id: str
    make_kwargs: dict
    task: str
    actions: tuple[str, ...]
    ops_per_env: tuple[int, int]  # how many operations before the env is closed and a new one made


KINDS: dict[str, EnvKind] = {
    "shell": EnvKind("Bunshin-Shell-v0", {}, "shell/make-dir",
                     ("true", "echo soak", "ls /home/user", "date +%s", "cat /etc/hostname"), (10, 40)),
    "desktop": EnvKind("Bunshin-OSWorld-v0", {"action_space": "pyautogui", "require_a11y_tree": False},
                       "osworld/terminal-mkdir-projects",
                       ("pyautogui.moveTo(200, 200)", "pyautogui.moveTo(320, 240)"), (20, 60)),
    "web": EnvKind("Bunshin-WebArena-v0", {}, "webarena/1001", ("scroll [down]", "scroll [up]"), (20, 60)),
}
#: operation mix of phase 2 (weights)
OPS = {"step": 50, "clone": 15, "snapshot_rollback": 20, "rollback_reset": 5, "reset": 10}


# what this run made ------------------------------------------------------------------------
class Made:
    """Ids of everything this process creates, gathered by wrapping ``records.save`` and the
    snapshot metadata writer (the bench's own instrumentation; undone by :meth:`stop`)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ws_ids: set[str] = set()
        self.subvolumes: set[str] = set()
        self.cgroups: set[str] = set()
        self.monitors: dict[int, int | None] = {}  # uffd monitor pid -> start time
        self.snapshots: set[str] = set()
        self._save = records.save
        self._write_meta = snapshot_meta.write
        self._lock = threading.Lock()

    def start(self) -> None:
        def save(rec: records.Record, p=None) -> None:
            if self.pid in (rec.owner, rec.builder):
                with self._lock:
                    self.ws_ids.add(rec.id)
                    self.subvolumes.add(Path(rec.subvolume).name)
                    self.cgroups.add(rec.cgroup)
                    if rec.uffd is not None:
                        self.monitors[rec.uffd.guard] = rec.uffd.guard_start
                        self.monitors[rec.uffd.worker] = rec.uffd.worker_start
            return self._save(rec, p)

        def write_meta(path: Path, meta: snapshot_meta.SnapshotMeta) -> None:
            with self._lock:
                if meta.workspace in self.ws_ids:
                    self.snapshots.add(Path(path).name)
            return self._write_meta(path, meta)

        records.save = save
        snapshot_meta.write = write_meta

    def stop(self) -> None:
        records.save = self._save
        snapshot_meta.write = self._write_meta


# leaks -------------------------------------------------------------------------------------
def _proc_cgroup_names(pid: str) -> set[str]:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()
    names = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if "/bunshin/" in path:
            names.add(path.split("/bunshin/", 1)[1].split("/", 1)[0])
    return names


def _state(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _children(pid: int) -> set[str]:
    out = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(f"{e} {stat[stat.index('(') + 1:stat.rindex(')')]}")
    return out


def _netns_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("net:"):
            out.add(target)
    return out


def host_counts() -> dict[str, int]:
    """Host-wide counts (every session's workspaces): context for the leak figures, never judged."""
    p = paths()
    imgs = p.run / "uffd-images"
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    netns = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                netns.add(os.stat(f"/proc/{e}/ns/net").st_ino)
            except OSError:
                continue
    return {
        "mounts": len(mounts),
        "cgroups": len(cgroups.list_names()),
        "subvolumes": len(list(p.workspaces.iterdir())) if p.workspaces.exists() else 0,
        "records": len(records.all_ids()),
        "snapshots": len(list(p.snapshots.iterdir())) if p.snapshots.exists() else 0,
        "uffd_images": len([d for d in imgs.iterdir() if d.is_dir()]) if os.path.ismount(imgs) else 0,
        "net_namespaces": len(netns),
    }


def leaks(made: Made, baseline: dict) -> dict[str, list[str]]:
    """What this run's workspaces and snapshots left on the host (empty lists: nothing)."""
    p = paths()
    ids, subs, cgs, snaps = made.ws_ids, made.subvolumes, made.cgroups, made.snapshots
    names = ids | subs | cgs | snaps
    found: dict[str, list[str]] = {}
    found["records"] = sorted(i for i in ids if (p.records / f"{i}.json").exists())
    with open("/proc/self/mountinfo") as f:
        found["mounts"] = [ln for ln in f.read().splitlines() if any(n in ln for n in names)]
    found["cgroups"] = sorted(str(d) for c in cgs for d in Cgroup(c).dirs if d.exists())
    found["subvolumes"] = sorted(s for s in subs if (p.workspaces / s).exists())
    procs, netns = [], set()
    for e in os.listdir("/proc"):
        if e.isdigit() and _proc_cgroup_names(e) & cgs and _state(e) not in ("Z", "X", None):
            procs.append(f"{e} (cgroup {', '.join(sorted(_proc_cgroup_names(e) & cgs))})")
            try:
                netns.add(f"net:[{os.stat(f'/proc/{e}/ns/net').st_ino}]")
            except OSError:
                pass
    procs += [f"{pid} (uffd monitor)" for pid, st in made.monitors.items() if records.process_alive(pid, st)]
    procs += [f"{c} (child of the bench)" for c in sorted(_children(made.pid) - baseline["children"])]
    found["processes"] = procs
    netns |= _netns_fds() - baseline["netns_fds"]
    netns |= {ln for ln in found["mounts"] if " nsfs " in ln}
    found["netns"] = sorted(netns)
    imgs = p.run / "uffd-images"
    monitors = p.run / "uffd"
    found["tmpfs_images"] = sorted(
        [f"uffd-images/{s}" for s in snaps if (imgs / s).exists()]
        + [f"uffd/{f.name}" for f in (monitors.iterdir() if monitors.exists() else [])
           if f.name.split(".")[0] in ids and not f.name.endswith(".log")])
    found["snapshots"] = sorted(s for s in snaps if (p.snapshots / s).exists())
    found["snapshot_views"] = sorted(s for s in snaps if (p.pool / "snap-views" / s).exists())
    return found


# bookkeeping -------------------------------------------------------------------------------
@dataclass
class Tally:
    ops: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    messages: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.ops[kind] += 1
            self.times[kind].append(seconds)

    def error(self, kind: str, message: str) -> None:
        with self.lock:
            self.errors[kind] += 1
            if len(self.messages[kind]) < FIRST_MESSAGES:
                self.messages[kind].append(message[-2000:])
        log.warning("soak: %s failed: %s", kind, message.strip().splitlines()[-1] if message.strip() else "")

    def total_ops(self) -> int:
        with self.lock:
            return sum(self.ops.values())

    def total_errors(self) -> int:
        with self.lock:
            return sum(self.errors.values())


def percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    if not s:
        return {"n": 0}
    at = lambda q: round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 1)  # noqa: E731
    return {"n": len(s), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": round(s[-1] * 1e3, 1)}


def _timed(tally: Tally, kind: str, fn, *args, **kwargs) -> Any:
    """Run one operation; count it or its error (re-raised, so the caller drops the env)."""
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        tally.error(kind, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
        raise
    tally.ok(kind, time.perf_counter() - t0)
    return out


class _Progress(threading.Thread):
    def __init__(self, phase: str, tally: Tally, t0: float, every: float = PROGRESS_EVERY_S):
        super().__init__(daemon=True, name=f"soak-progress-{phase}")
        self.phase, self.tally, self.t0, self.every = phase, tally, t0, every
        self.stop_event = threading.Event()
        self.extra = lambda: ""

    def run(self) -> None:
        while not self.stop_event.wait(self.every):
            print(f"  [{self.phase}] {time.monotonic() - self.t0:7.0f} s  ops {self.tally.total_ops():6d}  "
                  f"errors {self.tally.total_errors()}{self.extra()}", flush=True)


# phase 1 -----------------------------------------------------------------------------------
def fork_cycles(n: int, tally: Tally) -> dict:
    """``n`` fork/exec/close cycles of one snapshot of a base workspace, modes alternating."""
    t0 = time.monotonic()
    prog = _Progress("cycles", tally, t0)
    prog.start()
    ws = snap = None
    per_mode: dict[str, list[float]] = defaultdict(list)
    try:
        ws = _timed(tally, "create", Workspace.create, "base")
        ws.exec("echo base > /root/f")
        snap = _timed(tally, "snapshot", ws.snapshot)
        for i in range(n):
            mode = MODES[i % len(MODES)]
            c0 = time.perf_counter()
            try:
                [c] = _timed(tally, f"fork_{mode}", snap.fork, 1, mode=mode)
                try:
                    res = _timed(tally, "exec", c.exec, f"test \"$(cat /root/f)\" = base && echo {i} > /root/f")
                    if res.exit_code != 0:
                        tally.error("exec_result", f"cycle {i} ({mode}): exit {res.exit_code}: {res.text[-500:]}")
                finally:
                    _timed(tally, "close", c.close)
            except Exception:  # noqa: BLE001 - counted by _timed; the next cycle goes on
                continue
            per_mode[mode].append(time.perf_counter() - c0)
    finally:
        prog.stop_event.set()
        if snap is not None:
            try:
                _timed(tally, "snapshot_delete", snap.delete)
            except Exception:  # noqa: BLE001 - counted
                pass
        if ws is not None:
            try:
                _timed(tally, "close", ws.close)
            except Exception:  # noqa: BLE001 - counted
                pass
    return {"cycles": n, "elapsed_s": round(time.monotonic() - t0, 1),
            "cycle_by_mode": {m: percentiles(v) for m, v in per_mode.items()}}


# phase 2 -----------------------------------------------------------------------------------
class Mixer:
    """The threads of phase 2 and what they share."""

    def __init__(self, kinds: tuple[str, ...], deadline: float, tally: Tally, seed: int):
        self.kinds, self.deadline, self.tally, self.seed = kinds, deadline, tally, seed
        self.slots = {k: threading.BoundedSemaphore(HEAVY_LIMIT[k]) for k in HEAVY_LIMIT}
        self.alive: Counter = Counter()
        self.lock = threading.Lock()

    def _pick(self, rng: random.Random) -> str | None:
        """A kind to make now, or None when the time is up (heavy kinds only while a slot is free)."""
        while time.monotonic() < self.deadline:
            kind = rng.choice(self.kinds)
            if kind not in self.slots:
                return kind
            if self.slots[kind].acquire(blocking=False):
                return kind
            if "shell" in self.kinds:
                return "shell"
            time.sleep(0.5)
        return None

    def thread(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while True:
            kind = self._pick(rng)
            if kind is None:
                return
            with self.lock:
                self.alive[kind] += 1
            try:
                self._episode_run(kind, rng)
            finally:
                with self.lock:
                    self.alive[kind] -= 1
                if kind in self.slots:
                    self.slots[kind].release()

    def _step(self, kind: str, env, rng: random.Random, op: str = "step") -> None:
        k = KINDS[kind]
        if env.unwrapped.done:
            _timed(self.tally, f"{kind}:rollback_reset", env.unwrapped.rollback)
        _, _, _, _, info = _timed(self.tally, f"{kind}:{op}", env.step, rng.choice(k.actions))
        if info.get("workspace_failed") or info.get("error"):
            self.tally.error(f"{kind}:{op}_info", f"{info.get('error')!r} (workspace_failed="
                                                  f"{bool(info.get('workspace_failed'))})")

    def _episode_run(self, kind: str, rng: random.Random) -> None:
        import gymnasium as gym

        import bunshin_gym  # noqa: F401 - registers the envs

        k = KINDS[kind]
        env = None
        try:
            env = _timed(self.tally, f"{kind}:make", gym.make, k.env_id, max_steps=10**6, **k.make_kwargs)
            _timed(self.tally, f"{kind}:reset", env.reset, options={"task": k.task})
            for _ in range(rng.randint(*k.ops_per_env)):
                if time.monotonic() >= self.deadline:
                    break
                op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
                self._op(kind, env, op, rng)
        except Exception:  # noqa: BLE001 - counted by _timed; a fresh env is made
            pass
        finally:
            if env is not None:
                try:
                    _timed(self.tally, f"{kind}:close", env.close)
                except Exception:  # noqa: BLE001 - counted
                    pass

    def _op(self, kind: str, env, op: str, rng: random.Random) -> None:
        u = env.unwrapped
        if op == "step":
            self._step(kind, env, rng)
        elif op == "reset":
            _timed(self.tally, f"{kind}:reset", env.reset, options={"task": KINDS[kind].task})
        elif op == "rollback_reset":
            _timed(self.tally, f"{kind}:rollback_reset", u.rollback)
        elif op == "snapshot_rollback":
            snap = _timed(self.tally, f"{kind}:snapshot", u.snapshot)
            for _ in range(rng.randint(1, 3)):
                self._step(kind, env, rng)
            _timed(self.tally, f"{kind}:rollback", u.rollback, snap)
        elif op == "clone":
            n = 1 if kind in HEAVY_LIMIT else rng.randint(1, 3)
            clones = _timed(self.tally, f"{kind}:clone", u.clone, n)
            try:
                for c in clones:
                    for _ in range(rng.randint(1, 3)):
                        self._step(kind, c, rng, op="clone_step")
            finally:
                for c in clones:
                    _timed(self.tally, f"{kind}:clone_close", c.close)
        else:
            raise AssertionError(op)


def mixed(minutes: float, threads: int, kinds: tuple[str, ...], tally: Tally, seed: int) -> dict:
    t0 = time.monotonic()
    mixer = Mixer(kinds, t0 + minutes * 60, tally, seed)
    prog = _Progress("mixed", tally, t0)
    prog.extra = lambda: "  alive " + " ".join(f"{k} {mixer.alive[k]}" for k in kinds)
    prog.start()
    workers = [threading.Thread(target=mixer.thread, args=(i,), name=f"soak-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    prog.stop_event.set()
    return {"minutes": minutes, "threads": threads, "envs": list(kinds),
            "elapsed_s": round(time.monotonic() - t0, 1)}


# the bench ---------------------------------------------------------------------------------
def _import_envs(envs: tuple[str, ...]) -> None:
    """Import the env classes up front: a long run must not import them midway (the working
    tree may change under it) nor count the first import in a make's time."""
    import gymnasium as gym

    import bunshin_gym  # noqa: F401 - registers the envs

    for kind in envs:
        entry = gym.spec(KINDS[kind].env_id).entry_point
        if isinstance(entry, str):
            gym.envs.registration.load_env_creator(entry)


def run(json_path: str | None = None, *, cycles: int = 500, minutes: float = 30.0, threads: int = 8,
        envs: tuple[str, ...] = ENV_KINDS, seed: int = 0) -> dict:
    """Run both phases and count leaks; returns (and writes) the results."""
    bad = [e for e in envs if e not in KINDS]
    if bad or not envs:
        raise ValueError(f"unknown envs {bad}: choose from {', '.join(ENV_KINDS)}")
    print(f"bench soak: {cycles} fork/close cycles ({'/'.join(MODES)}), then {minutes:g} min of "
          f"{'/'.join(envs)} envs from {threads} threads", flush=True)
    _import_envs(envs)
    made = Made()
    before_host = host_counts()
    baseline = {"children": _children(os.getpid()), "netns_fds": _netns_fds()}
    t_start = time.monotonic()
    cycle_tally, mix_tally = Tally(), Tally()
    made.start()
    try:
        p1 = fork_cycles(cycles, cycle_tally) if cycles > 0 else {"cycles": 0}
        p2 = mixed(minutes, threads, tuple(envs), mix_tally, seed) if minutes > 0 else {"minutes": 0}
    finally:
        made.stop()
    time.sleep(1.0)  # PID 1s reparented to the host's init are reaped asynchronously
    left = leaks(made, baseline)  # before any gc: gc would hide them
    after_host = host_counts()

    def tally_doc(t: Tally) -> dict:
        return {"ops": dict(t.ops), "errors": dict(t.errors), "first_errors": dict(t.messages),
                "latency": {k: percentiles(v) for k, v in sorted(t.times.items())}}

    res = {
        "params": {"cycles": cycles, "minutes": minutes, "threads": threads, "envs": list(envs), "seed": seed},
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "cycles": {**p1, **tally_doc(cycle_tally)},
        "mixed": {**p2, **tally_doc(mix_tally)},
        "made": {"workspaces": len(made.ws_ids), "snapshots": len(made.snapshots)},
        "operations": cycle_tally.total_ops() + mix_tally.total_ops(),
        "errors": cycle_tally.total_errors() + mix_tally.total_errors(),
        "leaks": {k: len(v) for k, v in left.items()},
        "leaked": {k: v[:20] for k, v in left.items() if v},
        "host_before": before_host,
        "host_after": after_host,
    }
    res["leaks_total"] = sum(res["leaks"].values())
    print(render(res), flush=True)
    return write("soak", res, json_path)


def render(res: dict) -> str:
    """The printed table of a soak result."""
    out = []
    c = res["cycles"]
    if c.get("cycles"):
        rows = [[m, s["n"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"]]
                for m, s in c.get("cycle_by_mode", {}).items() if s.get("n")]
        out.append(f"phase 1: {c['cycles']} fork/exec/close cycles in {c['elapsed_s']} s, "
                   f"{sum(c['ops'].values())} operations, {sum(c['errors'].values())} errors")
        out.append(table(rows, ["cycle (fork+exec+close)", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"]))
    m = res["mixed"]
    if m.get("minutes"):
        out.append(f"\nphase 2: {m['minutes']:g} min ({m['elapsed_s']} s) of {'/'.join(m['envs'])} envs from "
                   f"{m['threads']} threads: {sum(m['ops'].values())} operations, "
                   f"{sum(m['errors'].values())} errors")
        kinds = sorted(set(m["ops"]) | set(m["errors"]))
        rows = []
        for k in kinds:
            lat = m["latency"].get(k, {"n": 0})
            rows.append([k, m["ops"].get(k, 0), m["errors"].get(k, 0), lat.get("p50_ms", "-"),
                         lat.get("p90_ms", "-"), lat.get("p99_ms", "-"), lat.get("max_ms", "-")])
        out.append(table(rows, ["env:operation", "done", "errors", "p50 ms", "p90 ms", "p99 ms", "max ms"]))
    for name, t in (("phase 1", c), ("phase 2", m)):
        for k, msgs in t.get("first_errors", {}).items():
            out.append(f"\nfirst errors of {name} {k}:")
            out += [f"  - {msg.strip().splitlines()[0][:300]}" for msg in msgs]
    out.append(f"\nleaks after the run (before any gc; {res['made']['workspaces']} workspaces and "
               f"{res['made']['snapshots']} snapshots made by this run):")
    out.append(table([[k, v] for k, v in res["leaks"].items()], ["leaked", "count"]))
    for k, v in res["leaked"].items():
        out.append(f"  {k}: {json.dumps(v[:5])}")
    hb, ha = res["host_before"], res["host_after"]
    out.append("\nhost-wide, all sessions (context only): "
               + ", ".join(f"{k} {hb[k]} -> {ha[k]}" for k in hb))
    out.append(f"\ntotal: {res['operations']} operations, {res['errors']} errors, {res['leaks_total']} leaks "
               f"(goal 0 and 0) in {res['elapsed_s']} s")
    return "\n".join(out)
