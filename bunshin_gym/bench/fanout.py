"""Fan-out only: the fork path before :mod:`bunshin_gym.workspace.fanout` and today's, side by
side from one snapshot per memory mode, alternating, with the clones' memory right after restore.

``bunshin bench fork --modes share-before,share`` measures the same and much more (activity,
delta snapshots, rollbacks): on a busy host that took past 30 min for four labels; this takes a
few minutes. Each row: fan-out seconds (until every clone's agent answered), distinct resident
MB and PSS of the clones, the host's 1-minute load before and after, and the fork's phases
(:meth:`fanout.FanoutTrace.phases`: seconds summed over the clones, first start-last end).

    python -m bunshin_gym.bench.fanout --counts 1,8,16 --modes share,copy --json out.json
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from bunshin_gym.bench.fork import make_source
from bunshin_gym.bench.report import write
from bunshin_gym.workspace import Workspace, fanout
from bunshin_gym.workspace.errors import ForkError
from bunshin_gym.workspace.memstat import group_memory

log = logging.getLogger(__name__)

PATHS = {"before": fanout.BEFORE, "today": fanout.DEFAULT}
#: a desktop dump now and then meets a unix message carrying descriptors in flight (CRIU:
#: "Control messages in queue, not supported"); the snapshot is taken again
SNAPSHOT_TRIES = 4


def _snapshot(src: Workspace):
    for attempt in range(1, SNAPSHOT_TRIES + 1):
        try:
            return src.snapshot()
        except ForkError as e:
            if attempt == SNAPSHOT_TRIES:
                raise
            log.warning("snapshot of the source failed (try %d): %s", attempt, e)
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _fork(snap, n: int, mode: str, path: str) -> dict:
    load0 = os.getloadavg()[0]
    with fanout.using(PATHS[path]), fanout.tracing() as trace:
        t0 = time.perf_counter()
        clones = snap.fork(n, mode=mode)
        seconds = time.perf_counter() - t0
    try:
        mem = group_memory([p for c in clones for p in c.pids()]).as_mb()
    finally:
        for c in clones:
            c.close()
    return {"mode": mode, "n": n, "path": path, "fanout_s": round(seconds, 3), "unique_mb": mem["unique"],
            "pss_mb": mem["pss"], "load": [round(load0, 1), round(os.getloadavg()[0], 1)], "phases": trace.phases()}


def run(json_path: str | None = None, *, image: str = "osworld", counts: tuple[int, ...] = (1, 8, 16),
        modes: tuple[str, ...] = ("share", "copy")) -> dict:
    rows = []
    for mode in modes:
        src = make_source(image, 0, 0)
        try:
            snap = _snapshot(src)
            try:
                for n in counts:
                    for path in PATHS:  # alternating: both see the same load, as far as it holds
                        row = _fork(snap, n, mode, path)
                        rows.append(row)
                        print(f"{mode:>6} n={n:<3} {path:>6}  fan-out {row['fanout_s']:7.2f} s  unique "
                              f"{row['unique_mb']:8.1f} MB  pss {row['pss_mb']:8.1f} MB  load {row['load'][0]:.0f}"
                              f"->{row['load'][1]:.0f}\n{'':14}" + "  ".join(
                                  f"{k} {r['sum_s']:.2f} ({r['first_s']:.2f}-{r['last_s']:.2f})"
                                  for k, r in row["phases"].items()), flush=True)
            finally:
                snap.delete()
        finally:
            src.close()
    return write("fanout", {"image": image, "rows": rows}, json_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="osworld")
    ap.add_argument("--counts", default="1,8,16")
    ap.add_argument("--modes", default="share,copy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run(args.json, image=args.image, counts=tuple(int(c) for c in args.counts.split(",")),
        modes=tuple(args.modes.split(",")))


if __name__ == "__main__":
    main()
