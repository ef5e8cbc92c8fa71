"""A process holding a large deterministic heap, run INSIDE a workspace (image python3, stdlib only).

    python3 heap.py PORT MB SEED [READY_FILE]

Allocates MB MiB of deterministic pseudo-random bytes (SHAKE-256 of SEED) in one anonymous
``bytearray`` and answers one-line commands on 127.0.0.1:PORT (one command per connection):

    sha            sha256 hex of the heap
    incr           increment a counter kept in memory, answer the new value
    get            the counter
    mutate SEED    overwrite 1 MiB at an offset derived from SEED, answer the new sha256
    rewrite SEED   write that 1 MiB again with the bytes it holds (no change), answer the sha256
    pid            this process's pid (inside the workspace)

When the heap is filled and the socket listens, the process writes READY_FILE (if given).
"""

import hashlib
import os
import socket
import sys


def main() -> None:
    port, mb, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    ready = sys.argv[4] if len(sys.argv) > 4 else None
    heap = bytearray(hashlib.shake_256(seed.encode()).digest(mb << 20))
    counter = 0
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    if ready:
        with open(ready + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.rename(ready + ".tmp", ready)
    while True:
        conn, _ = srv.accept()
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            cmd = data.decode().split()
            if not cmd:
                continue
            if cmd[0] == "sha":
                out = hashlib.sha256(heap).hexdigest()
            elif cmd[0] == "incr":
                counter += 1
                out = str(counter)
            elif cmd[0] == "get":
                out = str(counter)
            elif cmd[0] == "mutate":
                patch = hashlib.shake_256(("mutate-" + cmd[1]).encode()).digest(1 << 20)
                off = int(hashlib.sha256(cmd[1].encode()).hexdigest(), 16) % (len(heap) - len(patch))
                heap[off:off + len(patch)] = patch
                out = hashlib.sha256(heap).hexdigest()
            elif cmd[0] == "rewrite":
                off = int(hashlib.sha256(cmd[1].encode()).hexdigest(), 16) % (len(heap) - (1 << 20))
                heap[off:off + (1 << 20)] = bytes(heap[off:off + (1 << 20)])
                out = hashlib.sha256(heap).hexdigest()
            elif cmd[0] == "pid":
                out = str(os.getpid())
            else:
                out = "error unknown command"
            conn.sendall(out.encode() + b"\n")


if __name__ == "__main__":
    main()
