"""Frozen time of a snapshot, stop-the-world vs background dump, side by side in one run.

    python -m bunshin_gym.bench.bgdump [--image base|osworld] [--heap-mb 300] [--rounds 5] [--json PATH]

The source is ``bench fork``'s (a 300 MB heap in three processes, or the desktop). Each round
takes one snapshot the old way (``BUNSHIN_BACKGROUND_DUMP`` unset: every page written while
frozen) and one as a background dump (``=1``, criu/patches/0020: thawed once CRIU has the
metadata, the pages written afterwards), alternating which goes first; each snapshot of the
source is a full one (the source was not restored from a snapshot). After the rounds, one
share clone is forked from the last background snapshot and must answer, so the background
snapshot is shown to restore. The host's load (``uptime``) is printed with the figures: they are
noisy on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bunshin_gym.bench.fork import make_source
from bunshin_gym.config import background_dump
from bunshin_gym.workspace.dumping import BACKGROUND_DUMP_ENV as ENV
from bunshin_gym.workspace.errors import ForkError


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _snapshot(ws, background: bool) -> tuple[dict, object]:
    old = os.environ.get(ENV)
    os.environ[ENV] = "1" if background else "0"
    try:
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
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
    timings = snap.metadata.timings
    row = {k: timings.get(k) for k in ("frozen_ms", "dump_ms", "background_ms", "files_ms", "freeze_ms")}
    row["snapshot_ms"] = total
    row["bytes"] = snap.metadata.criu_bytes
    return row, snap


def run(image: str = "base", heap_mb: int = 300, rounds: int = 5, json_path: str | None = None) -> dict:
    procs = 3 if image == "base" else 0
    print(f"bench bgdump: image {image!r}, heap {heap_mb if procs else 0} MB; {rounds} rounds; load {_load()}")
    ws = make_source(image, heap_mb, procs)
    rows: dict[str, list[dict]] = {"stop-the-world": [], "background": []}
    snaps = []
    try:
        for i in range(rounds):
            for background in ((False, True) if i % 2 == 0 else (True, False)):
                row, snap = _snapshot(ws, background)
                rows["background" if background else "stop-the-world"].append(row)
                print(f"  round {i + 1} {'background    ' if background else 'stop-the-world'}: frozen "
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
    res: dict = {"image": image, "heap_mb": heap_mb if procs else 0, "rounds": rounds, "load_end": _load(),
                 "clone_of_background_snapshot_answers": alive, "runs": rows, "median": {}}
    for name, rs in rows.items():
        res["median"][name] = {k: statistics.median(r[k] for r in rs if r[k] is not None)
                               for k in ("frozen_ms", "snapshot_ms", "bytes") if any(r[k] is not None for r in rs)}
    print(f"median frozen: stop-the-world {res['median']['stop-the-world']['frozen_ms']:.1f} ms, background "
          f"{res['median']['background']['frozen_ms']:.1f} ms; whole snapshot "
          f"{res['median']['stop-the-world']['snapshot_ms']:.1f} vs {res['median']['background']['snapshot_ms']:.1f} "
          f"ms; a share clone of the background snapshot answers: {alive}; load {res['load_end']}")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="base")
    ap.add_argument("--heap-mb", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    run(a.image, a.heap_mb, a.rounds, a.json)


if __name__ == "__main__":
    main()
