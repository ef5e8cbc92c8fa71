"""The main job until training lands: a tour of what a workspace does, with real figures."""

from __future__ import annotations

import time

from bunshin_gym.workspace import Workspace


def main() -> int:
    t0 = time.perf_counter()
    with Workspace.create("base") as ws:
        print(f"started {ws.id} from image 'base' in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        for cmd in ("uname -n", "ps -eo pid,comm", "ip -br link", "id user"):
            res = ws.exec(cmd)
            print(f"$ {cmd}\n{res.text.rstrip()}")
        ws.write_file("/home/user/notes.txt", "written by the controller\n", owner="user")
        print("$ cat /home/user/notes.txt\n" + ws.exec("cat /home/user/notes.txt").text.rstrip())
        m = ws.memory()
        print(f"memory: PSS {m.pss / 2**20:.1f} MB over {m.processes} processes")
    print(f"closed {ws.id}; everything it created is reclaimed")
    return 0
