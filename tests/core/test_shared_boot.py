"""Envs of one kind share one boot snapshot (bunshin_gym.core.boots): one boot for all,
each env's workspace a fork of it, the snapshot gone when the last of them closes.

On the real shell env, with a family that opts in: its boot starts a process that keeps a
random token, so a test can tell one boot from another."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.core import boots
from bunshin_gym.envs.shell.env import ShellEnv
from bunshin_gym.workspace.errors import SnapshotError
from bunshin_gym.workspace.snapshot import SnapshotStore

TASK = "shell/make-dir"
#: a process of the boot keeps its token in memory and in a file: a fork has both
BOOT = ("import os, time, secrets\n"
        "token = secrets.token_hex(8)\n"
        "open('/tmp/boot-token', 'w').write(token)\n"
        "while True: time.sleep(60)\n")


class BootedShell(ShellEnv):
    """A shell env whose boot is slow enough to share (and counted)."""

    boots_run = 0
    fail_boot = False

    def __init__(self, task: Any = None, *, flavour: str = "a", **kwargs: Any):
        super().__init__(task, **kwargs)
        self.flavour = flavour

    def boot_config(self) -> dict:
        return {"flavour": self.flavour}

    def boot(self, ws: Any) -> None:
        type(self).boots_run += 1
        if type(self).fail_boot:
            raise RuntimeError("the boot broke")
        ws.write_file("/opt/boot.py", BOOT)
        ws.spawn(["python3", "/opt/boot.py"])
        ws.exec("for i in $(seq 100); do [ -s /tmp/boot-token ] && break; sleep 0.05; done", check=True)


def _token(env: BootedShell) -> str:
    return env.workspace.exec("cat /tmp/boot-token", check=True).text.strip()


def _exists(snap_id: str) -> bool:
    try:
        SnapshotStore().get(snap_id)
    except SnapshotError:
        return False
    return True


@pytest.fixture(autouse=True)
def counted():
    BootedShell.boots_run, BootedShell.fail_boot = 0, False
    yield
    assert not any(k[1] == "BootedShell" for k in boots.held()), "a shared boot snapshot outlived its envs"


def test_two_envs_of_a_kind_boot_once_and_fork_one_snapshot():
    a, b = BootedShell(), BootedShell()
    try:
        a.reset(options={"task": TASK})
        b.reset(options={"task": "shell/count-files"})
        assert BootedShell.boots_run == 1
        snap = a._boot_snap
        assert b._boot_snap is snap
        assert a.workspace.base_snapshot == b.workspace.base_snapshot == snap.id  # both forks of it
        assert _token(a) == _token(b)  # one boot's process, in each
        assert [n for k, n in boots.held().items() if k[1] == "BootedShell"] == [2]
        # each is its own workspace from the fork on
        a.step("echo only-a > /tmp/who")
        assert b.step("cat /tmp/who 2>/dev/null || echo none")[0]["output"].strip() == "none"
        # a later reset returns to the shared boot (a rollback to it), not a new boot
        a.reset(options={"task": TASK})
        assert BootedShell.boots_run == 1 and _token(a) == _token(b)
        assert a.step("cat /tmp/who 2>/dev/null || echo none")[0]["output"].strip() == "none"
    finally:
        a.close()
    assert _exists(snap.id)  # b still holds it
    b.reset(options={"task": TASK})
    assert BootedShell.boots_run == 1
    b.close()
    assert not _exists(snap.id)


def test_a_keep_block_keeps_the_boot_for_the_next_env_of_its_kind():
    with boots.keep():
        a = BootedShell()
        try:
            a.reset(options={"task": TASK})
            snap, token = a._boot_snap, _token(a)
        finally:
            a.close()
        assert _exists(snap.id)  # no env holds it: the block keeps it
        assert [n for k, n in boots.held().items() if k[1] == "BootedShell"] == [0]
        b = BootedShell()
        try:
            b.reset(options={"task": "shell/count-files"})
            assert BootedShell.boots_run == 1 and b._boot_snap is snap and _token(b) == token
            with boots.keep():  # an inner block's end releases nothing while the outer is open
                pass
        finally:
            b.close()
        assert _exists(snap.id)
    assert not _exists(snap.id)  # released at the block's end
    c = BootedShell()
    try:
        c.reset(options={"task": TASK})
        assert BootedShell.boots_run == 2 and _token(c) != token  # outside a block: a boot again
    finally:
        c.close()


def test_other_kinds_and_share_boot_false_boot_their_own():
    a, b, c = BootedShell(), BootedShell(flavour="b"), BootedShell(share_boot=False)
    try:
        for env in (a, b, c):
            env.reset(options={"task": TASK})
        assert BootedShell.boots_run == 3
        assert len({_token(a), _token(b), _token(c)}) == 3
        assert c.workspace.base_snapshot is None  # booted in place, as before sharing
        assert len({e._boot_snap.id for e in (a, b, c)}) == 3
    finally:
        for env in (a, b, c):
            env.close()
    assert not any(_exists(e._boot_snap.id) for e in (a, b, c))


def test_envs_resetting_at_once_wait_for_one_boot():
    envs = [BootedShell() for _ in range(3)]
    errors: list[BaseException] = []

    def reset(env: BootedShell) -> None:
        try:
            env.reset(options={"task": TASK})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reset, args=(e,)) for e in envs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert BootedShell.boots_run == 1
        assert len({_token(e) for e in envs}) == 1
    finally:
        for e in envs:
            e.close()


def test_a_failed_boot_raises_and_the_next_reset_boots_again():
    BootedShell.fail_boot = True
    a = BootedShell()
    try:
        with pytest.raises(RuntimeError, match="the boot broke"):
            a.reset(options={"task": TASK})
        assert not any(k[1] == "BootedShell" for k in boots.held())
        BootedShell.fail_boot = False
        a.reset(options={"task": TASK})
        assert BootedShell.boots_run == 2 and _token(a)
    finally:
        a.close()


class _FakeSnapshot:
    """A test double of a stored snapshot: counts its releases."""

    def __init__(self) -> None:
        self.id, self.released = "snap-fake", 0

    def release(self) -> None:
        self.released += 1


def test_registry_waiters_get_the_first_boot_and_its_error():
    gate, made = threading.Event(), _FakeSnapshot()

    def slow_boot() -> _FakeSnapshot:
        gate.wait(5)
        return made

    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(boots.acquire(("fake", 1), slow_boot)))
    first.start()
    _wait_for_holders(("fake", 1), 1)
    again = threading.Thread(target=lambda: got.append(boots.acquire(("fake", 1), lambda: pytest.fail("booted twice"))))
    again.start()
    gate.set()
    first.join()
    again.join()
    assert got == [made, made]
    boots.release(("fake", 1))
    assert made.released == 0
    boots.release(("fake", 1))
    assert made.released == 1 and ("fake", 1) not in boots.held()

    def broken() -> Any:
        gate2.wait(5)
        raise OSError("no disk")

    # a boot that fails fails the env that waited for it too, with its error, and leaves nothing
    gate2, errors = threading.Event(), []

    def acquire(boot) -> None:
        try:
            boots.acquire(("fake", 2), boot)
        except OSError as e:
            errors.append(e)

    failing = threading.Thread(target=acquire, args=(broken,))
    failing.start()
    _wait_for_holders(("fake", 2), 1)
    waiting = threading.Thread(target=acquire, args=(lambda: pytest.fail("a waiter booted"),))
    waiting.start()
    _wait_for_holders(("fake", 2), 2)
    gate2.set()
    failing.join()
    waiting.join()
    assert [str(e) for e in errors] == ["no disk", "no disk"]  # the booting env's and its waiter's
    assert ("fake", 2) not in boots.held()


def _wait_for_holders(key: tuple, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while boots.held().get(key) != n:
        assert time.monotonic() < deadline, f"{key} never had {n} holder(s)"
        time.sleep(0.001)


def test_the_desktop_and_web_envs_share_a_boot_only_with_the_same_boot_arguments():
    from bunshin_gym.envs.osworld.env import OSWorldEnv
    from bunshin_gym.envs.webarena.env import WebArenaEnv

    def key(cls, **kw):
        env = cls(**kw)
        try:
            return env._boot_key()
        finally:
            env.close()

    assert key(OSWorldEnv) == key(OSWorldEnv, require_a11y_tree=False)  # not a boot argument
    assert key(OSWorldEnv) != key(OSWorldEnv, screen_size=(1280, 720))
    assert key(OSWorldEnv) != key(OSWorldEnv, memory_mode="copy")
    assert key(OSWorldEnv) != key(OSWorldEnv, limits={"memory": "2G"})
    assert key(OSWorldEnv, share_boot=False) is None
    assert key(OSWorldEnv, workspace_factory=lambda image, mode: None) is None  # a test double boots alone
    assert key(WebArenaEnv) == key(WebArenaEnv, screenshot=True)
    assert key(WebArenaEnv) != key(WebArenaEnv, viewport=(800, 600))
    assert key(WebArenaEnv) != key(OSWorldEnv)
