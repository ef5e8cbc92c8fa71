"""Client of heap.py, run INSIDE a workspace: ``python3 heapctl.py PORT COMMAND...`` prints the answer."""

import socket
import sys

with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60) as s:
    s.sendall(" ".join(sys.argv[2:]).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
print(data.decode().strip())
