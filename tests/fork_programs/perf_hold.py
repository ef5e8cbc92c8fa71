"""Holds a perf_event_open file descriptor (which CRIU cannot dump), run INSIDE a workspace.

    python3 perf_hold.py READY_FILE

Opens a software CPU-clock counter on itself (perf_event_open, x86-64 syscall 298,
PERF_TYPE_SOFTWARE / PERF_COUNT_SW_CPU_CLOCK), writes "<pid> <fd>" to READY_FILE (or
"error <errno>" if the kernel refuses) and sleeps.
"""

import ctypes
import os
import sys
import time

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER8 is 136 but any published size >= VER0 (64) is accepted

libc = ctypes.CDLL(None, use_errno=True)
attr = (ctypes.c_uint8 * ATTR_SIZE)()
ctypes.c_uint32.from_buffer(attr, 0).value = PERF_TYPE_SOFTWARE
ctypes.c_uint32.from_buffer(attr, 4).value = ATTR_SIZE
ctypes.c_uint64.from_buffer(attr, 8).value = PERF_COUNT_SW_CPU_CLOCK
fd = libc.syscall(ctypes.c_long(298), ctypes.byref(attr), 0, -1, -1, ctypes.c_ulong(0))
ready = sys.argv[1]
with open(ready + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {fd}\n" if fd >= 0 else f"error {ctypes.get_errno()}\n")
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
