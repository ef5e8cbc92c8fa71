"""The desktop server's tree dumps keep what never changes between dumps (objects'
interfaces, Calc cell names: ``a11y_dump.AppMemo``), and the reset snapshot is taken after
one tree: checked on the Calc task against fresh full walks (a dump process with no memo)
while the app changes (typing into a cell, a menu opened and closed, another window
activated), and across snapshot, clone and rollback with the memo warm.
"""

from __future__ import annotations

import time

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs

TASK = "osworld/calc-max-sales"


@pytest.fixture(scope="module")
def env():
    e = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=True)
    yield e
    e.close()


def served(u) -> tuple[str, dict]:
    """The server's dump with its memo, and its reply (``memo_known``: objects it knew)."""
    reply, blobs = u._client()._client.request({"op": "a11y_tree", "seconds": 60.0, "max_nodes": 3000},
                                                 timeout=90)
    assert "error" not in reply, reply
    return blobs[0].decode(), reply


def fresh(u) -> str:
    """A full walk that asks everything: the fast walker as a process of its own (no memo)."""
    return u.accessibility_tree(seconds=60.0, process=True)


def same_as_fresh(u, what: str) -> tuple[str, dict]:
    """The served tree equals a fresh walk taken right before or after it (one of 3 tries:
    a live desktop may change between two dumps)."""
    for _ in range(3):
        before = fresh(u)
        tree, reply = served(u)
        after = fresh(u)
        if tree in (before, after):
            return tree, reply
    raise AssertionError(f"{what}: the served tree differs from a fresh walk: {_first_difference(tree, after)}")


def _first_difference(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.split("\n"), b.split("\n"), strict=False)):
        if x != y:
            return f"line {i}: {x!r} != {y!r}"
    return f"lengths differ: {a.count(chr(10))} vs {b.count(chr(10))} lines"


def step(e, code: str) -> None:
    _, _, _, _, info = e.step(code)
    assert "error" not in info, info
    time.sleep(1)


def test_the_memo_is_never_stale_while_calc_changes(env):
    obs, _ = env.reset(options={"task": TASK})
    u = env.unwrapped
    assert "LibreOffice Calc" in obs["accessibility_tree"] and obs["accessibility_tree"].count("<table-cell ") > 100
    tree, reply = same_as_fresh(u, "after reset")
    assert reply["memo_known"] > 100  # the observation's dump filled it
    step(env, "pyautogui.write('4242\\n')")
    tree, _ = same_as_fresh(u, "after typing into a cell")
    assert ">4242</table-cell>" in tree
    step(env, "pyautogui.press('f10')")  # the menu bar's first menu opens
    opened, _ = same_as_fresh(u, "menu open")
    assert opened != tree
    step(env, "pyautogui.press('esc'); pyautogui.press('esc')")
    closed, _ = same_as_fresh(u, "menu closed")
    # another window activated (the terminal: no AT-SPI), then Calc again: its frame's
    # "active" state goes and comes back
    step(env, "pyautogui.hotkey('alt', 'tab')")
    other, _ = same_as_fresh(u, "terminal active")
    step(env, "pyautogui.hotkey('alt', 'tab')")
    same_as_fresh(u, "Calc active again")
    assert len({tree, opened, other}) == 3


def test_snapshot_clone_and_rollback_with_the_memo_warm(env):
    """The memo lives in the desktop server, inside the workspace: a snapshot carries it (no
    connection of it is open then), a clone's first tree uses its source's memo and equals
    a fresh walk of the clone, and so does the first tree after a rollback."""
    env.reset(options={"task": TASK})
    u = env.unwrapped
    served(u)
    base, _ = same_as_fresh(u, "source")
    snap = u.snapshot()
    step(env, "pyautogui.write('777\\n')")
    changed, _ = same_as_fresh(u, "source changed")
    assert ">777</table-cell>" in changed
    (twin,) = u.clone(1)
    try:
        t = twin.unwrapped if hasattr(twin, "unwrapped") else twin
        tree, reply = served(t)
        assert reply["memo_known"] > 100  # the source's memo, forked with the server
        assert tree == fresh(t) or same_as_fresh(t, "clone")[0]
        assert ">777</table-cell>" in tree
    finally:
        twin.close()
    u.rollback(snap)
    tree, reply = served(u)
    assert reply["memo_known"] > 100
    assert ">777</table-cell>" not in tree
    assert tree == base or same_as_fresh(u, "rolled back")[0] == base


def test_the_reset_snapshot_holds_a_warm_tree(env):
    """The reset snapshot is taken after one tree: a clone of it has the walker's kept Calc
    cell objects (its cells file lists them) and the server's memo of that tree. (Calc frees
    some cell objects now and then, so some may be made anew: not checked.)"""
    env.reset(options={"task": TASK})
    u = env.unwrapped
    (twin,) = u.clone(1, lazy=True)  # right after reset: the reset snapshot itself
    try:
        t = twin.unwrapped
        cells = "/tmp/.bunshin/xdg/bunshin-a11y-cells.json"
        before = t.workspace.read_file(cells).decode()
        assert before.count("/org/a11y/atspi/accessible/") > 100
        tree, reply = served(t)
        assert reply["memo_known"] > 100 and tree.count("<table-cell ") > 100
    finally:
        twin.close()
