"""`bunshin gc` never sweeps against a run directory other than its process's: with
``BUNSHIN_RUN`` changed in-process, the machine's cgroups and subvolumes that this run
directory's records do not name are someone else's live workspaces, not leftovers.

(Written as the accident it prevents: a test that reclaimed a simulated Ray host in-process,
its ``BUNSHIN_RUN`` patched, swept the machine's cgroup root and killed a soak's workspaces.)
"""

from __future__ import annotations

import secrets

from bunshin_gym.config import paths
from bunshin_gym.workspace import Workspace, gc, pool
from bunshin_gym.workspace.cgroups import Cgroup


def test_gc_with_another_run_directory_kills_no_live_workspace(tmp_path, monkeypatch):
    ws = Workspace.create("base")
    stray = f"ws-guard{secrets.token_hex(3)}"  # what a crashed controller leaves: no record names it
    Cgroup.create(stray)
    sub = paths().workspaces / stray
    pool.create_subvolume(sub)
    try:
        monkeypatch.setenv("BUNSHIN_RUN", str(tmp_path / "run"))
        (tmp_path / "run").mkdir()
        other = paths()
        assert gc.sweep_refusal(other) is not None
        rep = gc.collect(other)
        assert ws.id not in rep.cgroups and stray not in rep.cgroups and not rep.subvolumes, rep
        assert ws.exec("echo alive").text == "alive\n"  # its cgroup and files are untouched
        assert all(d.exists() for d in Cgroup(stray).dirs) and sub.exists()

        monkeypatch.undo()
        assert gc.sweep_refusal(paths()) is None
        rep = gc.collect()  # the process's own run directory: the strays are swept, the workspace kept
        assert stray in rep.cgroups and stray in rep.subvolumes and ws.id not in rep.cgroups, rep
        assert not any(d.exists() for d in Cgroup(stray).dirs) and not sub.exists()
        assert ws.exec("echo alive").text == "alive\n"
    finally:
        ws.close()
        for d in Cgroup(stray).dirs:
            if d.exists():
                Cgroup(stray).remove()
                break
        if sub.exists():
            pool.delete_subvolume(sub)


def test_gc_refuses_to_sweep_when_the_cgroup_root_changed(monkeypatch, tmp_path):
    monkeypatch.setenv("BUNSHIN_CGROUP_ROOT", str(tmp_path))
    why = gc.sweep_refusal(paths())
    assert why is not None and "BUNSHIN_CGROUP_ROOT" in why and str(tmp_path) in why
