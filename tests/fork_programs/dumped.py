"""Dumps of one frozen state, and what they recorded, read from their images: the tests that
compare two ways of dumping (a background dump against a stop-the-world one, a dump with a
helper or a scan left out against one without) make and read them the same way."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from bunshin_gym import config
from bunshin_gym.config import criu_env
from bunshin_gym.workspace import Workspace, forking, memory
from bunshin_gym.workspace.snapshots import delta
from bunshin_gym.workspace.snapshots.criu_images import load_image


def dump_frozen(ws: Workspace, ways: dict[Path, dict[str, str | None]], *, verbosity: int) -> None:
    """Freeze ``ws`` once and dump it stop-the-world into each images directory in turn (made
    here), with that way's CRIU variables set (None: unset) and CRIU logging at ``verbosity``;
    CRIU leaves the workspace frozen as it found it, so every dump is of the same state. Thaw."""
    p = config.paths()
    cg = ws.cgroup
    freezer = cg.freezer_dir()
    env = dict(os.environ, **criu_env(p), **memory.registry.dump_env(p), CRIU_BG_DUMP="0")
    ws._quiesce_agent()  # the controller's connections into the workspace (CRIU cannot dump them)
    cg.freeze()
    try:
        for images, settings in ways.items():
            images.mkdir()
            cmd = [*forking.dump_command(ws._rec, p, images, freezer, "skip")]
            cmd[cmd.index(f"-v{forking.dump_verbosity()}")] = f"-v{verbosity}"
            run_env = {k: v for k, v in env.items() if k not in settings}
            run_env.update({k: v for k, v in settings.items() if v is not None})
            done = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
            assert done.returncode == 0, (images / "dump.log").read_text()[-3000:]
            assert cg.is_frozen(), "the dump should leave the workspace frozen"
    finally:
        cg.thaw()


def taken_from_smaps_helper(log: str) -> tuple[int, int, int]:
    """What CRIU took from its smaps helper (criu/patches/0033), from a dump's log at level 3 or
    more: smaps texts, map_files modes and descriptors."""
    took = re.search(r"smaps-ahead: took (\d+) smaps \(waited [\d.]+ ms\), (\d+) map_files modes and (\d+) "
                     r"descriptors from the helper", log)
    assert took, log[-3000:]
    return int(took.group(1)), int(took.group(2)), int(took.group(3))


def ip_save_messages(stream: bytes) -> list[bytes]:
    """An ``ip ... save`` stream's netlink messages (after iproute2's 4-byte magic) without their
    headers' flags, sequence and port numbers: the dump's, not the namespace's state."""
    out, off = [stream[:4]], 4
    while off < len(stream):
        length = int.from_bytes(stream[off:off + 4], "little")
        assert length >= 16, f"a message of {length} bytes at {off}"
        out.append(stream[off:off + 6] + stream[off + 16:off + length])  # length, type; body
        off += length
    return out


def mappings(images: Path) -> dict[str, list]:
    """{mm image: its VMAs as CRIU recorded them} of every process of a dump."""
    return {mm.name: load_image(mm)["entries"][0]["vmas"] for mm in sorted(images.glob("mm-*.img"))}


def pages(images: Path) -> dict[str, dict[int, bytes]]:
    """{pagemap file: {address: page}} of every process's dumped pages (in-parent ones named)."""
    out: dict[str, dict[int, bytes]] = {}
    for pm in sorted(images.glob("pagemap-*.img")):
        if not pm.stem.split("-", 1)[1].isdigit():
            continue
        _, pages_id, ents = delta.read_pagemap(pm)
        pages: dict[int, bytes] = {}
        with open(images / f"pages-{pages_id}.img", "rb") as f:
            for vaddr, n, flags in ents:
                for i in range(n):
                    addr = vaddr + i * 4096
                    pages[addr] = f.read(4096) if flags & delta.PE_PRESENT else b"in-parent"
        out[pm.name] = pages
    return out


def mask_rseq(images: Path, pages: dict[str, dict[int, bytes]]) -> None:
    """Blank each thread's rseq area (from its core image) in its process's pages: the kernel
    rewrites it (the CPU the thread runs on) whenever the thread returns to user space on
    another CPU, which CRIU's parasite does in each dump. The writer runs without rseq."""
    for proc in load_image(images / "pstree.img")["entries"]:
        mine = pages.get(f"pagemap-{proc['pid']}.img", {})
        if not mine:
            # no memory: a zombie (one of the writer's children, exited and not yet reaped at the
            # freeze), whose pstree entry's thread id CRIU leaves unset (CI read 2679928720)
            continue
        for tid in proc.get("threads") or [proc["pid"]]:
            rseq = load_image(images / f"core-{tid}.img")["entries"][0]["thread_core"].get("rseq_entry")
            if not rseq or not rseq.get("rseq_abi_pointer"):
                continue
            start, end = rseq["rseq_abi_pointer"], rseq["rseq_abi_pointer"] + rseq["rseq_abi_size"]
            for a in range(start & ~4095, end, 4096):
                if a in mine and mine[a] != b"in-parent":
                    lo, hi = max(start, a) - a, min(end, a + 4096) - a
                    mine[a] = mine[a][:lo] + bytes(hi - lo) + mine[a][hi:]
