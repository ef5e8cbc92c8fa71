"""Lifecycle: a client that disappears leaves nothing behind (killed with SIGKILL, its
sandbox and env are reaped once idle); a live RemoteEnv keeps its env alive; a restarted
server reattaches running and paused sandboxes and named snapshots, and reclaims the
workspaces of envs it cannot reattach."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

from e2b import Sandbox

from bunshin_gym.remote import RemoteEnv
from bunshin_gym.workspace import records
from bunshin_gym.workspace.snapshot import SnapshotStore
from bunshin_gym.workspace.workspace import reclaim

from .conftest import ALICE, Server, e2b_opts, leases

CLIENT = textwrap.dedent("""
    import json, sys, time
    from e2b import Sandbox
    from bunshin_gym.remote import RemoteEnv
    url, token = sys.argv[1], sys.argv[2]
    sb = Sandbox.create("base", api_url=url, sandbox_url=url, api_key=token)
    sb.commands.run("sleep 600", background=True, timeout=0)
    env = RemoteEnv("Bunshin-Shell-v0", url, token=token, task="shell/count-files")
    env.reset()
    print(json.dumps({"sandbox": sb.sandbox_id, "env": env.remote_id}), flush=True)
    time.sleep(3600)
""")


def _running(ids: set[str]) -> set[str]:
    return {r.id for r in records.all_records() if r.id in ids and r.running()}


def _server_workspaces(server: Server) -> set[str]:
    return {r.id for r in records.all_records() if r.running() and r.owner in (None, server.proc.pid)}


def test_killed_client_is_reaped_and_a_live_one_is_kept(tmp_path):
    server = Server(tmp_path, "--idle-timeout", "8", "--close-on-exit")
    try:
        before = _server_workspaces(server)
        client = subprocess.Popen([sys.executable, "-c", CLIENT, server.url, ALICE], stdout=subprocess.PIPE, text=True)
        try:
            held = json.loads(client.stdout.readline())
            theirs = _server_workspaces(server) - before
            assert len(theirs) == 2  # the client's sandbox and env
        finally:
            client.send_signal(signal.SIGKILL)  # no goodbye: the server must notice on its own
            client.wait()
            client.stdout.close()
        live = RemoteEnv("Bunshin-Shell-v0", server.url, token=ALICE, task="shell/count-files")
        try:
            live.reset()
            deadline = time.monotonic() + 90
            while {held["sandbox"], held["env"]} & {x.get("sandboxID", x.get("id")) for x in leases(server)}:
                assert time.monotonic() < deadline, f"not reaped: {leases(server)}\n{server.log[-2000:]}"
                time.sleep(0.5)
            # a lease leaves the list when its close begins; its workspaces are gone once it ends
            while _running(theirs):
                assert time.monotonic() < deadline, f"the reaped workspaces {_running(theirs)} still run"
                time.sleep(0.2)
            time.sleep(1)  # the live env is kept alive by its keepalives, past the idle timeout by now
            assert [x["id"] for x in leases(server)] == [live.remote_id]
            assert live.step("echo still here")[0]["output"] == "still here\n"
            assert len(_server_workspaces(server) - before) == 1
            assert "reaping" in server.log and "idle for" in server.log
        finally:
            live.close()
        assert _server_workspaces(server) - before == set()
    finally:
        server.stop()


def test_restart_reattaches_sandboxes_and_snapshots_and_reaps_env_workspaces(tmp_path):
    state = tmp_path / "state"
    first = Server(tmp_path, state_dir=state)  # keeps its sandboxes when it stops
    opts = e2b_opts(first)
    running = Sandbox.create("base", **opts)
    paused = Sandbox.create("base", **opts)
    try:
        running.commands.run("echo kept > /tmp/mark; sleep 600 >/dev/null 2>&1 &", user="root")
        paused.files.write("/tmp/mark", "paused")
        paused.pause()
        running.create_snapshot(name="golden")
        env = RemoteEnv("Bunshin-Shell-v0", first.url, token=ALICE, task="shell/count-files")
        env.reset()
        env_workspaces = {r.id for r in records.all_records() if r.owner == first.proc.pid and r.running()}
        assert env_workspaces
        env_snapshots = {s.id for s in SnapshotStore().list() if (s.metadata.holder or [None])[0] == first.proc.pid}
        assert env_snapshots  # the env's boot and reset snapshots, held by the server that took them
        first.proc.kill()  # a crash: no shutdown at all
        first.proc.wait()
        first.stop()

        second = Server(tmp_path, "--close-on-exit", state_dir=state, port=first.port)
        try:
            assert "reattached" in second.log
            assert _running(env_workspaces) == set(), "the dead server's env workspaces were reclaimed"
            left = {s.id for s in SnapshotStore().list() if s.id in env_snapshots and not s.metadata.ephemeral}
            assert left == set(), f"the dead server's env snapshots were not released: {left}"
            opts = e2b_opts(second)
            ids = {s.sandbox_id: s.state.value for s in Sandbox.list(**opts).next_items()}
            assert ids == {running.sandbox_id: "running", paused.sandbox_id: "paused"}
            again = Sandbox.connect(running.sandbox_id, **opts)
            assert again.files.read("/tmp/mark") == "kept\n"
            assert "sleep 600" in again.commands.run("ps -eo args", user="root").stdout
            resumed = Sandbox.connect(paused.sandbox_id, **opts)
            assert resumed.files.read("/tmp/mark") == "paused"
            from_golden = Sandbox.create("golden", **opts)
            assert from_golden.files.read("/tmp/mark") == "kept\n"
            for sb in (again, resumed, from_golden):
                sb.kill()
            assert Sandbox.delete_snapshot("golden", **opts)
            assert leases(second) == []
        finally:
            second.stop()
    finally:
        # a failed run must not leave detached workspaces: reclaim those the servers named
        named = set(re.findall(r"workspace (ws-[0-9a-f]{8})", "".join(p.read_text() for p in tmp_path.glob("*.log"))))
        for rec in records.all_records():
            if rec.id in named and rec.running():
                reclaim(rec)
