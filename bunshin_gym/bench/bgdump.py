"""Frozen time of a snapshot, stop-the-world vs background dump, side by side in one run.

    python -m bunshin_gym.bench.bgdump [--image base|osworld] [--heap-mb 300] [--rounds 5] [--json PATH]
                                       [--log-levels 3,4]

The source is ``bench fork``'s (a 300 MB heap in three processes, or the desktop). Each round
takes one snapshot the old way (``BUNSHIN_BACKGROUND_DUMP`` unset: every page written while
frozen) and one as a background dump (``=1``, criu/patches/0020: thawed once CRIU has the
metadata, the pages written afterwards), alternating which goes first; each snapshot of the
source is a full one (the source was not restored from a snapshot). After the rounds, one
share clone is forked from the last background snapshot and must answer, so the background
snapshot is shown to restore. The host's load (``uptime``) is printed with the figures: they are
noisy on a shared host.

``--log-levels``: background snapshots are also taken with CRIU logging at these levels
(``BUNSHIN_CRIU_DUMP_VERBOSITY``), in turn with the others, to show what CRIU's log costs while
the workspace is frozen: every line is formatted and written then (17,000 lines at level 3
for a desktop).

``--fork-wait``: background snapshots are also taken with CRIU waiting for each task's
copy-on-write fork at once, its pages drained before it (``CRIU_BG_FORK_WAIT=1``, the way before
criu/patches/0036 and 0038, which let the drains and forks run while CRIU dumps the next tasks),
in turn with the others.

``--settle``: each snapshot starts after the previous one's pages are on disk (``sync``, then
0.5 s): back to back, a snapshot's frozen window overlaps the previous one's writeback into the
snapshot pool, which adds tens of milliseconds to some rounds and not others.

``--background-only``: no stop-the-world snapshots, to compare background ones with each other
(a stop-the-world snapshot freezes the source for a quarter second or more, and what the
source does after it shows in the next snapshot).

``--scans-as-before``: background snapshots are also taken with CRIU scanning every private
mapping's page tables and the whole address space for guard regions, and copying deleted files
itself (the way before criu/patches/0039 and 0040), in turn with the others.

``--ns-after-tasks``: background snapshots are also taken with the tmpfs contents and the UTS
and network namespaces dumped after the tasks, CRIU waiting for their tars and ``ip ... save``
runs (``CRIU_NS_BESIDE=0``, the way before criu/patches/0041, which dumps them beside the
tasks), in turn with the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bunshin_gym.bench.fork import make_source
from bunshin_gym.config import background_dump, criu_dump_verbosity, criu_overridden, overridden
from bunshin_gym.workspace.dumping import BACKGROUND_DUMP_ENV as ENV
from bunshin_gym.workspace.errors import ForkError


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


#: the variable ``--log-levels`` sets for a snapshot
LOG_LEVEL_ENV = "BUNSHIN_CRIU_DUMP_VERBOSITY"


@dataclass(frozen=True)
class OldWay:
    """A way CRIU dumped before one of its patches, taken back by CRIU's own switches: a side
    (``--fork-wait``, ...) of background snapshots taken that way, in turn with the others."""

    flag: str  #: the option (``bench bgdump --fork-wait``) and ``run()``'s keyword (``fork_wait``)
    side: str  #: the name of its rows
    env: dict[str, str]  #: CRIU's switches it sets
    what: str  #: how its snapshots are taken, for the summary and the help
    before: str  #: the patches it undoes

    @property
    def keyword(self) -> str:
        return self.flag.replace("-", "_")


#: every old way a run can add, in the order they run
OLD_WAYS = (
    OldWay("fork-wait", "background, forks waited at once", {"CRIU_BG_FORK_WAIT": "1"},
           "each fork waited at once", "0036, 0038"),
    OldWay("scans-as-before", "background, scans and copies as before",
           {"CRIU_SMAPS_SKIP": "0", "CRIU_GUARD_SCAN_ALL": "1", "CRIU_GHOST_COPY_LATE": "0"},
           "every mapping and the whole address space scanned and deleted files copied by CRIU", "0039, 0040"),
    OldWay("ns-after-tasks", "background, namespaces after the tasks", {"CRIU_NS_BESIDE": "0"},
           "the tmpfs contents and namespaces dumped after the tasks", "0041"),
)
#: the side each old way adds
FORK_WAIT_SIDE, SCANS_AS_BEFORE_SIDE, NS_AFTER_TASKS_SIDE = (w.side for w in OLD_WAYS)
#: every CRIU switch a side may set (the others' are unset for it)
_CRIU_SWITCHES = tuple(name for w in OLD_WAYS for name in w.env)
#: how long ``--settle`` waits after ``sync`` before a snapshot
SETTLE_S = 0.5


def _snapshot(ws, background: bool, log_level: int | None = None, criu: dict[str, str] | None = None,
              settle: bool = False) -> tuple[dict, object]:
    if settle:
        os.sync()
        time.sleep(SETTLE_S)
    settings = {ENV: "1" if background else "0"}
    if log_level is not None:
        settings[LOG_LEVEL_ENV] = str(log_level)
    switches = {name: (criu or {}).get(name) for name in _CRIU_SWITCHES}
    with overridden(settings), criu_overridden(switches):
        assert background_dump() == background
        for attempt in range(3):
            t = time.perf_counter()
            try:
                snap = ws.snapshot()
                break
            except ForkError as e:  # a desktop just booted can hold fds in flight a moment
                if attempt == 2:
                    raise
                print(f"  snapshot failed, again in 2 s: {e}")
                time.sleep(2)
        total = round((time.perf_counter() - t) * 1000, 1)
    timings = snap.metadata.timings
    row = {k: timings.get(k) for k in ("frozen_ms", "dump_ms", "background_ms", "files_ms", "freeze_ms")}
    row["snapshot_ms"] = total
    row["bytes"] = snap.metadata.criu_bytes
    return row, snap


def run(image: str = "base", heap_mb: int = 300, rounds: int = 5, json_path: str | None = None,
        log_levels: tuple[int, ...] = (), fork_wait: bool = False, scans_as_before: bool = False,
        settle: bool = False, background_only: bool = False, ns_after_tasks: bool = False) -> dict:
    procs = 3 if image == "base" else 0
    level = criu_dump_verbosity()
    asked = {"fork_wait": fork_wait, "scans_as_before": scans_as_before, "ns_after_tasks": ns_after_tasks}
    old_ways = [w for w in OLD_WAYS if asked[w.keyword]]
    print(f"bench bgdump: image {image!r}, heap {heap_mb if procs else 0} MB; {rounds} rounds; CRIU log level "
          f"{level}{''.join(f', and {n}' for n in log_levels)}{''.join(f'; {w.side} too' for w in old_ways)}"
          f"{'; each snapshot after sync and a pause' if settle else ''}; load {_load()}")
    ws = make_source(image, heap_mb, procs)
    #: name -> (background, CRIU log level or None: the configured one, CRIU switches set)
    sides = {**({} if background_only else {"stop-the-world": (False, None, None)}), "background": (True, None, None),
             **{f"background, log level {n}": (True, n, None) for n in log_levels},
             **{w.side: (True, None, w.env) for w in old_ways}}
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    snaps = []
    try:
        for i in range(rounds):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                row, snap = _snapshot(ws, *sides[name], settle=settle)
                rows[name].append(row)
                print(f"  round {i + 1} {name:<32}: frozen "
                      f"{row['frozen_ms']:8.1f} ms, whole snapshot {row['snapshot_ms']:8.1f} ms, "
                      f"{row['bytes'] / 2**20:7.1f} MiB")
                snaps.append(snap)
                while len(snaps) > 1:
                    snaps.pop(0).delete()
        last = snaps[-1]
        if not rows["background"] or last.metadata.timings.get("background_ms") is None:
            last_row, last = _snapshot(ws, True)
            snaps.append(last)
        (clone,) = last.fork(1, mode="share")
        try:
            alive = clone.exec("echo alive").text.strip() == "alive"
        finally:
            clone.close()
    finally:
        ws.close()
        for s in snaps:
            s.delete()
    res: dict = {"image": image, "heap_mb": heap_mb if procs else 0, "rounds": rounds, "settle": settle,
                 "background_only": background_only, "load_end": _load(), "criu_log_level": level,
                 "clone_of_background_snapshot_answers": alive, "runs": rows, "median": {}}
    for name, rs in rows.items():
        res["median"][name] = {k: statistics.median(r[k] for r in rs if r[k] is not None)
                               for k in ("frozen_ms", "snapshot_ms", "bytes") if any(r[k] is not None for r in rs)}
    bg = res["median"]["background"]
    if background_only:
        print(f"median frozen: background {bg['frozen_ms']:.1f} ms; whole snapshot {bg['snapshot_ms']:.1f} ms; "
              f"a share clone of the background snapshot answers: {alive}; load {res['load_end']}")
    else:
        stw = res["median"]["stop-the-world"]
        print(f"median frozen: stop-the-world {stw['frozen_ms']:.1f} ms, background {bg['frozen_ms']:.1f} ms; whole "
              f"snapshot {stw['snapshot_ms']:.1f} vs {bg['snapshot_ms']:.1f} ms; a share clone of the background "
              f"snapshot answers: {alive}; load {res['load_end']}")
    for n in log_levels:
        print(f"median frozen, background at CRIU log level {n}: "
              f"{res['median'][f'background, log level {n}']['frozen_ms']:.1f} ms")
    for w in old_ways:
        print(f"median frozen, background with {w.what} (before {w.before}): {res['median'][w.side]['frozen_ms']:.1f} "
              f"ms; lower in {_rounds_lower(rows['background'], rows[w.side])} of {rounds} rounds")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="base")
    ap.add_argument("--heap-mb", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--log-levels", default="", help="CRIU log levels to take background snapshots at too")
    add_old_way_options(ap)
    ap.add_argument("--settle", action="store_true", help="each snapshot after sync and a 0.5 s pause")
    ap.add_argument("--background-only", action="store_true", help="no stop-the-world snapshots")
    a = ap.parse_args()
    run(a.image, a.heap_mb, a.rounds, a.json, log_levels=parse_levels(a.log_levels), fork_wait=a.fork_wait,
        scans_as_before=a.scans_as_before, settle=a.settle, background_only=a.background_only,
        ns_after_tasks=a.ns_after_tasks)


def add_old_way_options(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--fork-wait`` and the other old ways, as options of ``ap`` (help text after ``prefix``)."""
    for w in OLD_WAYS:
        switches = ", ".join(f"{k}={v}" for k, v in w.env.items())
        ap.add_argument(f"--{w.flag}", action="store_true",
                        help=f"{prefix}background snapshots with {w.what} too ({switches}, as before "
                             f"criu/patches/{w.before}), side by side")


def _rounds_lower(rows: list[dict], others: list[dict]) -> int:
    """In how many rounds the first side was frozen for less time than the other."""
    return sum(a["frozen_ms"] < b["frozen_ms"] for a, b in zip(rows, others, strict=True))


def parse_levels(text: str | None) -> tuple[int, ...]:
    """``--log-levels``: "3,4" -> (3, 4); CRIU's levels are 0-4."""
    levels = tuple(int(x) for x in (text or "").split(",") if x.strip())
    bad = [n for n in levels if not 0 <= n <= 4]
    if bad:
        raise ValueError(f"CRIU log levels are 0-4, not {bad}")
    return levels


if __name__ == "__main__":
    main()
