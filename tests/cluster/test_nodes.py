"""Simulated hosts on one machine: their own pool (a bind-mounted subvolume with the images),
run directory and cgroup root, made and removed without traces. No Ray, no workspace."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin_gym import config
from bunshin_gym.cluster import nodes
from bunshin_gym.workspace import pool


def test_a_simulated_host_has_its_own_paths_and_goes_without_traces(monkeypatch):
    lay = nodes.prepare("unit-n0")
    try:
        assert nodes.prepare("unit-n0") == lay  # idempotent
        for key, value in lay.env().items():
            monkeypatch.setenv(key, value)
        p = config.paths()
        assert p.pool == lay.pool and p.run == lay.run and pool.is_mounted(p.pool)
        machine = Path(config.get("BUNSHIN_HOME")) / "pool" / "images"
        assert sorted(x.name for x in p.images.iterdir()) == sorted(x.name for x in machine.iterdir())
        assert p.workspaces.is_dir() and p.snapshots.is_dir()
        # a subvolume of the machine's pool: snapshots between hosts are btrfs send/receive apart
        assert pool.is_subvolume(lay.subvolume) and lay.subvolume.parent.name == ".cluster"
        memory_root = lay.cgroup_root / "memory"
        assert (memory_root / "memory.usage_in_bytes").exists() or (lay.cgroup_root / "cgroup.controllers").exists()
    finally:
        monkeypatch.undo()
        nodes.remove("unit-n0")
    mounts = Path("/proc/self/mounts").read_text()
    assert str(lay.base) not in mounts
    assert not lay.base.exists() and not lay.run.exists() and not lay.subvolume.exists()
    assert not list(Path("/sys/fs/cgroup").glob("*/bunshin-cluster-unit-n0")) and not lay.cgroup_root.exists()


@pytest.mark.parametrize("bad", ["", "UPPER", "a/b", "..", "-x", "x" * 40])
def test_bad_host_names_are_refused(bad):
    with pytest.raises(ValueError, match="bad host name"):
        nodes.layout(bad)


def test_nothing_is_made_without_the_machine_pool(monkeypatch, tmp_path):
    monkeypatch.setenv("BUNSHIN_POOL", str(tmp_path / "no-pool"))
    with pytest.raises(Exception, match="not mounted"):
        nodes.prepare("unit-n1")
    assert not (tmp_path / "no-pool").exists()
    assert subprocess.run(["mountpoint", "-q", str(nodes.layout("unit-n1").pool)]).returncode != 0
