"""Test doubles. ``FakeWorkspace`` stands in for a real workspace where a test checks the
gym layer's own logic (gymnasium's env checker, episode bookkeeping), never instead of the
real path: every env is also tested on real workspaces.

It executes nothing: a command's output is a deterministic function of the command and of
the fake's state (a history and a dict of files), and fork/snapshot/rollback copy that state.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from dataclasses import dataclass

from bunshin_gym.workspace.client import ExecResult

_ids = itertools.count()


@dataclass
class FakeSnapshot:
    id: str
    state: dict
    depth: int = 0

    def fork(self, n: int = 1, mode: str | None = None) -> list[FakeWorkspace]:
        return [FakeWorkspace(state=copy.deepcopy(self.state)) for _ in range(n)]

    def delete(self) -> None:
        pass

    def release(self) -> None:
        pass

    def keep(self, by: str | None = None) -> None:
        pass


class FakeWorkspace:
    def __init__(self, image: str = "base", memory_mode: str = "share", state: dict | None = None):
        self.id = f"fake-{next(_ids)}"
        self.image = image
        self.state = state or {"history": [], "files": {}}
        self.closed = False

    def exec(self, cmd, *, timeout=None, env=None, cwd=None, user=None, stdin=None, check=False) -> ExecResult:
        if self.closed:
            raise RuntimeError(f"{self.id} is closed")
        text = cmd if isinstance(cmd, str) else " ".join(cmd)
        self.state["history"].append(text)
        digest = hashlib.sha256(("\n".join(self.state["history"])).encode()).hexdigest()[:8]
        return ExecResult(0, f"{text[:40]} #{digest}\n".encode(), b"", False, 0.0)

    def spawn(self, cmd, **kwargs) -> int:
        self.exec(cmd)
        return 1000 + len(self.state["history"])

    def read_file(self, path: str) -> bytes:
        return self.state["files"][path]

    def write_file(self, path: str, data, **kwargs) -> None:
        self.state["files"][path] = data.encode() if isinstance(data, str) else data

    def snapshot(self, **kwargs) -> FakeSnapshot:
        return FakeSnapshot(f"fakesnap-{next(_ids)}", copy.deepcopy(self.state))

    def fork(self, n: int = 1, mode: str | None = None) -> list[FakeWorkspace]:
        return self.snapshot().fork(n)

    def rollback(self, snap: FakeSnapshot) -> None:
        self.state = copy.deepcopy(snap.state)

    def close(self) -> None:
        self.closed = True


def fake_factory(image: str, memory_mode: str) -> FakeWorkspace:
    return FakeWorkspace(image, memory_mode)
