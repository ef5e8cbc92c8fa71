"""Memory modes of a clone: how a restored workspace gets its memory from a snapshot, one
backend per mode (:mod:`.base` is the interface, :mod:`.registry` the table of modes).

Every mode but ``map-anon`` keeps exact Linux memory semantics for the programs in the
clone (memory dropped with ``MADV_DONTNEED`` reads back as zeros); tests check it.

============  ===============================================================================
``copy``      stock CRIU restore: every page is copied into the clone (:mod:`.copy`).
``ksm``       copy, then kernel same-page merging: the restored tree is KSM-mergeable
              (``PR_SET_MEMORY_MERGE``) and ksmd is tuned up while such clones run (:mod:`.ksm`).
``share``     (default) the changed pages of private *file* mappings (relocated library
              data) are mapped copy-on-write from the snapshot's page image (exact: a file
              mapping's dropped page comes back from the same file, as it would from the
              library); anonymous memory is shared by the best exact mechanism available,
              :data:`SHARE_ANON_MECHANISM`: ``"uffd"`` (copy-on-write from the image on tmpfs
              with a userfaultfd monitor, :mod:`bunshin_gym.workspace.uffd`) where the kernel
              and CRIU support it, else ``"ksm"``. With ``BUNSHIN_SHARE_KSM=1`` the pages
              uffd clones write are KSM-mergeable too (clones doing the same work write
              many identical pages; ksmd's CPU is the price, reported by the benchmark).
              (:mod:`.share`)
``kmod``      anonymous memory shared copy-on-write from a frozen holder copy of the snapshot
              by the ``bunshin_share`` kernel module (:mod:`bunshin_gym.workspace.kmod`);
              needs the module loaded (``SetupError`` otherwise). (:mod:`.kmod`)
``map-anon``  anonymous memory too is mapped from the page image. UNSAFE, opt-in: after
              ``MADV_DONTNEED`` such memory reads back the image's page instead of zeros
              (chromium's and jemalloc's allocators crash on that). (:mod:`.map_anon`)
============  ===============================================================================
"""

from __future__ import annotations

from bunshin_gym.workspace.memory.base import MemoryBackend, RestorePlan
from bunshin_gym.workspace.memory.ksmd import KSM, KSM_TUNED, ksm_acquire, ksm_release, ksmd_cpu_seconds
from bunshin_gym.workspace.memory.registry import (
    DEFAULT_MODE,
    MemoryMode,
    all_backends,
    backend,
    for_record,
)
from bunshin_gym.workspace.memory.share import share_anon_mechanism

#: set to 1: share mode's uffd clones are KSM-mergeable too (the pages they write merge;
#: read by config.share_ksm)
SHARE_KSM_ENV = "BUNSHIN_SHARE_KSM"

__all__ = [
    "DEFAULT_MODE", "KSM", "KSM_TUNED", "SHARE_KSM_ENV", "MemoryBackend", "MemoryMode", "RestorePlan",
    "all_backends", "backend", "for_record", "ksm_acquire", "ksm_release", "ksmd_cpu_seconds",
    "maps_images", "share_anon_mechanism", "uses_ksm", "uses_uffd",
]


def __getattr__(name: str) -> str:
    if name == "SHARE_ANON_MECHANISM":  # reported by the fork benchmark; probed on first use
        return share_anon_mechanism()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uses_uffd(mode: str | MemoryMode) -> bool:
    """Whether clones of this mode have their anonymous memory served by a uffd monitor."""
    return backend(mode).uses_uffd()


def uses_ksm(mode: str | MemoryMode) -> bool:
    """Whether clones of this mode are made KSM-mergeable (and ksmd is tuned up while they run)."""
    return backend(mode).uses_ksm()


def maps_images(mode: str | MemoryMode) -> bool:
    """Whether clones of this mode map the snapshot's page files (so it must outlive them)."""
    return backend(mode).maps_images
