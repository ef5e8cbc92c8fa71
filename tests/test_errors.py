"""bunshin_gym.errors: every public exception under BunshinError, old import paths kept,
ResetNeeded is gymnasium's own. Units: no workspace, no root."""

from __future__ import annotations

import ast
import builtins
import errno
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym import errors
from bunshin_gym.testing import fake_factory

REPO = Path(__file__).resolve().parents[1]
#: programs that run inside a workspace with its python (no bunshin_gym there): their
#: exceptions are theirs, never seen by a caller of the package
IN_WORKSPACE = {
    "bunshin_gym/workspace/agent.py", "envs/webarena/driver.py", "envs/webarena/shop/server.py",
}
IN_WORKSPACE_DIRS = ("envs/osworld/runtime/", "envs/osworld/assets/")

#: old path -> names it must still export, the same objects as bunshin_gym.errors'
OLD_PATHS = {
    "bunshin_gym.workspace.errors": ["WorkspaceError", "WorkspaceClosed", "UnknownImage", "AgentError",
                                     "ChannelError", "SetupError", "ForkError", "SnapshotError"],
    "bunshin_gym.workspace": ["WorkspaceError", "WorkspaceClosed", "UnknownImage", "AgentError", "SetupError"],
    "bunshin_gym.workspace.snapshots.flatten": ["FlattenUnavailable"],
    "bunshin_gym.workspace.protocol": ["ProtocolError"],
    "bunshin_gym.core.env": ["ActionError", "ResetNeeded"],
    "bunshin_gym.core.task": ["TaskError"],
    "bunshin_gym.core": ["TaskError"],
    "bunshin_gym.envs.webarena.actions": ["ActionSyntaxError", "URLRefused"],
    "bunshin_gym.envs.webarena.browser": ["DriverError"],
    "bunshin_gym.envs.osworld.xclient": ["XError"],
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "envs":
        parts = ["bunshin_gym", *parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class the package's library code defines on an exception base
    (a builtin exception, a bunshin one, or any name ending in Error/Exception), found in the
    source, so that a module no test imports cannot slip past."""
    bases = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    bases |= set(errors.__all__)
    found = []
    for path in sorted([*REPO.joinpath("bunshin_gym").rglob("*.py"), *REPO.joinpath("envs").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel in IN_WORKSPACE or rel.startswith(IN_WORKSPACE_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.ClassDef):
                continue
            names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, (ast.Name, ast.Attribute))}
            if names & bases or any(n.endswith(("Error", "Exception")) for n in names):
                found.append((_module_name(path), node.name))
    return found


#: the layers whose public exceptions all live in bunshin_gym/errors.py (docs/design.md); the
#: subsystems above them (the service, the training job, ...) may define their own, each a
#: BunshinError
CATALOGUED = ("bunshin_gym.errors", "bunshin_gym.config", "bunshin_gym.workspace", "bunshin_gym.core",
              "bunshin_gym.envs", "bunshin_gym.rollout", "bunshin_gym.registration")


def test_every_exception_the_package_defines_is_a_bunshin_error():
    classes = _exception_classes()
    # the catalogue and the wire's own subclasses, at least
    assert ("bunshin_gym.errors", "ResetNeeded") in classes
    assert ("bunshin_gym.workspace.protocol", "RequestTimeout") in classes
    outside = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            continue
        if not issubclass(cls, errors.BunshinError):
            outside.append(f"{module}.{name}")
        catalogued = module.startswith(CATALOGUED) and module not in ("bunshin_gym.errors",
                                                                     "bunshin_gym.workspace.protocol")
        if catalogued and not name.startswith("_"):
            outside.append(f"{module}.{name} (define it in bunshin_gym/errors.py)")
    assert not outside, outside


def test_old_import_paths_give_the_same_classes():
    for module, names in OLD_PATHS.items():
        mod = importlib.import_module(module)
        for name in names:
            assert getattr(mod, name) is getattr(errors, name), f"{module}.{name}"
    assert set(errors.__all__) == {n for n, v in vars(errors).items()
                                   if isinstance(v, type) and issubclass(v, BaseException)
                                   and v.__module__ == errors.__name__}


def test_standard_bases_are_kept():
    """What callers caught before still catches the same errors."""
    assert issubclass(errors.WorkspaceError, RuntimeError)
    assert issubclass(errors.SnapshotError, errors.WorkspaceError)
    assert issubclass(errors.FlattenUnavailable, errors.SnapshotError)
    for cls in (errors.TaskError, errors.ActionError, errors.ActionSyntaxError, errors.URLRefused):
        assert issubclass(cls, ValueError)
    assert issubclass(errors.DriverError, RuntimeError)
    assert issubclass(errors.ResetNeeded, RuntimeError)
    unknown = errors.UnknownImage("no image 'x' (known: base)")
    assert isinstance(unknown, KeyError) and str(unknown) == "no image 'x' (known: base)"  # not quoted
    x = errors.XError(errno.ECONNREFUSED, "refused")
    assert isinstance(x, OSError) and x.errno == errno.ECONNREFUSED
    assert errors.AgentError("no such file", errno.ENOENT).errno == errno.ENOENT
    from bunshin_gym.workspace.protocol import ReplyTooLarge, RequestTimeout, Unreachable

    for cls in (ReplyTooLarge, RequestTimeout, Unreachable):
        assert issubclass(cls, errors.ProtocolError) and issubclass(cls, errors.BunshinError)


def test_reset_needed_is_gymnasiums_own():
    """A caller catching gymnasium.error.ResetNeeded catches the env's (it used to be a
    RuntimeError of the same name that gymnasium's except clause missed)."""
    env = gym.make("Bunshin-Shell-v0", task="shell/count-files", workspace_factory=fake_factory, max_steps=1)
    try:
        with pytest.raises(gym.error.ResetNeeded, match="reset"):
            env.unwrapped.step("true")  # the unwrapped env: gymnasium's order wrapper is not in the way
        env.reset()
        env.step("true")  # the last step
        with pytest.raises(gym.error.ResetNeeded, match="ended") as caught:
            env.unwrapped.step("true")
        assert isinstance(caught.value, errors.BunshinError)
    finally:
        env.close()


def test_the_shipped_protocol_module_stands_alone(tmp_path):
    """Inside a workspace /.bunshin/protocol.py has no bunshin_gym to take its error base
    from: it defines its own, and the framing works with it."""
    from bunshin_gym.workspace import protocol

    shutil.copy(protocol.__file__, tmp_path / "protocol.py")
    code = ("import socket, sys; sys.path.insert(0, sys.argv[1]); import protocol\n"
            "assert protocol.ProtocolError.__bases__ == (Exception,), protocol.ProtocolError.__mro__\n"
            "assert 'bunshin_gym' not in sys.modules\n"
            "a, b = socket.socketpair(); protocol.send_msg(a, {'op': 'ping'}, [b'xy'])\n"
            "print(protocol.recv_msg(b, timeout=5))\n")
    # -I -S: no site-packages (where the editable install would make bunshin_gym importable)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "({'op': 'ping'}, [b'xy'])"
