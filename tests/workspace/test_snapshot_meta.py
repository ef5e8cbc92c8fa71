"""The snapshot store's typed metadata and its one deletion path, on snapshot directories laid
out by hand (no CRIU, no root): meta.json files of earlier versions load and are written back
key for key; lineage decides who needs whom from the typed fields; delete is refused while a
child needs the snapshot, release deletes an ephemeral chain once its last user goes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from bunshin_gym.config import Paths
from bunshin_gym.errors import SnapshotError
from bunshin_gym.workspace.snapshots import lineage, store
from bunshin_gym.workspace.snapshots import meta as meta_file
from bunshin_gym.workspace.snapshots.meta import SnapshotMeta

#: a meta.json as an earlier version wrote it: no refs, ref_depth, checksums, userns_base or
#: limits, and a key this version does not know
OLD_META = {
    "id": "snap-0ld", "parent": None, "workspace": "ws-1", "image": "base",
    "image_path": "/pool/images/base-abc", "layer": "/home/runtime/r1", "memory_mode": "copy",
    "depth": 0, "created": 1700000000.5, "ephemeral": False, "tags": {"task": "t"},
    "timings": {"frozen_ms": 12.5}, "criu_bytes": 4096, "migrated_from": "host-a",
}
#: the keys a snapshot taken now has (take()'s, unchanged by the typed record)
TAKE_KEYS = ["id", "parent", "workspace", "image", "image_path", "layer", "memory_mode", "depth",
             "userns_base", "limits", "ref_depth", "created", "ephemeral", "tags", "timings"]


def _paths(tmp_path: Path) -> Paths:
    p = Paths(home=tmp_path / "home", run=tmp_path / "run", pool_file=tmp_path / "pool.img", pool_size="1G",
              pool=tmp_path / "pool", criu_prefix=tmp_path / "criu")
    p.snapshots.mkdir(parents=True)
    p.records.mkdir(parents=True)
    return p


def _lay(p: Paths, snap_id: str, **fields) -> Path:
    """A complete-looking snapshot directory (the parts ``get`` checks) with its meta.json."""
    d = p.snapshots / snap_id
    for part in ("criu/inventory.img", "criu/pstree.img", "fs/upper"):
        (d / part).parent.mkdir(parents=True, exist_ok=True)
        (d / part).write_bytes(b"")
    meta = SnapshotMeta.new(id=snap_id, image="base", image_path="/i", layer="/l", memory_mode="copy", **fields)
    meta_file.write(d, meta)
    return d


def test_an_old_meta_json_loads_and_is_written_back_key_for_key(tmp_path):
    d = tmp_path / "snap-0ld"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps(OLD_META, indent=1))
    m = meta_file.read(d)
    assert (m.id, m.memory_mode, m.tags, m.criu_bytes) == ("snap-0ld", "copy", {"task": "t"}, 4096)
    assert m.refs is None and m.ref_depth is None and m.checksums is None  # absent: not recorded then
    assert m.other == {"migrated_from": "host-a"}
    meta_file.write(d, m)
    assert json.loads((d / "meta.json").read_text()) == OLD_META
    assert list(json.loads((d / "meta.json").read_text())) == list(OLD_META)  # same order too

    m.refs = ["snap-x"]  # a field set since is written; the absent ones stay absent
    meta_file.write(d, m)
    assert json.loads((d / "meta.json").read_text()) == {**OLD_META, "refs": ["snap-x"]}


def test_a_new_snapshot_has_the_keys_take_always_wrote():
    m = SnapshotMeta.new(id="snap-1", parent=None, workspace="ws-1", image="base", image_path="/i",
                         layer="/l", memory_mode="share", depth=0, userns_base=None, limits=None,
                         ref_depth=0, created=1.0, ephemeral=False, tags={}, timings={})
    assert list(m.to_dict()) == TAKE_KEYS  # defaults included: the file's keys are what take gave
    m.criu_bytes, m.checksums = 10, {"inventory.img": [10, "crc32:00000000"]}
    assert list(m.to_dict()) == [*TAKE_KEYS, "criu_bytes", "checksums"]


@pytest.mark.parametrize("content, why", [
    (None, "corrupt or incomplete: no meta.json"), ("{not json", "corrupt: meta.json"),
    ('{"parent": null}', "corrupt: meta.json"),
])
def test_a_missing_or_damaged_meta_json_names_the_snapshot(tmp_path, content, why):
    d = tmp_path / "snap-bad"
    d.mkdir()
    if content is not None:
        (d / "meta.json").write_text(content)
    with pytest.raises(SnapshotError, match=f"snapshot snap-bad is {why}"):
        meta_file.read(d)


def test_lineage_reads_the_typed_fields(tmp_path):
    p = _paths(tmp_path)
    st = store.Store(p)
    _lay(p, "snap-a", ref_depth=0)
    _lay(p, "snap-b", parent="snap-a", ref_depth=1, refs=["snap-a"])
    _lay(p, "snap-c", parent="snap-b", ref_depth=0, flattened={"at": 5.0, "refs_before": ["snap-a"]}, refs=[])
    a, b, c = (st.get(s) for s in ("snap-a", "snap-b", "snap-c"))
    assert lineage.needs(b, "snap-a") and not lineage.needs(c, "snap-b")  # flattened: lineage only
    assert lineage.users("snap-a", st.list(), []) == {"clones": [], "children": ["snap-b"]}
    assert lineage.users("snap-b", st.list(), []) == {"clones": [], "children": []}
    assert b.may_need() == ["snap-a"] and a.may_need() == []


def test_delete_is_refused_while_a_child_needs_it_and_release_takes_an_ephemeral_chain(tmp_path):
    p = _paths(tmp_path)
    st = store.Store(p)
    reclaimed: list[str] = []

    def reclaim(rec, p):  # no workspace exists here: the backends must not need to reclaim one
        reclaimed.append(rec.id)

    _lay(p, "snap-a", ephemeral=True)
    _lay(p, "snap-b", parent="snap-a")
    with pytest.raises(SnapshotError, match=r"snap-a is in use by clones \[\] and child snapshots \['snap-b'\]"):
        st.delete(st.get("snap-a"), reclaim)
    assert st.get("snap-a").id == "snap-a"  # untouched

    st.release("snap-a", reclaim)  # ephemeral, but its child needs it: kept
    assert (p.snapshots / "snap-a").is_dir()
    st.release(st.get("snap-b"), reclaim)  # nothing uses b: deleted, and a, which only b kept, with it
    assert not (p.snapshots / "snap-b").exists() and not (p.snapshots / "snap-a").exists()
    assert st.list() == [] and reclaimed == []
    st.release("snap-gone", reclaim)  # an id of no snapshot: nothing to do


def test_release_of_a_used_snapshot_marks_it_ephemeral_on_disk(tmp_path):
    p = _paths(tmp_path)
    st = store.Store(p)
    _lay(p, "snap-a", tags={"k": "v"})
    _lay(p, "snap-b", parent="snap-a")
    st.release(st.get("snap-a"), lambda rec, p: None)
    on_disk = json.loads((p.snapshots / "snap-a" / "meta.json").read_text())
    assert on_disk["ephemeral"] is True and on_disk["tags"] == {"k": "v"}
    st.delete(st.get("snap-b"), lambda rec, p: None)  # its last user goes: a goes with it
    assert not (p.snapshots / "snap-a").exists()


def test_threads_keeping_one_snapshot_at_once_never_see_a_corrupt_meta_json(tmp_path):
    """Written as the race: four threads keep one snapshot for changing owners, 200 times each,
    reading it back every time. With one shared temporary name each writer renamed the others'
    half-written files: in a probe of 4 x 300 calls, 728 failed (FileNotFoundError on the rename,
    and 'snapshot snap-x is corrupt: meta.json: Expecting value' for readers)."""
    p = _paths(tmp_path)
    st = store.Store(p)
    d = _lay(p, "snap-a", tags={"k": "v"})
    owners = [tmp_path / f"cache{i}" for i in range(4)]
    for o in owners:
        o.mkdir()
    errors: list[str] = []
    start = threading.Barrier(len(owners))

    def keep_many(i: int) -> None:
        start.wait()
        for k in range(200):
            try:
                snap = st.get("snap-a")
                snap.metadata.holder = [1, 2]  # as its holding process would have it
                st.keep(snap, by=owners[(i + k) % len(owners)])
            except Exception as e:  # noqa: BLE001 - counted: the test is that there are none
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=keep_many, args=(i,)) for i in range(len(owners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = meta_file.read(d)
    assert m.holder is None and m.kept_by in {str(o) for o in owners} and m.tags == {"k": "v"}
    assert sorted(f.name for f in d.iterdir()) == ["criu", "fs", "meta.json"]  # no temporary left
    assert (d / "meta.json").stat().st_mode & 0o777 == 0o644  # readable as before, not mkstemp's 0600


def test_concurrent_updates_of_different_fields_lose_neither(tmp_path):
    """A keep and a release marking one snapshot ephemeral at once each read, change and write
    meta.json: without the lock, the later write carried the other's stale copy of the field."""
    p = _paths(tmp_path)
    d = _lay(p, "snap-a")
    start = threading.Barrier(2)

    def bump(key: str) -> None:
        start.wait()
        for _ in range(150):
            with meta_file.updating(d) as m:
                m.tags[key] = m.tags.get(key, 0) + 1

    threads = [threading.Thread(target=bump, args=(key,)) for key in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meta_file.read(d).tags == {"a": 150, "b": 150}


def test_updating_a_snapshot_that_is_gone_names_it(tmp_path):
    with pytest.raises(SnapshotError, match="snap-gone is corrupt or incomplete"):
        with meta_file.updating(tmp_path / "snap-gone"):
            pass
