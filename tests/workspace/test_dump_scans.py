"""What a dump no longer does in CRIU's thread while the workspace is frozen, checked against a
dump of the same frozen state that still does it.

- criu/patches/0039: a private mapping whose smaps lines count no anonymous and no swapped page
  is not scanned for pages (the scan would find none: it leaves out file pages and the zero
  page), and guard regions are looked for only in the mappings smaps marks for them ("gu"),
  not in the page tables of the whole address space. ``CRIU_SMAPS_SKIP=0`` and
  ``CRIU_GUARD_SCAN_ALL=1`` scan as before.
- criu/patches/0040: the contents of deleted files the tasks hold (ghost files) are copied by a
  helper beside the dump, not by CRIU one after the other; the dump waits for the last copy
  before it ends. ``CRIU_GHOST_COPY_LATE=0`` copies at once, as before.
- criu/patches/0044: CRIU reads each VMA's smaps header without sscanf; the mappings it records
  are the ones /proc/PID/maps shows.
- criu/patches/0042: in a share clone, whose anonymous memory is mapped from page images on the
  images' tmpfs, such a mapping is known by its smaps line (the device is that tmpfs's), without
  the mode, descriptor and stat of its map_files link; the smaps helper (0033) skips them too.
  ``CRIU_UFFD_BY_SMAPS=0`` looks them up, as before.

The workspace is frozen, dumped the old way (CRIU leaves it frozen, as it found it), then the
new way: both must record the same pages, mappings (guard regions included) and deleted files.
"""

from __future__ import annotations

import re

from fork_programs import dumped, host
from fork_programs.host import heap

from bunshin_gym.workspace import Workspace
from bunshin_gym.workspace.snapshots.criu_images import load_image

#: the switches that make a dump scan and copy as before 0039 and 0040
OLD_WAY = {"CRIU_SMAPS_SKIP": "0", "CRIU_GUARD_SCAN_ALL": "1", "CRIU_GHOST_COPY_LATE": "0"}
#: CRIU's mark of a guard region in an mm image's VMA list (criu/include/image.h)
VMA_AREA_GUARD = 1 << 16
#: where the two programs keep their files: a tmpfs (no extent map) and the overlay root
DIRS = ("/tmp/scan1", "/root/scan2")
#: heap.py's port in test_a_page_image_mapping_is_known_by_its_smaps_line
HEAP_PORT = 7311
#: CRIU's VmaEntry flag of a mapping without a file (mmap's MAP_ANONYMOUS)
MAP_ANONYMOUS = 0x20
#: CRIU's status bits of a mapping of a file (criu/include/image.h), and mmap's MAP_SHARED
VMA_FILE_PRIVATE, VMA_FILE_SHARED, MAP_SHARED = 1 << 6, 1 << 7, 0x1


def _ghost(image) -> tuple[dict, bytes]:
    """A ghost file image's entry (less its access time) and the contents after it."""
    raw = image.read_bytes()
    entry = load_image(image)["entries"][0]
    entry.pop("atim", None)
    return entry, raw[8 + 4 + int.from_bytes(raw[8:12], "little"):]  # two magics, the entry's size, the entry


def _deleted_files(ws: Workspace, vpid: int) -> dict[str, str]:
    """{descriptor: sha256} of the deleted files a process of the workspace holds open."""
    out = ws.exec(f"for f in /proc/{vpid}/fd/*; do case $(readlink $f) in *'(deleted)') "
                  f"echo ${{f##*/}} $(sha256sum < $f | cut -c1-64);; esac; done").text.split()
    return dict(zip(out[::2], out[1::2], strict=True))


def test_a_dump_without_those_scans_and_with_its_copies_beside_it_records_the_same_state(tmp_path):
    ws = Workspace.create("base")
    try:
        host.install(ws, "scanmaps")
        ready, vpids = {}, {}
        for d in DIRS:
            ws.exec(["mkdir", "-p", d])
            vpids[d] = ws.spawn([f"{host.DIR}/scanmaps", d], log=f"{d}.log")
            ready[d] = {k: int(v, 16) for k, v in
                        (kv.split("=") for kv in host.wait_file(ws, f"{d}/ready", contains="\n").split())}
        old, new = tmp_path / "old-way", tmp_path / "new-way"
        dumped.dump_frozen(ws, {old: OLD_WAY, new: dict.fromkeys(OLD_WAY)}, verbosity=4)
        old_log, new_log = (old / "dump.log").read_text(), (new / "dump.log").read_text()

        # the new way ran: mappings left out, the deleted files copied by the helper
        assert "not scanned" not in old_log and "ghost-copy:" not in old_log
        for d in DIRS:
            ro, rw = ready[d]["ro"], ready[d]["rw"]
            assert f"{ro:x}-{ro + (1 << 20):x}: smaps counts no private page, not scanned" in new_log, d
            assert f"{rw:x}-{rw + (1 << 20):x}: smaps counts no private page" not in new_log, d
        copied = re.search(r"ghost-copy: (\d+) deleted file\(s\), (\d+) bytes copied beside the dump", new_log)
        assert copied and int(copied.group(1)) >= 4 and int(copied.group(2)) >= 2 * (3 << 20) + 2 * 4096, \
            copied and copied.group(0)

        # and recorded what the old way recorded: every page, every mapping, every deleted file
        want, got = dumped.pages(old), dumped.pages(new)
        dumped.mask_rseq(old, want)
        dumped.mask_rseq(old, got)  # the same frozen state: the same threads and rseq areas
        assert set(want) == set(got)
        diffs = [f"{name} {a:#x}" for name in want for a in sorted(set(want[name]) | set(got[name]))
                 if want[name].get(a) != got[name].get(a)]
        assert not diffs, f"{len(diffs)} pages differ from the old way's dump, first: {diffs[:10]}"
        for d in DIRS:  # the three pages each program wrote in its private file mapping are its own
            rw = ready[d]["rw"]
            assert any({rw, rw + (7 << 12), rw + (200 << 12)} <= set(pages) for pages in got.values()), d
        assert dumped.mappings(old) == dumped.mappings(new)
        ghosts = sorted(g.name for g in old.glob("ghost-file-*.img"))
        assert len(ghosts) >= 4 and ghosts == sorted(g.name for g in new.glob("ghost-file-*.img"))
        for g in ghosts:  # the old way's copy read each file, so the new way recorded a later access time
            assert _ghost(old / g) == _ghost(new / g), f"{g} differs"
        for d in DIRS:
            guard = ready[d]["guard"]
            if not guard:  # a kernel without MADV_GUARD_INSTALL
                continue
            regions = {(v["start"] - guard) >> 12 for vmas in dumped.mappings(new).values() for v in vmas
                       if v["status"] & VMA_AREA_GUARD and guard <= v["start"] < guard + (16 << 12)}
            assert regions == {5, 9}, (d, regions)
        if "guard regions looked for in the" not in new_log:  # smaps without "gu": the old scan, same result
            assert "gu" not in ws.exec(f"grep VmFlags /proc/{vpids[DIRS[0]]}/smaps").text.split()

        # and a clone of a snapshot taken the new way holds the same deleted files
        held = {d: _deleted_files(ws, vpids[d]) for d in DIRS}
        assert all(len(h) == 2 for h in held.values()), held
        snap = ws.snapshot()
        try:
            (clone,) = snap.fork(1, mode="share")
            try:
                for d in DIRS:
                    assert _deleted_files(clone, vpids[d]) == held[d], d
            finally:
                clone.close()
        finally:
            snap.delete()
    finally:
        ws.close()


def _without_anon_fdflags(images) -> dict[str, list]:
    """Mappings, less the open mode of anonymous ones: the old way recorded the mode of a page
    image's map_files link there, which no restore of anonymous memory reads."""
    return {name: [{k: v for k, v in vma.items() if k != "fdflags" or not vma["flags"] & MAP_ANONYMOUS}
                   for vma in vmas] for name, vmas in dumped.mappings(images).items()}


def test_a_page_image_mapping_is_known_by_its_smaps_line(tmp_path):
    ws = Workspace.create("base")
    snaps, clones = [], []
    try:
        host.heap_start(ws, HEAP_PORT, 16, "by-line")
        snaps.append(ws.snapshot())
        clones += snaps[0].fork(1, mode="share")
        clone = clones[0]
        heap(clone, HEAP_PORT, "mutate", "one")  # pages of its own among the image's
        old, new = tmp_path / "looked-up", tmp_path / "by-line"
        ahead = {"CRIU_SMAPS_AHEAD": "1"}  # the helper too (this workspace has fewer tasks than it needs)
        dumped.dump_frozen(clone, {old: {"CRIU_UFFD_BY_SMAPS": "0", **ahead},
                                   new: {"CRIU_UFFD_BY_SMAPS": None, **ahead}}, verbosity=3)
        old_log, new_log = (old / "dump.log").read_text(), (new / "dump.log").read_text()

        # every page image mapping the old way found through its link, the new way by its line,
        # and the helper looked up and opened fewer links
        images = old_log.count("is anonymous memory")
        assert images >= 20 and "by its smaps line" not in old_log
        assert new_log.count("by its smaps line) is anonymous memory") == images == new_log.count("is anonymous memory")
        (_, old_modes, old_fds), (_, new_modes, new_fds) = map(dumped.taken_from_smaps_helper, (old_log, new_log))
        assert new_modes <= old_modes - images and new_fds < old_fds, (old_modes, old_fds, new_modes, new_fds)

        # the same pages and mappings
        want, got = dumped.pages(old), dumped.pages(new)
        dumped.mask_rseq(old, want)
        dumped.mask_rseq(old, got)
        assert want == got
        assert _without_anon_fdflags(old) == _without_anon_fdflags(new)

        # a delta of the clone taken the new way (its unchanged image pages recorded as in the
        # parent, found by the image each mapping names) restores the heap as the clone holds it
        snaps.append(clone.snapshot())
        assert b"in-parent" in {p for pages in dumped.pages(snaps[1].criu_dir).values() for p in pages.values()}
        clones += snaps[1].fork(1, mode="share")
        assert heap(clones[1], HEAP_PORT, "sha") == host.heap_expected(16, "by-line", "one")
    finally:
        host.close_then_delete(clones, ws, snaps)


def _maps(ws: Workspace, vpid: int) -> dict[tuple[int, int], tuple[str, int]]:
    """{(start, end): (permissions, offset)} of a process's /proc/PID/maps, read in the workspace."""
    out = {}
    for line in ws.exec(["cat", f"/proc/{vpid}/maps"]).text.splitlines():
        rng, perms, offset = line.split()[:3]
        start, end = (int(x, 16) for x in rng.split("-"))
        out[(start, end)] = (perms, int(offset, 16))
    return out


def test_every_mapping_of_a_file_is_recorded_as_maps_shows_it(tmp_path):
    """0044: the range, protections, sharing and file offset CRIU records for each mapping of a
    file are what /proc/PID/maps shows: scanmaps maps its data file privately at two offsets and
    a deleted file shared (a path ending in " (deleted)"), besides its libraries."""
    ws = Workspace.create("base")
    try:
        host.install(ws, "scanmaps")
        ws.exec(["mkdir", "-p", DIRS[0]])
        vpid = ws.spawn([f"{host.DIR}/scanmaps", DIRS[0]], log=f"{DIRS[0]}.log")
        host.wait_file(ws, f"{DIRS[0]}/ready", contains="\n")
        want = _maps(ws, vpid)
        images = tmp_path / "dump"
        dumped.dump_frozen(ws, {images: {}}, verbosity=2)
        files = [v for v in dumped.mappings(images)[f"mm-{vpid}.img"]
                 if v["status"] & (VMA_FILE_PRIVATE | VMA_FILE_SHARED)]
        assert len(files) >= 4 and any(v["pgoff"] for v in files)
        assert any(v["flags"] & MAP_SHARED for v in files), "the deleted file's shared mapping"
        for v in files:
            perms, offset = want[(v["start"], v["end"])]
            prot = ("r" in perms) | ("w" in perms) << 1 | ("x" in perms) << 2
            assert (v["prot"], bool(v["flags"] & MAP_SHARED), v["pgoff"]) == (prot, perms[3] == "s", offset), \
                (hex(v["start"]), perms, offset, v)
    finally:
        ws.close()
