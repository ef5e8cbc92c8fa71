"""Every BUNSHIN_* variable is read in bunshin_gym/config.py, listed in its VARIABLES, and
documented in docs/configuration.md (generated from that list). Units: no workspace, no root."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from bunshin_gym import config

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"BUNSHIN_[A-Z0-9_]+")
#: BUNSHIN_* words that are not environment variables: the kernel module's C names (its
#: device, API version and ioctls, quoted by the Python that calls them) and the result line
#: the kmod VM's init prints
NOT_VARIABLES = re.compile(r"BUNSHIN_SHARE_(IOC_[A-Z_]+|API|DEVICE|H)|BUNSHIN_KMOD_RESULT")


def _scanned() -> list[Path]:
    """The files a variable may be read or mentioned in: the package, the env families, the
    scripts (set-up, tests, CRIU build, kernel-module VM tests) and the docs. Not tests/ (a
    test may set a marker of its own) and not C sources."""
    files = [*REPO.joinpath("bunshin_gym").rglob("*.py"), *REPO.joinpath("envs").rglob("*.py"),
             *REPO.joinpath("scripts").rglob("*.sh"), *REPO.joinpath("criu").glob("*.sh"),
             *REPO.joinpath("kmod").glob("*.sh"), *REPO.joinpath("kmod", "tests").glob("*.sh"),
             *REPO.joinpath("kmod", "tests").glob("*.py"), REPO / "Makefile", REPO / "README.md",
             *REPO.joinpath("docs").glob("*.md"), *REPO.joinpath(".ci").glob("*")]
    return sorted(f for f in files if f.is_file() and f.name != "configuration.md")


def _mentioned() -> dict[str, set[str]]:
    """Each BUNSHIN_* name -> the files (repo-relative) that name it."""
    found: dict[str, set[str]] = {}
    for f in _scanned():
        for name in NAME.findall(f.read_text(errors="replace")):
            if name.endswith("_") or NOT_VARIABLES.fullmatch(name):  # BUNSHIN_WS_*: a family, named whole
                continue
            found.setdefault(name, set()).add(f.relative_to(REPO).as_posix())
    return found


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _environ_reads(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of every read of the process environment: ``os.environ.get(k)``,
    ``os.environ[k]`` (not as a target), ``os.getenv(k)``, ``k in os.environ``."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and _is_environ(f.value)) or (
                    isinstance(f, (ast.Attribute, ast.Name)) and getattr(f, "attr", getattr(f, "id", "")) == "getenv"):
                reads.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.lineno, node.left))
    return reads


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` bindings (a variable's name kept in a constant)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def test_no_bunshin_variable_is_read_outside_config():
    config_py = REPO / "bunshin_gym" / "config.py"
    offenders = []
    for f in [*REPO.joinpath("bunshin_gym").rglob("*.py"), *REPO.joinpath("envs").rglob("*.py")]:
        if f == config_py:
            continue
        tree = ast.parse(f.read_text(), str(f))
        consts = _constants(tree)
        for line, key in _environ_reads(tree):
            value = key.value if isinstance(key, ast.Constant) else consts.get(getattr(key, "id", ""))
            if isinstance(value, str) and value.startswith("BUNSHIN_"):
                offenders.append(f"{f.relative_to(REPO)}:{line} reads {value}")
    assert not offenders, "read these through bunshin_gym.config: " + "; ".join(offenders)


def test_every_variable_anywhere_is_listed():
    listed = {v.name for v in config.VARIABLES}
    unlisted = {name: sorted(files) for name, files in _mentioned().items() if name not in listed}
    assert not unlisted, f"add these to bunshin_gym/variables.toml: {unlisted}"


def test_every_listed_variable_is_used():
    """No stale rows: a package variable is read through config (a ``get("NAME")`` or
    ``colon_dirs("NAME")`` with its name), a script's is named by a script."""
    read = set()
    for f in [*REPO.joinpath("bunshin_gym").rglob("*.py"), *REPO.joinpath("envs").rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("get", "colon_dirs") and str(node.args[0].value).startswith("BUNSHIN_"):
                    read.add(node.args[0].value)
    mentioned = _mentioned()
    names = [v.name for v in config.VARIABLES]
    assert len(names) == len(set(names)), "a variable is listed twice"
    assert {v.read_by for v in config.VARIABLES} <= {config.PACKAGE, config.INTERNAL, config.SCRIPTS, config.KMOD_VM}
    assert all(v.name.startswith("BUNSHIN_") and v.meaning for v in config.VARIABLES)
    for v in config.VARIABLES:
        if v.read_by in (config.PACKAGE, config.INTERNAL):
            assert v.name in read, f"{v.name} is listed as read by the package but nothing reads it via config"
        else:
            assert mentioned.get(v.name, set()) - {"bunshin_gym/config.py"}, f"{v.name}: no script names it"


def test_the_documentation_is_generated_from_the_list():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == config.markdown(), (
        "docs/configuration.md is out of date; regenerate: .venv/bin/python -c "
        "'import bunshin_gym.config as c; print(c.markdown(), end=\"\")' > docs/configuration.md")
    for v in config.VARIABLES:
        assert f"| `{v.name}` |" in doc


def test_an_unlisted_name_is_refused():
    with pytest.raises(KeyError, match="BUNSHIN_NOT_A_VARIABLE is not a listed variable"):
        config.get("BUNSHIN_NOT_A_VARIABLE")


def test_the_readers_follow_the_environment(monkeypatch):
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert config.max_snapshot_depth() == 8 and config.dump_tries() == 4 and config.criu_dump_verbosity() == 2
    assert not config.share_ksm() and not config.share_anon_forced_ksm() and config.uffd_delta()
    assert not config.kmod_double_copy() and config.colon_dirs("BUNSHIN_RECIPES") == []
    assert config.userns_base() == 1000000
    p = config.paths()
    assert (p.home, p.run, p.pool_file, p.pool_size) == (Path("/var/lib/bunshin"), Path("/run/bunshin"),
                                                         Path("/var/lib/bunshin/pool.img"), "60G")
    assert config.Limits.from_env() == config.Limits()

    monkeypatch.setenv("BUNSHIN_HOME", "/srv/b")
    monkeypatch.setenv("BUNSHIN_MAX_SNAPSHOT_DEPTH", "")  # empty: the default, as it always was
    assert config.max_snapshot_depth() == 8
    for name, value in [("BUNSHIN_MAX_SNAPSHOT_DEPTH", "3"), ("BUNSHIN_DUMP_TRIES", "0"),
                        ("BUNSHIN_CRIU_DUMP_VERBOSITY", "4"), ("BUNSHIN_SHARE_KSM", "1"), ("BUNSHIN_SHARE_ANON", "KSM"),
                        ("BUNSHIN_UFFD_DELTA", "0"), ("BUNSHIN_KMOD_DOUBLE", "copy"),
                        ("BUNSHIN_RECIPES", "/a::/b"), ("BUNSHIN_USERNS", "0"), ("BUNSHIN_WS_PIDS", "max")]:
        monkeypatch.setenv(name, value)
    assert config.max_snapshot_depth() == 3 and config.dump_tries() == 1 and config.criu_dump_verbosity() == 4
    assert config.share_ksm() and config.share_anon_forced_ksm() and not config.uffd_delta()
    assert config.kmod_double_copy() and config.colon_dirs("BUNSHIN_RECIPES") == ["/a", "/b"]
    assert config.userns_base() is None and config.Limits.from_env().pids == 0
    p = config.paths()
    assert (p.pool_file, p.pool, p.criu_prefix) == (Path("/srv/b/pool.img"), Path("/srv/b/pool"), Path("/srv/b/criu"))


def test_overridden_sets_listed_variables_for_a_block_and_puts_them_back(monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU_DUMP_VERBOSITY", "4")
    monkeypatch.delenv("BUNSHIN_BACKGROUND_DUMP", raising=False)
    with config.overridden({"BUNSHIN_CRIU_DUMP_VERBOSITY": None, "BUNSHIN_BACKGROUND_DUMP": "1"}):
        assert config.criu_dump_verbosity() == 2  # unset: the listed default
        assert config.get("BUNSHIN_BACKGROUND_DUMP") == "1"
    assert config.criu_dump_verbosity() == 4 and "BUNSHIN_BACKGROUND_DUMP" not in os.environ
    with pytest.raises(KeyError, match="not a listed variable"), config.overridden({"BUNSHIN_NO_SUCH": "1"}):
        pass
    with pytest.raises(RuntimeError), config.overridden({"BUNSHIN_CRIU_DUMP_VERBOSITY": "3"}):
        assert config.criu_dump_verbosity() == 3
        raise RuntimeError("the block failed")
    assert config.criu_dump_verbosity() == 4


def test_criu_overridden_sets_criu_variables_for_a_block_and_puts_them_back(monkeypatch):
    """What ``bench bgdump --fork-wait`` sets for its snapshots only (CRIU_BG_FORK_WAIT)."""
    name = "CRIU_BG_FORK_WAIT"
    monkeypatch.setenv(name, "0")
    with config.criu_overridden({name: "1"}):
        assert os.environ[name] == "1"
    assert os.environ[name] == "0"
    monkeypatch.delenv(name)
    with config.criu_overridden({name: "1"}):
        assert os.environ[name] == "1"
    assert name not in os.environ
    with pytest.raises(KeyError, match="not CRIU's variables"), config.criu_overridden({"BUNSHIN_HOME": "/x"}):
        pass
