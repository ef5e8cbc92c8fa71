"""A minimal redis client (RESP over TCP), run INSIDE a workspace.

    python3 redisctl.py PORT fill SEED N SIZE      set key:<i> to SIZE deterministic bytes, i < N
    python3 redisctl.py PORT verify SEED N SIZE    check every key; prints "ok N" or "bad ..."
    python3 redisctl.py PORT cmd ARG...            one command, prints the reply

Values are SHAKE-256 of "SEED:i", so a clone can check what its source wrote.
"""

import hashlib
import socket
import sys


class Redis:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.f = self.sock.makefile("rb")

    def send(self, *args) -> None:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))

    def reply(self):
        line = self.f.readline()
        if not line:
            raise ConnectionError("redis closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise ValueError(f"bad reply {line!r}")

    def cmd(self, *args):
        self.send(*args)
        return self.reply()


def value(seed: str, i: int, size: int) -> bytes:
    return hashlib.shake_256(f"{seed}:{i}".encode()).digest(size)


def main() -> None:
    r = Redis(int(sys.argv[1]))
    op = sys.argv[2]
    if op == "cmd":
        res = r.cmd(*sys.argv[3:])
        print(res.decode(errors="replace") if isinstance(res, bytes) else res)
        sys.exit(1 if isinstance(res, Exception) else 0)
    seed, n, size = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    batch = 64
    if op == "fill":
        for start in range(0, n, batch):
            idx = range(start, min(n, start + batch))
            for i in idx:
                r.send("SET", f"key:{i}", value(seed, i, size))
            for i in idx:
                res = r.reply()
                if res != "OK":
                    print(f"bad SET key:{i}: {res}")
                    sys.exit(1)
        print(f"ok {n}")
    elif op == "verify":
        bad = []
        for start in range(0, n, batch):
            idx = range(start, min(n, start + batch))
            for i in idx:
                r.send("GET", f"key:{i}")
            for i in idx:
                if r.reply() != value(seed, i, size):
                    bad.append(i)
        print(f"ok {n}" if not bad else f"bad {len(bad)} of {n}: keys {bad[:10]}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
