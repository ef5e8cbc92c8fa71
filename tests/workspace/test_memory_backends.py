"""Memory backends (bunshin_gym/workspace/memory/): one backend per mode behind one interface, a
registry, and typed record fields that read and write the record files of earlier versions.
Units: no workspace, no root (the restore plans of modes that start nothing)."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from bunshin_gym.config import Limits, Paths
from bunshin_gym.workspace import memory, records
from bunshin_gym.workspace.memory import MemoryMode
from bunshin_gym.workspace.memory.base import MemoryBackend
from bunshin_gym.workspace.records import KmodHolderStopped, KmodShareStats, Record, UffdMonitor

PKG = Path(memory.__file__).resolve().parents[1]  # bunshin_gym/workspace

#: a share clone's record as the version before the backends wrote it (``extra`` untyped)
OLD_SHARE_RECORD = {
    "id": "ws-0a1b2c3d", "image": "base", "image_path": "/pool/images/base", "subvolume": "/pool/ws/ws-0a1b2c3d",
    "cgroup": "ws-0a1b2c3d", "pid1": 4242, "pid1_start": 99, "owner": 17, "owner_start": 5, "created": 1.5,
    "layer": "/rt/layer", "memory_mode": "share", "snapshot": "snap-00112233", "userns_base": 1000000,
    "extra": {"limits": {"memory": 2 << 30, "pids": 512, "disk": 1 << 30},
              "uffd": {"guard": 11, "guard_start": 1, "worker": 12, "worker_start": 2,
                       "sock": "/run/bunshin/uffd/ws-0a1b2c3d.sock", "stem": "ws-0a1b2c3d"}},
    "builder": None, "builder_start": None,
}
#: a kmod clone, and the holder serving it, as the version before wrote them
OLD_KMOD_CLONE_EXTRA = {"limits": {"memory": 8 << 30, "pids": 4096, "disk": 8 << 30},
                        "kmod": {"processes": 3, "ranges": 40, "pages_shared": 0, "pages_copied": 9000,
                                 "fallback_ranges": 1, "fallback_reasons": {"protections": 1},
                                 "mechanism": "copy", "ms": 12.5}}
OLD_HOLDER_EXTRA = {"limits": {"memory": 8 << 30, "pids": 4096, "disk": 8 << 30}, "holder_of": "snap-00112233",
                    "kmod": {"stopped": 3}}


def _old(extra: dict, **fields) -> dict:
    return {**OLD_SHARE_RECORD, **fields, "extra": extra}


def _paths(root: Path) -> Paths:
    return Paths(home=root / "home", run=root / "run", pool_file=root / "pool.img", pool_size="1G",
                 pool=root / "pool", criu_prefix=root / "criu")


@pytest.fixture
def run_paths(tmp_path) -> Paths:
    return _paths(tmp_path)


# record files ---------------------------------------------------------------------------------
def test_a_record_written_by_the_old_layout_loads_into_typed_fields_and_is_written_back_the_same(run_paths):
    cases = [OLD_SHARE_RECORD, _old(OLD_KMOD_CLONE_EXTRA, id="ws-k", memory_mode="kmod"),
             _old(OLD_HOLDER_EXTRA, id="ws-h", memory_mode="copy"),
             _old({"uffd": {k: v for k, v in OLD_SHARE_RECORD["extra"]["uffd"].items() if k != "stem"}}, id="ws-s"),
             _old({}, id="ws-e", memory_mode="copy")]
    d = run_paths.records
    d.mkdir(parents=True)
    for data in cases:
        (d / f"{data['id']}.json").write_text(json.dumps(data))

    share = records.load("ws-0a1b2c3d", run_paths)
    assert share.limits == Limits(memory=2 << 30, pids=512, disk=1 << 30)
    assert share.uffd == UffdMonitor(guard=11, guard_start=1, worker=12, worker_start=2,
                                     sock="/run/bunshin/uffd/ws-0a1b2c3d.sock", stem="ws-0a1b2c3d")
    assert share.kmod is None and share.holder_of is None
    clone = records.load("ws-k", run_paths)
    assert isinstance(clone.kmod, KmodShareStats)
    assert (clone.kmod.mechanism, clone.kmod.pages_copied, clone.kmod.fallback_reasons) == ("copy", 9000,
                                                                                            {"protections": 1})
    holder = records.load("ws-h", run_paths)
    assert holder.holder_of == "snap-00112233" and holder.kmod == KmodHolderStopped(stopped=3)
    assert records.load("ws-s", run_paths).uffd.stem is None  # older monitors had no stem
    assert records.load("ws-e", run_paths).limits is None

    for data in cases:  # saved again: the same JSON, key for key
        records.save(records.load(data["id"], run_paths), run_paths)
        assert json.loads((d / f"{data['id']}.json").read_text()) == data


def test_typed_fields_are_saved_under_the_old_extra_keys(run_paths):
    rec = Record(id="ws-1", image="base", image_path="/i", subvolume="/s", cgroup="ws-1", limits=Limits(pids=7),
                 uffd=UffdMonitor(1, 2, 3, 4, "/sock", "ws-1"), kmod=KmodShareStats(processes=2, mechanism="module"),
                 holder_of=None)
    records.save(rec, run_paths)
    extra = json.loads((run_paths.records / "ws-1.json").read_text())["extra"]
    assert set(extra) == {"limits", "uffd", "kmod"}
    assert extra["limits"] == {"memory": 8 << 30, "pids": 7, "disk": 8 << 30}
    assert extra["uffd"]["sock"] == "/sock" and extra["kmod"]["mechanism"] == "module"
    assert records.load("ws-1", run_paths) == rec
    assert not hasattr(rec, "extra")  # no untyped view of the file's layout: readers use the fields


def test_a_damaged_record_is_skipped_by_listing_and_the_others_still_load(run_paths):
    d = run_paths.records
    d.mkdir(parents=True)
    (d / "ws-good.json").write_text(json.dumps(_old({}, id="ws-good")))
    (d / "ws-bad.json").write_text(json.dumps(_old({"uffd": {"guard": 1}}, id="ws-bad")))  # fields missing
    (d / "ws-badlimits.json").write_text(json.dumps(_old({"limits": {"cpu": 1}}, id="ws-badlimits")))
    assert [r.id for r in records.all_records(run_paths)] == ["ws-good"]
    assert records.all_ids(run_paths) == {"ws-good", "ws-bad", "ws-badlimits"}  # gc never sweeps them


# the registry -----------------------------------------------------------------------------------
def test_every_mode_has_exactly_one_backend_of_its_name():
    backends = memory.all_backends()
    assert sorted(b.name for b in backends) == sorted(m.value for m in MemoryMode)
    for mode in MemoryMode:
        b = memory.backend(mode)
        assert isinstance(b, MemoryBackend) and b.name == mode.value and memory.backend(mode.value) is b
    with pytest.raises(ValueError, match="unknown memory mode 'shared'; choose one of copy, ksm, share"):
        memory.backend("shared")


def test_a_holder_belongs_to_the_kmod_backend_and_an_unknown_mode_is_torn_down_plainly(caplog):
    holder = Record(**{k: v for k, v in OLD_SHARE_RECORD.items() if k != "extra"} | {"memory_mode": "copy"},
                    holder_of="snap-1")
    assert memory.for_record(holder) is memory.backend("kmod")
    assert memory.for_record(holder).collected_later(holder)
    clone = Record(**{k: v for k, v in OLD_SHARE_RECORD.items() if k != "extra"} | {"memory_mode": "kmod"})
    assert memory.for_record(clone) is memory.backend("kmod") and not memory.for_record(clone).collected_later(clone)
    future = Record(**{k: v for k, v in OLD_SHARE_RECORD.items() if k != "extra"} | {"memory_mode": "cxl"})
    with caplog.at_level(logging.WARNING):
        assert memory.for_record(future) is memory.backend("copy")
    assert "'cxl', unknown to this version" in caplog.text


def test_mode_properties_as_before():
    assert [m for m in MemoryMode if memory.maps_images(m)] == [MemoryMode.SHARE, MemoryMode.MAP_ANON]
    assert memory.uses_ksm(MemoryMode.KSM) and not memory.uses_ksm(MemoryMode.COPY)
    assert not any(memory.uses_uffd(m) for m in MemoryMode if m is not MemoryMode.SHARE)
    assert memory.uses_uffd(MemoryMode.SHARE) == (memory.SHARE_ANON_MECHANISM == "uffd")
    assert [m for m in MemoryMode if memory.backend(m).one_by_one] == [MemoryMode.KMOD]


class _Snap:
    id = "snap-0badcafe"
    path = Path("/pool/snapshots/snap-0badcafe")
    criu_dir = path / "criu"

    def fork(self, *a, **kw):
        raise AssertionError("no helper is made for this mode")


def test_restore_plans_of_the_modes_that_start_nothing(run_paths):
    rec = Record(id="ws-2", image="base", image_path="/i", subvolume="/s", cgroup="ws-2", memory_mode="copy")
    copy = memory.backend("copy").restore(_Snap(), rec, run_paths, None)
    assert (copy.images, copy.env, copy.args, copy.ksm) == (_Snap.criu_dir, {}, [], False)
    anon = memory.backend("map-anon").restore(_Snap(), rec, run_paths, None)
    assert anon.env == {"CRIU_MMAP_PAGES": "1", "CRIU_MMAP_PAGES_DIR": "/.snap/snap-0badcafe/criu",
                        "CRIU_MMAP_ANON": "1"}
    assert anon.images == _Snap.criu_dir and not anon.ksm and anon.args == []
    for mode in MemoryMode:
        if mode is not MemoryMode.KMOD:  # (kmod's holder: tests/workspace/test_fork_kmod.py)
            assert memory.backend(mode).helper(_Snap(), run_paths) is None


def test_kmod_refuses_before_anything_is_made_where_the_module_is_missing(run_paths):
    from bunshin_gym.workspace.errors import SetupError

    p = run_paths  # no CRIU built there
    with pytest.raises(SetupError, match="memory mode 'kmod' is unavailable: CRIU is not built"):
        memory.backend("kmod").check_available(p)
    for mode in MemoryMode:
        if mode is not MemoryMode.KMOD:
            memory.backend(mode).check_available(p)  # nothing to check


def test_the_kmod_report_becomes_typed_and_a_failure_refuses_the_clone(run_paths, tmp_path):
    from bunshin_gym.workspace import kmod
    from bunshin_gym.workspace.errors import ForkError

    rec = Record(id="ws-3", image="base", image_path="/i", subvolume="/s", cgroup="ws-3", memory_mode="kmod",
                 snapshot="snap-1")
    report = kmod.report_path(rec, run_paths)
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps(OLD_KMOD_CLONE_EXTRA["kmod"]))
    memory.for_record(rec).restored(rec, True, run_paths, tmp_path / "restore.log")
    assert rec.kmod == KmodShareStats(processes=3, ranges=40, pages_copied=9000, fallback_ranges=1,
                                      fallback_reasons={"protections": 1}, mechanism="copy", ms=12.5)
    assert not report.exists()
    report.write_text(json.dumps({"error": "RuntimeError: pid 7: the holder does not map 0x1000-0x2000"}))
    with pytest.raises(ForkError, match="sharing anonymous memory from the holder failed .* pid 7"):
        memory.for_record(rec).restored(rec, False, run_paths, tmp_path / "restore.log")
    rec.kmod = None
    memory.for_record(rec).restored(rec, False, run_paths, tmp_path / "restore.log")  # no report, failed
    assert rec.kmod is None  # CRIU's own failure is the fork's to report


# one way, and the modes in one place ----------------------------------------------------------
def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_backends_and_the_mechanisms_they_drive_import_no_handle_module():
    handles = {f"bunshin_gym.workspace.{m}"
               for m in ("workspace", "snapshot", "gc", "snapshots", "pristine", "forking", "teardown")}
    for path in [*sorted((PKG / "memory").glob("*.py")), PKG / "uffd.py", PKG / "kmod.py", PKG / "records.py"]:
        wrong = {m for m in _imported(path) if any(m == h or m.startswith(h + ".") for h in handles)}
        assert not wrong, f"{path.relative_to(PKG)} imports {sorted(wrong)}"


#: what only a backend may name: a mode's mechanism (the ``kmod`` module, ``uffd``, ksmd) or a mode
MODE_NAMES = {"uffd", "kmod", "ksm_acquire", "ksm_release", "uses_uffd", "uses_ksm", "KMOD", "SHARE",
              "KSM", "COPY", "MAP_ANON", "HOLDER_KEY", "close_holders", "holder_for", "restore_setup", "extra"}


def test_the_restore_teardown_gc_and_snapshot_store_code_names_no_mode():
    """The places the modes used to be wired into by hand (restore, teardown, gc, delta,
    flattening's image copy) ask the backend instead: adding a mode touches only its file and
    the registry."""
    store = [f.relative_to(PKG).as_posix() for f in sorted((PKG / "snapshots").glob("*.py"))]
    for name in ("forking.py", "teardown.py", "workspace.py", "gc.py", *store):
        tree = ast.parse((PKG / name).read_text())
        named = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not named & MODE_NAMES, f"{name} names {sorted(named & MODE_NAMES)}"
