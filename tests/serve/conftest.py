"""A real ``bunshin serve`` (a subprocess on a free loopback port, real workspaces) and the
real ``e2b`` SDK pointed at it through its documented settings (``api_url``,
``sandbox_url``, ``api_key``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bunshin_gym.remote import RemoteError, wait_for_server

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"  # a quota of one workspace


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process; ``url``, ``log`` (its output so far), ``stop()``."""

    def __init__(self, tmp: Path, *extra: str, state_dir: Path | None = None, port: int | None = None):
        self.tmp = tmp
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = state_dir or tmp / "state"
        tokens = tmp / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [
            {"token": ALICE, "name": "alice"},
            {"token": BOB, "name": "bob", "max_workspaces": 1}]}))
        self.log_path = tmp / f"server-{self.port}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bunshin_gym.serve", "--port", str(self.port), "--token-file", str(tokens),
             "--state-dir", str(self.state_dir), "--log-level", "info", *extra],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_for_server(self.url, self.proc)
        except RemoteError as e:
            raise RuntimeError(f"{e}: {self.log}") from None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, token: str = ALICE) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": token}, timeout=120)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def e2b_opts(server: Server, token: str = ALICE) -> dict:
    """The SDK's documented connection settings, per call (E2B_API_URL, E2B_SANDBOX_URL and
    E2B_API_KEY would do the same from the environment)."""
    return {"api_url": server.url, "sandbox_url": server.url, "api_key": token}


def leases(server: Server, token: str = ALICE) -> list:
    with server.client(token) as c:
        return c.get("/v2/sandboxes").json() + c.get("/envs").json()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"), "--close-on-exit")
    yield srv
    srv.stop()
    # the owners' prefix caches outlive the server by design (its state directory keeps them
    # for its next start); this server has none: their snapshots go with them
    from bunshin_gym.rollout import PrefixCache

    for cache_dir in sorted((srv.state_dir / "prefix-cache").glob("*")):
        PrefixCache(cache_dir).clear()
    # uvicorn re-raises the SIGTERM it handled once shut down
    assert srv.proc.returncode in (0, -15) and "Application shutdown complete" in srv.log, srv.log[-3000:]


@pytest.fixture
def opts(server):
    """e2b connection settings for alice; the test must leave no sandbox or env behind."""
    yield e2b_opts(server)
    left = leases(server)
    with server.client() as c:
        for lease in left:  # close them so one failure does not cascade, then fail
            c.delete(f"/sandboxes/{lease['sandboxID']}" if "sandboxID" in lease else f"/envs/{lease['id']}")
    assert not left, f"the test left {left}"


@pytest.fixture
def sandbox(opts):
    """A sandbox of the base image, made through the e2b SDK and killed after the test."""
    from e2b import Sandbox

    sb = Sandbox.create("base", **opts)
    yield sb
    sb.kill()


def workspace_ids_of_server(server: Server) -> set[str]:
    """Ids of the live workspaces the server created (detached sandboxes and its envs')."""
    from bunshin_gym.workspace import records

    return {r.id for r in records.all_records() if r.running() and (r.owner in (None, server.proc.pid))}


os.environ.setdefault("E2B_HTTP_VERSION", "1.1")  # uvicorn speaks HTTP/1.1 (the SDK negotiates it anyway)
