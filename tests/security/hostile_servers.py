"""Hostile stand-ins for the servers inside a workspace, as a policy with root could run them.

Copied into a workspace of the ``base`` image and started there with its own python3
(standard library plus bunshin's ``/.bunshin/protocol.py``): ``python3 hostile_servers.py KIND``.

- ``x PATH``: an X server at PATH whose connection set-up is correct (a 64x48 screen) and
  whose GetImage replies are correct too, until the file ``/tmp/x-huge`` exists: then the
  next reply announces the length written in that file (in 4-byte units) and sends nothing.
  With ``/tmp/x-huge-damage`` present when a client connects, it also offers DAMAGE and
  XFIXES, and the attack comes in the damage region's reply.
- ``silent-desktop``: the desktop input server's socket; answers ``ping``, never answers an action.
- ``silent-web``: the browser driver's socket; answers ``ping``, ``setup`` and ``observe``
  (an empty page), never answers an action.

The X server (and ``x`` alone) is also importable on the host: :func:`serve_x`.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

WIDTH, HEIGHT = 64, 48
HUGE_FLAG = "/tmp/x-huge"


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


DAMAGE_OP, XFIXES_OP = 142, 138  # the major opcodes this server gives the two extensions


def _x_reply(seq: int, length: int = 0, body: bytes = b"") -> bytes:
    head = bytearray(32)
    head[0] = 1
    struct.pack_into("<HI", head, 2, seq, length)
    head[8:8 + len(body)] = body
    return bytes(head)


def _x_connection(conn: socket.socket, flag: str) -> None:
    """One client: correct answers (GetImage, and with ``damage`` DAMAGE/XFIXES as a server
    on which nothing is ever drawn) until ``flag`` exists; then the next reply (an image or a
    damage region) announces the length in ``flag`` and nothing follows."""
    damage = os.path.exists(flag + "-damage")
    with conn:
        try:
            _recv_exact(conn, 12)  # byte order, protocol version, no authorisation
            data = bytearray(72)  # vendor "" (0), 1 screen, 0 pixmap formats, then the screen
            struct.pack_into("<II", data, 4, 0x200000, 0x1FFFFF)  # resource-id base and mask
            data[20], data[21] = 1, 0
            struct.pack_into("<I", data, 32, 0x123)  # root window
            struct.pack_into("<HH", data, 52, WIDTH, HEIGHT)
            data[70] = 24  # root depth
            conn.sendall(struct.pack("<BBHHH", 1, 0, 11, 0, len(data) // 4) + bytes(data))
            seq = 0
            while True:
                opcode, minor, units = struct.unpack("<BBH", _recv_exact(conn, 4))
                body = _recv_exact(conn, units * 4 - 4)
                seq += 1
                huge = int(open(flag).read()) if os.path.exists(flag) else None
                if opcode == 98:  # QueryExtension: DAMAGE and XFIXES only with damage
                    name = body[4:4 + struct.unpack_from("<H", body)[0]]
                    ops = {b"DAMAGE": DAMAGE_OP, b"XFIXES": XFIXES_OP} if damage else {}
                    conn.sendall(_x_reply(seq, 0, bytes([name in ops, ops.get(name, 0), 0, 0])))
                elif opcode in (DAMAGE_OP, XFIXES_OP) and minor == 0:  # QueryVersion
                    conn.sendall(_x_reply(seq, 0, struct.pack("<II", 1, 1)))
                elif opcode == XFIXES_OP and minor == 19:  # FetchRegion: empty, or the attack
                    conn.sendall(_x_reply(seq, huge or 0))
                    if huge:
                        time.sleep(3600)
                elif opcode == 73:  # GetImage
                    if huge:
                        conn.sendall(_x_reply(seq, huge))
                        time.sleep(3600)  # and never send the announced bytes
                    w, h = struct.unpack_from("<HH", body, 8)
                    conn.sendall(_x_reply(seq, w * h) + bytes(w * h * 4))
                # anything else (grabs, DamageCreate/Subtract, CreateRegion) has no reply
        except (EOFError, OSError):
            return


def serve_x(path: str, flag: str = HUGE_FLAG, ready: threading.Event | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(8)
    if ready is not None:
        ready.set()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_x_connection, args=(conn, flag), daemon=True).start()


def _silent(answers: dict) -> object:
    def handle(req: dict, _blobs: list) -> tuple[dict, list]:
        op = req.get("op")
        if op in answers:
            return answers[op], []
        time.sleep(3600)  # an action: never answered
        return {}, []
    return handle


def main() -> None:
    kind = sys.argv[1]
    if kind == "x":
        serve_x(sys.argv[2])
        return
    sys.path.insert(0, "/.bunshin")
    try:
        from protocol import serve_unix
    except ImportError:  # a runtime layer from before protocol.py (to show the tests fail there)
        from agent import serve_unix

    if kind == "silent-desktop":
        serve_unix("/tmp/.bunshin/desktop.sock", _silent({"ping": {"pid": os.getpid()}}), mode=0o666)
    elif kind == "silent-web":
        page = {"url": "about:blank", "aria": "", "tabs": [{"title": "", "url": "about:blank"}], "active": 0}
        serve_unix("/run/bunshin/web.sock", _silent({"ping": {"pid": os.getpid(), "pages": 1}, "setup": {},
                                                       "observe": page}))
    else:
        raise SystemExit(f"unknown server kind {kind!r}")


if __name__ == "__main__":
    main()
