"""A TCP client/server pair exchanging a counter over 127.0.0.1, run INSIDE a workspace.

    python3 tcp_pair.py server PORT STATE_FILE
    python3 tcp_pair.py client PORT STATE_FILE

The server accepts connections and answers each number with the number plus one; the
client connects ONCE and keeps sending the last answer back (about 200 round trips a
second). Each side rewrites its STATE_FILE after every exchange::

    server: "<connections accepted> <last number received>"
    client: "<counter> <local port> <connects (always 1)>"

A broken connection is never re-established: the side that sees it writes "error ..." to
its state file and exits 1, so a clone whose connection did not survive is visible.
"""

import os
import socket
import sys
import time


def write_state(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)


def recv_line(f) -> int:
    line = f.readline()
    if not line:
        raise ConnectionError("peer closed the connection")
    return int(line)


def server(port: int, state: str) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(4)
    write_state(state, "0 -1")
    accepted = 0
    conn, _ = srv.accept()
    accepted += 1
    f = conn.makefile("rwb", buffering=0)
    try:
        while True:
            n = recv_line(f)
            f.write(f"{n + 1}\n".encode())
            write_state(state, f"{accepted} {n}")
    except (OSError, ValueError) as e:
        write_state(state, f"error {type(e).__name__}: {e}")
        sys.exit(1)


def client(port: int, state: str) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    f = sock.makefile("rwb", buffering=0)
    n = 0
    try:
        while True:
            f.write(f"{n}\n".encode())
            n = recv_line(f)
            write_state(state, f"{n} {sock.getsockname()[1]} 1")
            time.sleep(0.005)
    except (OSError, ValueError) as e:
        write_state(state, f"error {type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    role, port, state = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    (server if role == "server" else client)(port, state)
