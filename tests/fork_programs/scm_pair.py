"""Descriptors in flight: a socketpair split over two processes, each end holding an unread
message that carries open files (SCM_RIGHTS), run INSIDE a workspace.

    python3 scm_pair.py DIR

chromium's IPC looks like this at any instant: a browser and a renderer on two ends of one
socketpair, with a message and its descriptors queued and not yet read. The parent keeps
end A, a forked child keeps end B; each sends the other one message with two descriptors (a
file it wrote and the read end of a pipe it filled), then writes ``DIR/<side>.ready`` and
waits for ``DIR/go``. On go, each reads its queued message, reads both received
descriptors, and writes what it got to ``DIR/<side>.out``::

    <message text> | <file text> | <pipe text>

or ``error ...`` if anything is missing, so a clone whose queued descriptors were lost shows it.
"""

import os
import socket
import sys
import time


def send_side(sock: socket.socket, side: str, d: str) -> None:
    path = f"{d}/{side}.file"
    with open(path, "w") as f:
        f.write(f"file-of-{side}")
    fobj = os.open(path, os.O_RDONLY)
    r, w = os.pipe()
    os.write(w, f"pipe-of-{side}".encode())
    os.close(w)
    socket.send_fds(sock, [f"message-from-{side}".encode()], [fobj, r])
    os.close(fobj)  # only the queued message holds them now
    os.close(r)


def receive(sock: socket.socket) -> str:
    msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4)
    if len(fds) != 2:
        return f"error: {len(fds)} descriptors received"
    fobj, r = fds
    os.lseek(fobj, 0, os.SEEK_SET)
    return f"{msg.decode()} | {os.read(fobj, 100).decode()} | {os.read(r, 100).decode()}"


def run(sock: socket.socket, side: str, d: str) -> None:
    send_side(sock, side, d)
    with open(f"{d}/{side}.ready", "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(f"{d}/go"):
        time.sleep(0.05)
    try:
        out = receive(sock)
    except Exception as e:  # noqa: BLE001 -- the clone's failure is what the test reads
        out = f"error: {e!r}"
    with open(f"{d}/{side}.out.tmp", "w") as f:
        f.write(out + "\n")
    os.replace(f"{d}/{side}.out.tmp", f"{d}/{side}.out")
    time.sleep(3600)


def main() -> None:
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.fork() == 0:
        a.close()
        run(b, "child", d)
    else:
        b.close()
        run(a, "parent", d)


if __name__ == "__main__":
    main()
