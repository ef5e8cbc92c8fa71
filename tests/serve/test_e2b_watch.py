"""The ``e2b`` SDK's directory watchers against ``bunshin serve`` (by polling inside the
workspace: inotify is refused there on purpose): create, write, chmod, rename, remove;
recursive or not; symlinks not followed; bounded; bad requests as clear errors."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import AsyncSandbox
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType as T

from bunshin_gym.serve import watch


def events(handle) -> list[tuple[str, T]]:
    return [(e.name, e.type) for e in handle.get_new_events()]


def test_watch_dir_reports_each_kind_of_change(sandbox):
    sandbox.files.make_dir("/tmp/w")
    sandbox.files.write("/tmp/w/keep.txt", "k")
    h = sandbox.files.watch_dir("/tmp/w")
    assert events(h) == [], "what was there before is not news"
    sandbox.files.write("/tmp/w/a.txt", "alpha")
    assert events(h) == [("a.txt", T.CREATE), ("a.txt", T.WRITE)]
    sandbox.commands.run("echo more >> /tmp/w/a.txt")
    assert events(h) == [("a.txt", T.WRITE)]
    sandbox.commands.run("chmod 600 /tmp/w/a.txt")
    assert events(h) == [("a.txt", T.CHMOD)]
    sandbox.files.rename("/tmp/w/a.txt", "/tmp/w/b.txt")
    assert events(h) == [("a.txt", T.RENAME), ("b.txt", T.CREATE)]
    sandbox.files.remove("/tmp/w/b.txt")
    assert events(h) == [("b.txt", T.REMOVE)]
    sandbox.commands.run("mkdir /tmp/w/sub && echo x > /tmp/w/sub/x")
    assert events(h) == [("sub", T.CREATE)], "not recursive: only the directory's own entries"
    h.stop()

    # recursive, and a symlink inside is listed but not followed
    sandbox.commands.run("mkdir -p /tmp/outside && ln -s /tmp/outside /tmp/w/link")
    r = sandbox.files.watch_dir("/tmp/w", recursive=True)
    sandbox.commands.run("echo y > /tmp/w/sub/y; echo z > /tmp/outside/z; rm /tmp/w/sub/x")
    assert events(r) == [("sub/x", T.REMOVE), ("sub/y", T.CREATE), ("sub/y", T.WRITE)]
    r.stop()


def test_watchers_are_bounded_and_bad_requests_are_clear(sandbox):
    with pytest.raises(Exception, match="no such directory"):
        sandbox.files.watch_dir("/tmp/nope")
    sandbox.files.write("/tmp/file", "f")
    with pytest.raises(Exception, match="is not a directory"):
        sandbox.files.watch_dir("/tmp/file")
    with pytest.raises(Exception, match="may not list it"):
        sandbox.files.watch_dir("/root")
    sandbox.commands.run(f"mkdir /tmp/big && cd /tmp/big && seq {watch.MAX_ENTRIES + 1} | xargs touch")
    with pytest.raises(Exception, match="too many to watch"):
        sandbox.files.watch_dir("/tmp/big")

    handles = [sandbox.files.watch_dir("/tmp") for _ in range(watch.MAX_WATCHERS)]
    with pytest.raises(Exception, match=f"at most {watch.MAX_WATCHERS} watchers"):
        sandbox.files.watch_dir("/tmp")
    handles.pop().stop()
    handles.append(sandbox.files.watch_dir("/tmp"))  # a stopped watcher's place is free again
    for h in handles:
        h.stop()


def test_async_watch_dir_streams_events(server, opts):
    async def main() -> list[tuple[str, T]]:
        sb = await AsyncSandbox.create("base", **opts)
        try:
            await sb.files.make_dir("/tmp/aw")
            seen: list[tuple[str, T]] = []
            h = await sb.files.watch_dir("/tmp/aw", on_event=lambda e: seen.append((e.name, e.type)), timeout=0)
            await sb.files.write("/tmp/aw/one", "1")
            deadline = time.monotonic() + 20
            while ("one", T.WRITE) not in seen:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            await sb.commands.run("mv /tmp/aw/one /tmp/aw/two")
            while ("two", T.CREATE) not in seen:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            await h.stop()
            return seen
        finally:
            await sb.kill()

    assert asyncio.run(main()) == [("one", T.CREATE), ("one", T.WRITE), ("one", T.RENAME), ("two", T.CREATE)]


def test_a_watcher_outlives_a_server_restart(tmp_path):
    from e2b import Sandbox

    from .conftest import Server, e2b_opts

    state = tmp_path / "state"
    first = Server(tmp_path, state_dir=state)  # keeps its sandboxes when it stops
    second = None
    sb = Sandbox.create("base", **e2b_opts(first))
    try:
        sb.files.make_dir("/tmp/w")
        h = sb.files.watch_dir("/tmp/w")
        gone = sb.files.watch_dir("/tmp/w")
        gone.stop()  # a removed watcher is not kept
        sb.files.write("/tmp/w/before", "b")
        assert events(h) == [("before", T.CREATE), ("before", T.WRITE)]
        sb.files.write("/tmp/w/meanwhile", "m")  # changed while no poll comes: reported after the restart
        first.stop()
        assert len(list((state / "watchers" / sb.sandbox_id).glob("*.json"))) == 1

        second = Server(tmp_path, "--close-on-exit", state_dir=state, port=first.port)
        again = Sandbox.connect(sb.sandbox_id, **e2b_opts(second))
        again.files.remove("/tmp/w/before")
        # the same handle, whose watcher the new server read back with its last listing
        assert events(h) == [("before", T.REMOVE), ("meanwhile", T.CREATE), ("meanwhile", T.WRITE)]
        assert events(h) == []
        again.kill()
        assert not (state / "watchers" / sb.sandbox_id).exists(), "a killed sandbox's watchers are forgotten"
    finally:
        if second is None:
            sb.kill()
            first.stop()
        else:
            second.stop()
