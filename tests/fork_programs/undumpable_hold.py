"""Holds a descriptor CRIU cannot dump (an AF_VSOCK socket), run INSIDE a workspace.

    python3 undumpable_hold.py READY_FILE

Writes "<pid> <fd>" to READY_FILE (or "error <errno>" if the kernel refuses) and sleeps.
(It held a perf_event_open counter once; the workspace's seccomp filter now refuses
perf_event_open, as container runtimes do, while a vsock socket needs no privilege.)
"""

import os
import socket
import sys
import time

ready = sys.argv[1]
try:
    sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    line = f"{os.getpid()} {sock.fileno()}\n"
except OSError as e:
    line = f"error {e.errno}\n"
with open(ready + ".tmp", "w") as f:
    f.write(line)
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
