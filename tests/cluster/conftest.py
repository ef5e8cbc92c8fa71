"""A small Ray instance on this machine for the cluster tests (one per module; shut down after)."""

from __future__ import annotations

import subprocess

import pytest

from bunshin_gym.cluster import nodes


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from bunshin_gym.cluster import start_local_ray

    start_local_ray(num_cpus=1, object_store_mb=100)
    session = ray.get_runtime_context().get_node_id()
    try:
        yield session
    finally:
        ray.shutdown()
        # ray.shutdown() stops the processes this driver started; a raylet of ours left over
        # would hold its session directory: none may be
        left = subprocess.run(["pgrep", "-f", f"raylet.*{session}"], capture_output=True, text=True).stdout.split()
        assert not left, f"raylets left after ray.shutdown(): {left}"


def leftovers(name: str) -> dict[str, list[str]]:
    """What a simulated host still holds: workspace records, subvolumes, snapshots, cgroups."""
    lay = nodes.layout(name)

    def ls(path):
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    cgroups = [p for p in ls(lay.cgroup_root / "memory" / "bunshin") if p.startswith("ws-")]
    return {"records": ls(lay.run / "workspaces"), "workspaces": ls(lay.pool / "workspaces"),
            "snapshots": ls(lay.pool / "snapshots"), "cgroups": cgroups}
