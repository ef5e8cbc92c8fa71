"""Chromium's process model in a desktop workspace, before and after, side by side in one run.

    .venv/bin/python bench/chromium_process_model.py [--rounds 3] [--clones 8] [--json PATH]

Every chromium process is one more task that a snapshot freezes, dumps and restores, and
one more set of page tables, VMAs and threads in every clone. This runs the desktop source
of ``bunshin bench fork`` (Xvfb, openbox, a terminal and chromium on a page) with chromium's
flags as they were before envs/osworld/image/chromium.sh gained the process-model flags
(``--zygote``-less start, GPU and network service inside the browser process, no spare
renderer), and as they are now, rounds alternating which goes first. "before" starts the
same binary with the old flag set in full (``/usr/lib/chromium/chromium``, not the wrapper),
so both sides run in the same image. Per side: chromium's processes and threads, the
frozen time of a first snapshot (stop-the-world), the fan-out of ``--clones`` share clones,
and the clones' memory (distinct resident pages of all their processes, shared pages
counted once, and PSS). The page must be open in a clone (DevTools' tab list).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bunshin_gym.bench.fork import SOURCE_PAGE, make_source
from bunshin_gym.workspace.memstat import group_memory

#: chromium's flags before the process-model change (envs/osworld/image/chromium.sh at e3d71f0)
BEFORE = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
    "--disable-default-apps", "--disable-extensions", "--no-default-browser-check",
    "--disable-breakpad", "--disable-crash-reporter", "--password-store=basic", "--use-mock-keychain",
    "--disable-features=Translate,MediaRouter,OptimizationHints,OptimizationGuideModelDownloading,"
    "AutofillServerCommunication,OnDeviceModelPerformanceParams",
    "--force-renderer-accessibility", "--disable-session-crashed-bubble", "--hide-crash-restore-bubble",
    "--user-data-dir=/home/user/.config/chromium-bunshin", "--remote-debugging-port=9222",
]
COUNT = ("for p in /proc/[0-9]*; do c=$(cat $p/comm 2>/dev/null); case $c in chrom*) "
         "echo $c $(ls $p/task | wc -l);; esac; done 2>/dev/null")
TABS = ("python3 -c \"import urllib.request, json; "
        "print([t['url'] for t in json.load(urllib.request.urlopen('http://127.0.0.1:9222/json/list'))])\"")


def one(side: str, clones: int) -> dict:
    chromium = ("/usr/lib/chromium/chromium", *BEFORE) if side == "before" else ("chromium",)
    ws = make_source("osworld", 0, 0, chromium=chromium)
    try:
        procs = [line.split() for line in ws.exec(COUNT, user="root").text.splitlines() if line.strip()]
        t = time.perf_counter()
        snap = ws.snapshot()
        snapshot_s = time.perf_counter() - t
        frozen_ms = snap.metadata.timings.get("frozen_ms")
        try:
            t = time.perf_counter()
            forked = snap.fork(clones, mode="share")
            fanout_s = time.perf_counter() - t
            try:
                tabs = forked[0].exec(TABS, user="user").text.strip()
                mem = group_memory([p for c in forked for p in c.pids()])
            finally:
                for c in forked:
                    c.close()
        finally:
            snap.delete()
    finally:
        ws.close()
    return {"side": side, "chromium_processes": len(procs), "chromium_threads": sum(int(n) for _, n in procs),
            "frozen_ms": frozen_ms, "snapshot_ms": round(snapshot_s * 1e3, 1),
            "fanout_s": round(fanout_s, 3), "clones_unique_mb": mem.unique_mb,
            "clones_pss_mb": round(mem.pss / 2**20, 1), "page_open_in_clone": SOURCE_PAGE in tabs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clones", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows: list[dict] = []
    for i in range(a.rounds):
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            row = one(side, a.clones)
            rows.append(row)
            print(f"  round {i + 1} {side:6s}: {row}", flush=True)
    keys = ("chromium_processes", "chromium_threads", "frozen_ms", "snapshot_ms", "fanout_s",
            "clones_unique_mb", "clones_pss_mb")
    med = {s: {k: statistics.median(r[k] for r in rows if r["side"] == s) for k in keys} for s in ("before", "after")}
    shown = "all" if all(r["page_open_in_clone"] for r in rows) else "NOT all"
    print(f"\nmedians over {a.rounds} rounds, {a.clones} share clones ({shown} clones show the page):")
    print(f"{'':20s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for k in keys:
        b, f = med["before"][k], med["after"][k]
        print(f"{k:20s} {b:10.1f} {f:10.1f} {f / b if b else float('nan'):13.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rows, "median": med, "clones": a.clones}, indent=1) + "\n")


if __name__ == "__main__":
    main()
