"""Socket buffer sizes a program set or left alone, run INSIDE a workspace.

    python3 sockbufs.py DIR

Makes sockets of every family a workspace's apps use (unix stream and datagram pairs, a TCP
listener and a connected TCP pair on loopback, a UDP socket), some with the buffer sizes the
kernel gave them, some with sizes set by SO_SNDBUF/SO_RCVBUF (small, large, below the
minimum), and one unix pair with bytes queued and not yet read. Writes ``DIR/ready`` and
waits for ``DIR/go``; then writes ``DIR/report``: per socket its SO_SNDBUF, SO_RCVBUF and
SO_BUF_LOCK as getsockopt() reads them, and the queued bytes' digest as the reader gets them.
A clone must write the report its source writes.
"""

import hashlib
import os
import socket
import sys
import time

SO_BUF_LOCK = getattr(socket, "SO_BUF_LOCK", 72)  # Linux 5.14; Python 3.11 lacks the name
QUEUED = bytes(range(256)) * 40  # 10 KiB left unread in a unix stream pair


def sized(sock: socket.socket, snd: int | None, rcv: int | None) -> socket.socket:
    if snd is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, snd)
    if rcv is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcv)
    return sock


def line(name: str, sock: socket.socket) -> str:
    get = sock.getsockopt
    return (f"{name} snd={get(socket.SOL_SOCKET, socket.SO_SNDBUF)} rcv={get(socket.SOL_SOCKET, socket.SO_RCVBUF)} "
            f"lock={get(socket.SOL_SOCKET, SO_BUF_LOCK)}")


def main() -> None:
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    socks: dict[str, socket.socket] = {}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socks |= {"unix-stream-default-a": a, "unix-stream-default-b": b}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    socks |= {"unix-dgram-set-a": sized(a, 12345, 65536), "unix-dgram-set-b": sized(b, 1, None)}  # 1: the minimum
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sized(a, 1 << 20, 1 << 19)
    a.sendall(QUEUED)
    socks |= {"unix-stream-queued-a": a, "unix-stream-queued-b": sized(b, None, 300000)}
    listener = sized(socket.socket(socket.AF_INET, socket.SOCK_STREAM), None, 1 << 18)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = sized(socket.socket(socket.AF_INET, socket.SOCK_STREAM), 1 << 18, 1 << 17)
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    socks |= {"tcp-listener": listener, "tcp-client": client, "tcp-server": sized(server, 50000, 70000)}
    socks["udp-set"] = sized(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 2 << 20, 100000)
    socks["udp-default"] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    before = "\n".join(line(n, s) for n, s in socks.items())
    with open(f"{d}/before", "w") as f:
        f.write(before + "\n")
    open(f"{d}/ready", "w").close()
    while not os.path.exists(f"{d}/go"):
        time.sleep(0.02)
    out = [line(n, s) for n, s in socks.items()]
    reader = socks["unix-stream-queued-b"]
    reader.setblocking(False)
    got = b""
    try:
        while len(got) < len(QUEUED):
            chunk = reader.recv(65536)
            if not chunk:
                break
            got += chunk
    except BlockingIOError:
        pass
    out.append(f"queued {len(got)} bytes sha256={hashlib.sha256(got).hexdigest()[:16]}")
    with open(f"{d}/report.tmp", "w") as f:
        f.write("\n".join(out) + "\n")
    os.rename(f"{d}/report.tmp", f"{d}/report")
    time.sleep(3600)


if __name__ == "__main__":
    main()
