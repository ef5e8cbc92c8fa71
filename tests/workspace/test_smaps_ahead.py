"""CRIU's helper that reads each task's smaps, the modes of its map_files links and opens them,
ahead of CRIU (criu/patches/0033).

The reference is a dump of the same frozen state without the helper (``CRIU_SMAPS_AHEAD=0``):
the workspace is frozen, dumped without it (CRIU leaves it frozen, as it found it), then
dumped with it. Every task's memory mappings (ranges, protections, flags, status, open modes
of mapped files, which file each maps) and the file table must be the same. The processes map
one file several times, read-only and read-write, shared and private, next to each other and
apart: the open mode of each mapping comes from its own map_files link, never its neighbour's,
and the file each maps comes through the descriptor the helper opened for it.
"""

from __future__ import annotations

import os

from fork_programs import dumped, host

from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.snapshots.criu_images import load_image

#: maps /tmp/mapped.bin four times: read-only private, read-write shared, an anonymous gap,
#: read-write private and read-only shared, and says so in /tmp/mapped.ready
MAPPER = """
import mmap, os, time
with open("/tmp/mapped.bin", "wb") as f:
    f.write(os.urandom(1 << 20))
ro = os.open("/tmp/mapped.bin", os.O_RDONLY)
rw = os.open("/tmp/mapped.bin", os.O_RDWR)
maps = [mmap.mmap(ro, 1 << 20, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ),
        mmap.mmap(rw, 1 << 20, flags=mmap.MAP_SHARED),
        mmap.mmap(-1, 1 << 16),
        mmap.mmap(rw, 1 << 20, flags=mmap.MAP_PRIVATE),
        mmap.mmap(ro, 1 << 20, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)]
for m in maps:
    m[0]
open("/tmp/mapped.ready", "w").close()
while True:
    time.sleep(3600)
"""


def _mappings(images) -> dict:
    """{process: its VMAs as CRIU recorded them} and the file table, of a dump's images."""
    return {**dumped.mappings(images),
            "files.img": sorted(load_image(images / "files.img")["entries"], key=lambda e: e["id"])}


def test_the_helper_gives_the_mappings_criu_reads_itself(tmp_path):
    ws = Workspace.create("base")
    try:
        for _ in range(2):
            ws.spawn(["python3", "-c", MAPPER])
        host.wait_file(ws, "/tmp/mapped.ready")
        ref, ahead, default = tmp_path / "read-by-criu", tmp_path / "read-ahead", tmp_path / "default"
        # CRIU_SMAPS_AHEAD 0: never, 1: always; unset: for 8 tasks or more (this workspace has 4)
        dumped.dump_frozen(ws, {ref: {"CRIU_SMAPS_AHEAD": "0"}, ahead: {"CRIU_SMAPS_AHEAD": "1"},
                                default: {"CRIU_SMAPS_AHEAD": None}}, verbosity=3)
        log = (ahead / "dump.log").read_text()
        texts, modes, fds = dumped.taken_from_smaps_helper(log)
        tasks = len(list(ahead.glob("core-*.img")))  # threads too: at least one per process
        assert 0 < texts <= tasks and modes > 100 and fds > 10, (texts, modes, fds)
        assert "smaps-ahead: helper" not in (ref / "dump.log").read_text()
        assert "smaps-ahead: helper" not in (default / "dump.log").read_text()  # 4 tasks: not worth it
        want, got = _mappings(ref), _mappings(ahead)
        assert set(want) == set(got) and len(want) > 3
        for name in want:
            assert got[name] == want[name], f"{name} differs with the helper"
        # the mapped file's four mappings kept their own open modes
        modes = {(v["flags"] & 0x1, v.get("fdflags")) for name in want if name.startswith("mm-")
                 for v in want[name] if v.get("shmid") and v["end"] - v["start"] == 1 << 20}
        assert {(0x1, os.O_RDWR), (0x1, os.O_RDONLY)} <= modes, modes  # shared: read-write and read-only
    finally:
        ws.close()
