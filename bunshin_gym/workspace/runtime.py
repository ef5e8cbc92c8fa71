"""The runtime layer: bunshin's own files inside every workspace.

A small directory laid as the top overlay lower layer of every workspace, so images need
no rebuild when the agent changes: ``/.bunshin/init`` (PID 1 and launcher, compiled from
``native/bunshin-init.c``), ``/.bunshin/agent.py`` with its framing ``/.bunshin/protocol.py``,
and the ``/.snap`` mount point. It is
keyed by the hash of its sources and built once.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from bunshin_gym.config import Paths, paths
from bunshin_gym.workspace import buildonce
from bunshin_gym.workspace.errors import SetupError

HERE = Path(__file__).parent
SOURCES = [HERE / "native" / "bunshin-init.c", HERE / "agent.py", HERE / "protocol.py"]
#: the Python files copied into ``/.bunshin`` (the agent imports protocol.py from there, and
#: so do the env daemons: the desktop input server and the browser driver)
SCRIPTS = SOURCES[1:]
CFLAGS = ["-static", "-O2", "-Wall"]


def _key() -> str:
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for src in SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def ensure_runtime(p: Paths | None = None) -> Path:
    """Return the runtime layer directory, building it first if its sources changed."""
    p = p or paths()
    layer = p.runtime / _key()
    if (layer / ".bunshin" / "init").exists():
        return layer
    if shutil.which("gcc") is None:
        raise SetupError("gcc is missing (needed to build the workspace init); run: scripts/setup.sh")

    def build(target: Path) -> None:
        (target / ".bunshin").mkdir(parents=True)
        (target / ".snap").mkdir()
        proc = subprocess.run(
            ["gcc", *CFLAGS, "-o", str(target / ".bunshin" / "init"), str(SOURCES[0])], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SetupError(f"compiling {SOURCES[0]} failed:\n{proc.stderr}")
        for script in SCRIPTS:
            shutil.copy(script, target / ".bunshin" / script.name)

    return buildonce.build_once(layer, build)


def launcher(p: Paths | None = None) -> Path:
    """The host path of the launcher binary (the same file is /.bunshin/init inside)."""
    return ensure_runtime(p) / ".bunshin" / "init"
