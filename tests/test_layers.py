"""The package's layers import one way (docs/design.md): each module imports only from its own
layer and the ones below it, the programs that run inside a workspace import nothing of the
package, and the env families take the wire protocol from the package. Every import counts,
deferred ones inside functions too. Units: reads the source, no workspace."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: layer -> the layers it may import (besides itself), bottom up as in docs/design.md
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "kmod_share": {"errors", "config"},
    "workspace": {"errors", "config", "kmod_share"},
    "testing": {"errors", "config", "workspace"},
    "core": {"errors", "config", "workspace"},
    "envs": {"errors", "config", "workspace", "core"},
}
#: programs that run inside a workspace, with the workspace's python: no bunshin_gym there
IN_WORKSPACE = ["bunshin_gym/workspace/agent.py", "envs/webarena/driver.py", "envs/webarena/urlguard.py",
                "envs/webarena/shop", "envs/osworld/runtime", "envs/osworld/assets"]
#: the one module used on both sides: it may take its error base from bunshin_gym.errors
#: where that is importable (and defines its own where it is not)
BOTH_SIDES = "bunshin_gym/workspace/protocol.py"


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "envs":
        parts = ["bunshin_gym", *parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package root: importing it runs registration (the top layer)
    if parts[1] == "envs":
        return "envs"
    return parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every bunshin_gym import in the file, deferred ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("bunshin_gym")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bunshin_gym"):
            if node.module == "bunshin_gym":  # from bunshin_gym import config: the submodules named
                out += [(node.lineno, f"bunshin_gym.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def _files() -> list[Path]:
    return sorted([*REPO.joinpath("bunshin_gym").rglob("*.py"), *REPO.joinpath("envs").rglob("*.py")])


def _in_workspace(path: Path) -> bool:
    rel = path.relative_to(REPO).as_posix()
    return any(rel == p or rel.startswith(p + "/") for p in IN_WORKSPACE)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in _files():
        if _in_workspace(path):
            continue
        rel = path.relative_to(REPO).as_posix()
        layer = _layer(_module(path))
        if layer not in ALLOWED:
            continue  # the upper layers (rollout, train, bench, serve, cli, ...) may import any below
        # a benchmark of an env family (envs/*/bench.py) belongs to the bench layer
        if layer == "envs" and path.name == "bench.py":
            continue
        for line, target in _imports(path):
            to = _layer(target)
            if to == layer:
                continue
            if rel == BOTH_SIDES and target == "bunshin_gym.errors":
                continue
            if to not in ALLOWED[layer]:
                wrong.append(f"{rel}:{line} ({layer}) imports {target} ({to})")
    assert not wrong, "imports against the layers of docs/design.md:\n" + "\n".join(wrong)


def test_programs_inside_a_workspace_import_nothing_of_the_package():
    wrong = [f"{p.relative_to(REPO)}:{line} imports {target}"
             for p in _files() if _in_workspace(p) for line, target in _imports(p)]
    assert not wrong, wrong
    # the shipped protocol: only its guarded error base
    protocol = REPO / BOTH_SIDES
    assert [t for _, t in _imports(protocol)] == ["bunshin_gym.errors"]
    tree = ast.parse(protocol.read_text())
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.Try)
               and any(isinstance(s, ast.ImportFrom) and s.module == "bunshin_gym.errors" for s in n.body)]
    assert guarded and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in guarded[0].handlers)


def test_env_families_take_the_framing_from_the_package():
    """Not from a copy or from a script that runs inside the workspace: the controller side of
    every env imports bunshin_gym.workspace.protocol (or the client built on it), and the
    in-workspace servers import the shipped /.bunshin/protocol.py."""
    for path in _files():
        if "envs" not in path.relative_to(REPO).parts or _in_workspace(path):
            continue
        for line, target in _imports(path):
            assert not target.startswith("bunshin_gym.workspace.agent"), f"{path}:{line}"
        text = path.read_text()
        assert "def recv_msg" not in text and "def send_msg" not in text, f"{path} frames messages itself"
    for server in (REPO / "envs/osworld/runtime/desktop_server.py", REPO / "envs/webarena/driver.py"):
        text = server.read_text()
        assert "from protocol import serve_unix" in text and '"/.bunshin"' in text, server


def test_the_library_layers_report_through_logging_not_print():
    """print() is for the front ends' user-facing output (the CLI, benchmark tables, the
    training job's progress) and for programs inside a workspace (their log is stderr);
    everything else logs, so that an application decides what it shows."""
    library = {*ALLOWED, "rollout", "registration"}
    wrong = []
    for path in _files():
        # an env family's benchmark and its task generator (a script run by hand) are front ends;
        # the protocol's server loop runs inside a workspace, where its stderr line is the log
        if (_in_workspace(path) or path.name in ("bench.py", "make_tasks.py")
                or path.relative_to(REPO).as_posix() == BOTH_SIDES or _layer(_module(path)) not in library):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Name) and f.id == "print") or (
                    isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute)
                    and f.value.attr in ("stdout", "stderr")):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not wrong, "use logging: " + ", ".join(wrong)


#: the layers inside the workspace runtime, bottom up (docs/design.md, "Inside the workspace
#: runtime"): each module of ``bunshin_gym/workspace/`` (a sub-package counts as one) and the
#: layer it is in. A module imports only from its own layer and the ones below it.
WORKSPACE_LAYERS = [
    ["errors", "buildonce"],  # standard library only
    ["records"],
    ["cgroups"],
    ["pool", "idmap", "hostlimits"],
    ["runtime"],
    ["protocol", "inroot", "client"],
    ["memory", "uffd", "kmod", "memstat"],  # the memory backends and the mechanisms they drive
    ["snapshots"],  # the store: metadata, lineage, CRIU images, deltas, flattening, /.snap views
    ["teardown"],
    ["forking", "dumping", "spares", "fanout"],
    ["images", "pristine"],
    ["workspace", "snapshot"],  # the Workspace and Snapshot handles
    ["gc"],
    ["__init__"],  # the package's exports
]
WORKSPACE = REPO / "bunshin_gym" / "workspace"


def _workspace_module(path: Path) -> str:
    """``snapshots.store`` for bunshin_gym/workspace/snapshots/store.py, ``snapshots`` for its
    __init__.py, ``__init__`` for the package's."""
    parts = list(path.relative_to(WORKSPACE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _workspace_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module inside bunshin_gym/workspace) of every import of one, deferred and
    type-checking ones included: ``from bunshin_gym.workspace.snapshots import store`` names
    ``snapshots.store``; ``from bunshin_gym.workspace import Workspace`` the package itself."""
    def is_module(sub: str) -> bool:
        where = WORKSPACE.joinpath(*sub.split("."))
        return where.with_suffix(".py").exists() or (where / "__init__.py").exists()

    pkg, out = "bunshin_gym.workspace", []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix(pkg).lstrip(".") or "__init__")
                    for a in node.names if a.name == pkg or a.name.startswith(pkg + ".")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == pkg or node.module.startswith(pkg + ".")):
            base = node.module.removeprefix(pkg).lstrip(".")
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                out.append((node.lineno, sub if is_module(sub) else base or "__init__"))
    return out


def _workspace_files() -> list[Path]:
    return sorted(p for p in WORKSPACE.rglob("*.py") if not _in_workspace(p))


def _rank(module: str) -> int | None:
    top = module.split(".")[0]
    return next((i for i, layer in enumerate(WORKSPACE_LAYERS) if top in layer), None)


def test_every_workspace_module_has_a_layer():
    unplaced = sorted({_workspace_module(p).split(".")[0] for p in _workspace_files()
                       if _rank(_workspace_module(p)) is None})
    assert not unplaced, f"place these in WORKSPACE_LAYERS (and docs/design.md): {unplaced}"


def test_the_workspace_runtime_imports_one_way():
    """Inside bunshin_gym/workspace/: every import (deferred ones too) points to the module's
    own layer or one below it, and no modules import each other in a circle, inside a layer
    either: no import is deferred into a function to dodge a cycle."""
    wrong, edges = [], {}
    for path in _workspace_files():
        me = _workspace_module(path)
        edges[me] = set()
        for line, target in _workspace_imports(path):
            if None not in (_rank(target), _rank(me)) and _rank(target) > _rank(me):
                wrong.append(f"{path.relative_to(REPO)}:{line} ({WORKSPACE_LAYERS[_rank(me)][0]} layer) imports "
                             f"{target} ({WORKSPACE_LAYERS[_rank(target)][0]} layer, above)")
            if target != me:
                edges[me].add(target)
    assert not wrong, "imports against the workspace runtime's layers:\n" + "\n".join(wrong)

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return [*trail, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = {" -> ".join(c) for m in edges if (c := cycle_from(m))}
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(sorted(cycles))
