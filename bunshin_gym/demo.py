"""``bunshin demo``: a tour of what a workspace does, with real figures.

Starts a workspace, runs commands in it, gives it state worth forking (a process holding
100 MB of heap and a sqlite database), forks it into clones that diverge, rolls one back,
and prints the memory the clones use in each memory mode next to private copies.
"""

from __future__ import annotations

import time

from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.memory import share_anon_mechanism
from bunshin_gym.workspace.memstat import group_memory

HEAP = "import os, time\nb = bytearray(os.urandom(100 * 2**20))\nopen('/tmp/ready', 'w').close()\ntime.sleep(1e9)\n"


def _say(msg: str) -> None:
    print(f"\033[1m==>\033[0m {msg}", flush=True)


def main() -> int:
    t0 = time.perf_counter()
    with Workspace.create("base") as ws:
        _say(f"started {ws.id} from image 'base' in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        for cmd in ("uname -n", "ps -eo pid,comm", "ip -br link", "id user"):
            print(f"$ {cmd}\n{ws.exec(cmd).text.rstrip()}")
        ws.write_file("/opt/heap.py", HEAP)
        ws.spawn(["python3", "/opt/heap.py"])
        ws.exec("sqlite3 /root/shop.db 'create table cart(item text); insert into cart values (\"book\")'", check=True)
        while ws.exec("test -e /tmp/ready").exit_code:
            time.sleep(0.1)
        _say(f"source holds a 100 MB heap: {group_memory(ws.pids()).as_mb()['pss']} MB PSS")

        snap = ws.snapshot()
        t = snap.meta["timings"]
        _say(f"snapshot {snap.id}: source frozen {t['frozen_ms']:.0f} ms "
             f"(files {t['files_ms']:.0f} ms, CRIU dump {t['dump_ms']:.0f} ms), image {snap.size() / 2**20:.0f} MB")
        for mode in ("copy", "share"):
            t0 = time.perf_counter()
            clones = snap.fork(4, mode=mode)
            fan = time.perf_counter() - t0
            for i, c in enumerate(clones):
                c.exec(f"sqlite3 /root/shop.db \"insert into cart values ('clone {i}')\"", check=True)
            carts = [c.exec("sqlite3 /root/shop.db 'select group_concat(item) from cart'").text.strip()
                     for c in clones]
            mem = group_memory([p for c in clones for p in c.pids()])
            suffix = f" (anonymous memory via {share_anon_mechanism()})" if mode == "share" else ""
            _say(f"4 clones in mode {mode!r}{suffix}: restored in {fan:.2f} s, together {mem.unique_mb} MB "
                 f"of distinct pages (private copies would need about {4 * 100 + 4 * 12} MB)")
            print("   carts diverged: " + "; ".join(carts))
            if mode == "share":
                t0 = time.perf_counter()
                clones[0].rollback(snap)
                _say(f"rolled {clones[0].id} back in {(time.perf_counter() - t0) * 1e3:.0f} ms: cart = "
                     + clones[0].exec("sqlite3 /root/shop.db 'select group_concat(item) from cart'").text.strip())
            for c in clones:
                c.close()
        print("   source's cart unchanged: "
              + ws.exec("sqlite3 /root/shop.db 'select group_concat(item) from cart'").text.strip())
        snap.delete()
    _say(f"closed {ws.id}; everything it created is reclaimed (bunshin gc finds nothing)")
    return 0
