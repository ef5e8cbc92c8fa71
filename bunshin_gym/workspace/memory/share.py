"""The ``share`` memory mode (the default).

The changed pages of private *file* mappings (relocated library data) are mapped
copy-on-write from the snapshot's page image (exact: a file mapping's dropped page comes
back from the same file, as it would from the library; criu/patches/0001). Anonymous memory
is shared by the best exact mechanism available (:func:`share_anon_mechanism`): ``"uffd"``,
copy-on-write from a tmpfs copy of the images with a userfaultfd monitor per clone
(:mod:`bunshin_gym.workspace.uffd`), where the kernel and CRIU support it, else ``"ksm"``.
With ``BUNSHIN_SHARE_KSM=1`` uffd clones are KSM-mergeable too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bunshin_gym.config import Paths, share_ksm
from bunshin_gym.workspace import uffd
from bunshin_gym.workspace.memory.base import MemoryBackend, Reclaim, RestorePlan, SnapshotRef
from bunshin_gym.workspace.memory.ksmd import ksm_acquire, ksm_release
from bunshin_gym.workspace.records import Record


def share_anon_mechanism() -> str:
    """What serves anonymous memory in "share" mode: "uffd", or "ksm" where the kernel lacks
    userfaultfd minor faults on shmem or CRIU lacks the patch (``BUNSHIN_SHARE_ANON=ksm`` forces it)."""
    return "uffd" if uffd.available() else "ksm"


def mapped_pages_env(snap_id: str) -> dict[str, str]:
    """``criu restore`` environment that maps changed pages of private file mappings from the
    snapshot's page images (criu/patches/0001-restore-share-pages.patch), at the path the
    images have inside the clone."""
    return {"CRIU_MMAP_PAGES": "1", "CRIU_MMAP_PAGES_DIR": f"/.snap/{snap_id}/criu"}


class ShareBackend(MemoryBackend):
    name = "share"
    maps_images = True

    def uses_uffd(self) -> bool:
        return share_anon_mechanism() == "uffd"

    def uses_ksm(self) -> bool:
        return share_anon_mechanism() == "ksm" or share_ksm()

    def prepare(self, snap: SnapshotRef, p: Paths) -> None:
        if self.uses_uffd():  # copied once, before the clones look for it
            uffd.prepare_images(snap.id, snap.criu_dir, p)

    def restore(self, snap: SnapshotRef, rec: Record, p: Paths, helper: Record | None) -> RestorePlan:
        env = mapped_pages_env(snap.id)
        images: Path = snap.criu_dir
        if self.uses_uffd():  # anonymous memory from a tmpfs copy of the images, served by a monitor
            uffd.start(rec, p)  # first: the record then marks the images as in use
            images = uffd.prepare_images(snap.id, snap.criu_dir, p)
            env.update(uffd.restore_env(rec))
        ksm = self.uses_ksm()
        if ksm:
            ksm_acquire(rec.id)
        return RestorePlan(images=images, env=env, ksm=ksm)

    def adopted(self, rec: Record) -> None:
        if self.uses_ksm():
            ksm_acquire(rec.id)  # the restore registered the temporary id, released with the replaced record

    def health(self, rec: Record, p: Paths) -> str | None:
        return uffd.check(rec, p) if rec.uffd is not None else None

    def dump_env(self, p: Paths) -> dict[str, str]:
        return uffd.dump_env(p)

    def can_dump_delta(self, rec: Record, parent_id: str, p: Paths) -> bool:
        return rec.uffd is not None and uffd.has_image_copy(parent_id, p)

    def on_stop(self, rec: Record, p: Paths) -> None:
        uffd.stop(rec, p)  # only once nothing it served runs

    def on_reclaim(self, rec: Record, p: Paths, reclaim: Reclaim) -> None:
        if rec.snapshot:  # a no-op unless it was a KSM user (which BUNSHIN_SHARE_KSM at restore decided)
            ksm_release(rec.id)

    def release_unused(self, p: Paths, snap_id: str | None) -> None:
        uffd.release_images(p, snap_id)

    def on_snapshot_removed(self, snap_id: str, p: Paths, reclaim: Reclaim) -> None:
        uffd.release_images(p, snap_id, force=True)

    def on_images_rewritten(self, snap_id: str, criu_dir: Path, names: list[str], p: Paths) -> None:
        # the tmpfs copy that share restores read (uffd.prepare_images) gets the new files too;
        # clones running from it map its pages, never these (files.img)
        if not uffd.has_image_copy(snap_id, p):
            return
        with uffd._images_lock(p) as root:
            d = root / snap_id
            if (d / ".complete").exists():
                for name in names:
                    tmp = d / f"{name}.flatten-tmp"
                    shutil.copyfile(criu_dir / name, tmp)
                    os.replace(tmp, d / name)

    def sweep(self, p: Paths) -> list[str]:
        return uffd.sweep(p)
