"""Memory of N kmod clones vs N copy clones of one snapshot, side by side (run in the e2e VM by
kmod/tests/e2e-stage2.sh, with the bunshin_share module loaded).

A workspace holds a heap (heap.py: MB MiB of pseudo-random bytes in one anonymous bytearray);
one snapshot of it is forked N times in memory mode "kmod", measured, closed, then N times in
"copy", measured. ``unique`` counts every physical page the clones map once
(bunshin_gym.workspace.memstat.group_memory), ``unique_anon`` only their anonymous memory. The
kmod rows are measured without and with the snapshot's holder (the frozen copy restore whose
pages the clones share), then again after every clone overwrote 1 MiB of its heap.

Prints a table between E2E_MEMORY_TABLE / E2E_MEMORY_END and one line E2E_MEMORY_JSON {...}
(the host writes it to kmod/build/e2e.json).
    BUNSHIN_E2E_CLONES (4), BUNSHIN_E2E_HEAP_MB (64)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fork_programs import host  # noqa: E402
from fork_programs.host import heap  # noqa: E402

from bunshin_gym.workspace import Workspace, kmod, records  # noqa: E402
from bunshin_gym.workspace.cgroups import Cgroup  # noqa: E402
from bunshin_gym.workspace.memstat import group_memory  # noqa: E402

N = int(os.environ.get("BUNSHIN_E2E_CLONES", "4"))
MB = int(os.environ.get("BUNSHIN_E2E_HEAP_MB", "64"))
PORT = 7331
PAGE = os.sysconf("SC_PAGE_SIZE")


def say(msg: str) -> None:
    print(f"== memory: {msg}", flush=True)


def measure(pids: list[int]) -> dict:
    """MiB of the group's memory (``unique``, ``unique_anon``, ``pss``, ``rss``) and its process count."""
    return group_memory(pids).as_mb()


def pids_of(*recs: records.Record) -> list[int]:
    return [pid for r in recs for pid in Cgroup(r.cgroup).pids()]


def _pfns(pagemap: int, start: int, end: int):
    raw = os.pread(pagemap, (end - start) // PAGE * 8, start // PAGE * 8)
    for i in range(len(raw) // 8):
        e = int.from_bytes(raw[8 * i:8 * i + 8], "little")
        yield (e & ((1 << 55) - 1)) if e >> 63 else None


def own_pages(clone: records.Record, holder: records.Record) -> list[str]:
    """Where a kmod clone's anonymous memory is its own (present, not the holder's frame at the
    same address): the ranges served by copying plus whatever the clone wrote since it resumed."""
    cpids = kmod.tree_by_ns_pid(clone.pid1, Cgroup(clone.cgroup).pids())
    hpids = kmod.tree_by_ns_pid(holder.pid1, Cgroup(holder.cgroup).pids())
    out = []
    for inner, cpid in sorted(cpids.items()):
        hpid = hpids.get(inner)
        if hpid is None:
            continue
        comm = Path(f"/proc/{cpid}/comm").read_text().strip()
        cfd, hfd = os.open(f"/proc/{cpid}/pagemap", os.O_RDONLY), os.open(f"/proc/{hpid}/pagemap", os.O_RDONLY)
        try:
            for v in kmod.parse_maps(Path(f"/proc/{cpid}/maps").read_text()):
                if not v.private_anon:
                    continue
                own = sum(1 for c, h in zip(_pfns(cfd, v.start, v.end), _pfns(hfd, v.start, v.end), strict=True)
                          if c is not None and c != h)
                if own:
                    out.append(f"{comm}:{v.path or hex(v.start)}({v.perms}) {own}")
        finally:
            os.close(cfd)
            os.close(hfd)
    return out


def main() -> int:
    os.environ.pop(kmod.DOUBLE_ENV, None)
    assert kmod.sharer().name == "module", "the bunshin_share module is not loaded"
    out: dict = {"clones": N, "heap_mb": MB, "kernel": os.uname().release}
    ws = Workspace.create("base", memory_mode="kmod")
    snap = None
    try:
        t = time.perf_counter()
        host.heap_start(ws, PORT, MB, "mem")
        say(f"source heap of {MB} MiB filled in {time.perf_counter() - t:.1f} s")
        want = host.heap_expected(MB, "mem")
        out["source"] = measure(pids_of(ws._rec))
        snap = ws.snapshot()
        for mode in ("kmod", "copy"):
            holder_s = None
            if mode == "kmod":  # the snapshot's holder (a copy restore, frozen), timed on its own
                t = time.perf_counter()
                kmod.holder_for(snap)
                holder_s = round(time.perf_counter() - t, 2)
                say(f"holder restored and frozen in {holder_s} s")
            t = time.perf_counter()
            clones = snap.fork(N, mode=mode)
            fork_s = round(time.perf_counter() - t, 2)
            try:
                say(f"{N} {mode} clones forked in {fork_s} s")
                if mode == "kmod":
                    [holder] = kmod.holders_of(snap.id)
                    own = own_pages(clones[0]._rec, holder)
                    say(f"pages of clone 0 not the holder's (process:vma pages): {', '.join(own)}")
                for c in clones:
                    assert heap(c, PORT, "sha") == want, f"{c.id}: heap differs"
                recs = [c._rec for c in clones]
                row = {"fork_s": fork_s, "clones": measure(pids_of(*recs))}
                if holder_s is not None:
                    row["holder_s"] = holder_s
                    row["own_pages_clone0"] = own
                if mode == "kmod":
                    row["clones_and_holder"] = measure(pids_of(*recs, holder))
                    row["served"] = [c._rec.kmod.to_json() for c in clones]
                for i, c in enumerate(clones):
                    heap(c, PORT, "mutate", f"w{i}")
                row["after_1mib_write"] = measure(pids_of(*recs))
                if mode == "kmod":
                    row["after_1mib_write_and_holder"] = measure(pids_of(*recs, holder))
                out[mode] = row
            finally:
                for c in clones:
                    c.close()
    finally:
        ws.close()
        if snap is not None:
            snap.delete()

    k, c = out["kmod"], out["copy"]
    rows = [
        ("source workspace", out["source"]),
        (f"{N} copy clones", c["clones"]),
        (f"{N} kmod clones", k["clones"]),
        (f"{N} kmod clones + holder", k["clones_and_holder"]),
        (f"{N} copy clones, 1 MiB written each", c["after_1mib_write"]),
        (f"{N} kmod clones, 1 MiB written each", k["after_1mib_write"]),
        (f"{N} kmod clones + holder, 1 MiB written", k["after_1mib_write_and_holder"]),
    ]
    print("E2E_MEMORY_TABLE")
    print(f"{N} clones of a workspace holding a {MB} MiB heap (kernel {out['kernel']}, qemu TCG)")
    print(f"{'group':44} {'unique MiB':>11} {'anon MiB':>9} {'PSS MiB':>8} {'RSS MiB':>8}")
    for name, m in rows:
        print(f"{name:44} {m['unique']:>11} {m['unique_anon']:>9} {m['pss']:>8} {m['rss']:>8}")
    print(f"fork of {N} (TCG): kmod {k['fork_s']} s after the holder ({k['holder_s']} s), copy {c['fork_s']} s; "
          f"module sharing per clone {', '.join(str(s['ms']) for s in k['served'])} ms")
    print(f"kmod clones / copy clones, unique: {k['clones']['unique'] / c['clones']['unique']:.3f}; "
          f"with the holder: {k['clones_and_holder']['unique'] / c['clones']['unique']:.3f}")
    print("E2E_MEMORY_END")
    print("E2E_MEMORY_JSON " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
