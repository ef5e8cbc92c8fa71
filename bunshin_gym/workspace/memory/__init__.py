"""Memory modes of a clone: how a restored workspace gets its memory from a snapshot.

Every mode but ``map-anon`` keeps exact Linux memory semantics for the programs in the
clone (memory dropped with ``MADV_DONTNEED`` reads back as zeros); tests check it.

============  ===============================================================================
``copy``      stock CRIU restore: every page is copied into the clone.
``ksm``       copy, then kernel same-page merging: the restored tree is KSM-mergeable
              (``PR_SET_MEMORY_MERGE``) and ksmd is tuned up while such clones run.
``share``     (default) the changed pages of private *file* mappings (relocated library
              data) are mapped copy-on-write from the snapshot's page image (exact: a file
              mapping's dropped page comes back from the same file, as it would from the
              library); anonymous memory is shared by the best exact mechanism available,
              :data:`SHARE_ANON_MECHANISM`: ``"uffd"`` (copy-on-write from the image on tmpfs
              with a userfaultfd monitor, :mod:`bunshin_gym.workspace.uffd`) where the kernel
              and CRIU support it, else ``"ksm"``. With ``BUNSHIN_SHARE_KSM=1`` the pages
              uffd clones write are KSM-mergeable too (clones doing the same work write
              many identical pages; ksmd's CPU is the price, reported by the benchmark).
``kmod``      anonymous memory shared copy-on-write from a frozen holder copy of the snapshot
              by the ``bunshin_share`` kernel module (:mod:`bunshin_gym.workspace.kmod`);
              needs the module loaded (``SetupError`` otherwise).
``map-anon``  anonymous memory too is mapped from the page image. UNSAFE, opt-in: after
              ``MADV_DONTNEED`` such memory reads back the image's page instead of zeros
              (chromium's and jemalloc's allocators crash on that).
============  ===============================================================================
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from enum import StrEnum
from pathlib import Path

from bunshin_gym.config import paths, share_ksm


class MemoryMode(StrEnum):
    COPY = "copy"
    KSM = "ksm"
    SHARE = "share"
    KMOD = "kmod"
    MAP_ANON = "map-anon"

    @classmethod
    def parse(cls, value: str | MemoryMode) -> MemoryMode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown memory mode {value!r}; choose one of "
                             f"{', '.join(m.value for m in cls)}") from None


DEFAULT_MODE = MemoryMode.SHARE


def share_anon_mechanism() -> str:
    """What serves anonymous memory in "share" mode: "uffd", or "ksm" where the kernel lacks
    userfaultfd minor faults on shmem or CRIU lacks the patch (``BUNSHIN_SHARE_ANON=ksm`` forces it)."""
    from bunshin_gym.workspace import uffd

    return "uffd" if uffd.available() else "ksm"


def __getattr__(name: str):
    if name == "SHARE_ANON_MECHANISM":  # reported by the fork benchmark; probed on first use
        return share_anon_mechanism()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uses_uffd(mode: MemoryMode) -> bool:
    return mode is MemoryMode.SHARE and share_anon_mechanism() == "uffd"


def uses_ksm(mode: MemoryMode) -> bool:
    """Whether clones of this mode are made KSM-mergeable (and ksmd is tuned up while they run)."""
    return mode is MemoryMode.KSM or (mode is MemoryMode.SHARE and (
        share_anon_mechanism() == "ksm" or share_ksm()))


#: set to 1: share mode's uffd clones are KSM-mergeable too (the pages they write merge;
#: read by config.share_ksm)
SHARE_KSM_ENV = "BUNSHIN_SHARE_KSM"


def maps_images(mode: MemoryMode) -> bool:
    """Whether clones of this mode map the snapshot's page files (so it must outlive them)."""
    return mode in (MemoryMode.SHARE, MemoryMode.MAP_ANON)


def restore_env(mode: MemoryMode, images_in_workspace: str) -> dict[str, str]:
    """Environment for ``criu restore`` (read by criu/patches/0001-restore-share-pages.patch)."""
    if mode in (MemoryMode.COPY, MemoryMode.KSM, MemoryMode.KMOD):
        return {}
    env = {"CRIU_MMAP_PAGES": "1", "CRIU_MMAP_PAGES_DIR": images_in_workspace}
    if mode is MemoryMode.MAP_ANON:
        env["CRIU_MMAP_ANON"] = "1"
    return env


# ksmd tuning ---------------------------------------------------------------------------
KSM = Path("/sys/kernel/mm/ksm")
KSM_TUNED = {"run": "1", "pages_to_scan": "4000", "sleep_millisecs": "10"}


@contextlib.contextmanager
def _ksm_state():
    run = paths().run
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "ksm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        f = run / "ksm.json"
        before = f.read_text() if f.exists() else ""
        state = json.loads(before) if before else {"saved": None, "users": []}
        yield state
        if json.dumps(state) != before:  # every reclaim releases; most were never users
            f.write_text(json.dumps(state))


def ksm_acquire(user: str) -> None:
    """Tune ksmd up while at least one KSM clone runs (values saved for :func:`ksm_release`)."""
    if not KSM.exists():
        return
    with _ksm_state() as st:
        if not st["users"]:
            st["saved"] = {k: (KSM / k).read_text().strip() for k in KSM_TUNED}
            for k, v in KSM_TUNED.items():
                (KSM / k).write_text(v)
        if user not in st["users"]:
            st["users"].append(user)


def ksm_release(user: str, live: set[str] | None = None) -> None:
    """Drop a user (and, given ``live``, every user not in it); the last one restores ksmd."""
    if not KSM.exists():
        return
    with _ksm_state() as st:
        st["users"] = [u for u in st["users"] if u != user and (live is None or u in live)]
        if not st["users"] and st["saved"]:
            for k in ("sleep_millisecs", "pages_to_scan", "run"):
                (KSM / k).write_text(st["saved"][k])
            st["saved"] = None


def ksmd_cpu_seconds() -> float:
    """CPU time ksmd has used since boot."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat.split(" ", 2)[1] == "(ksmd)":
                fields = stat.rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0
