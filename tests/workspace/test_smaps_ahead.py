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
import re
import subprocess

from fork_programs import host

from bunshin_gym import config
from bunshin_gym.config import criu_env
from bunshin_gym.workspace import Workspace, forking, memory
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
    out = {}
    for mm in sorted(images.glob("mm-*.img")):
        out[mm.name] = load_image(mm)["entries"][0]["vmas"]
    out["files.img"] = sorted(load_image(images / "files.img")["entries"], key=lambda e: e["id"])
    return out


def test_the_helper_gives_the_mappings_criu_reads_itself(tmp_path):
    p = config.paths()
    ws = Workspace.create("base")
    try:
        for _ in range(2):
            ws.spawn(["python3", "-c", MAPPER])
        host.wait_file(ws, "/tmp/mapped.ready")
        cg = ws.cgroup
        freezer = cg.freezer_dir()
        env = dict(os.environ, **criu_env(p), **memory.registry.dump_env(p), CRIU_BG_DUMP="0")
        ref, ahead, default = tmp_path / "read-by-criu", tmp_path / "read-ahead", tmp_path / "default"
        for d in (ref, ahead, default):
            d.mkdir()
        ws._quiesce_agent()  # the controller's connections into the workspace (CRIU cannot dump them)
        cg.freeze()
        try:
            # 0: never, 1: always; unset: for 8 tasks or more (this workspace has 4)
            for images, helper in ((ref, "0"), (ahead, "1"), (default, None)):
                cmd = [*forking.dump_command(ws._rec, p, images, freezer, "skip")]
                cmd[cmd.index(f"-v{forking.dump_verbosity()}")] = "-v3"
                run_env = {k: v for k, v in env.items() if k != "CRIU_SMAPS_AHEAD"}
                if helper is not None:
                    run_env["CRIU_SMAPS_AHEAD"] = helper
                done = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
                assert done.returncode == 0, (images / "dump.log").read_text()[-3000:]
                assert cg.is_frozen(), "the dump should leave the workspace frozen"
        finally:
            cg.thaw()
        log = (ahead / "dump.log").read_text()
        took = re.search(r"smaps-ahead: took (\d+) smaps \(waited [\d.]+ ms\), (\d+) map_files modes and (\d+) "
                         r"descriptors from the helper", log)
        assert took, log[-3000:]
        tasks = len(list(ahead.glob("core-*.img")))  # threads too: at least one per process
        assert 0 < int(took.group(1)) <= tasks and int(took.group(2)) > 100 and int(took.group(3)) > 10, took.group(0)
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
