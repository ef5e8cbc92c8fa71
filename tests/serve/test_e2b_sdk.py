"""The unmodified ``e2b`` SDK from PyPI against ``bunshin serve``: sandboxes are real bunshin
workspaces; commands, files, listing, timeouts, kill and fork through the SDK's own calls."""

from __future__ import annotations

import time

import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    TimeoutException,
)

from .conftest import BOB, e2b_opts, leases, workspace_ids_of_server


def test_create_run_files_list_kill(server, opts):
    before = workspace_ids_of_server(server)
    sb = Sandbox.create("base", metadata={"run": "t1"}, envs={"GREETING": "hi"}, **opts)
    new = workspace_ids_of_server(server) - before
    assert len(new) == 1, "a sandbox is one bunshin workspace"

    r = sb.commands.run('echo "$GREETING from $(whoami) in $(pwd)"; echo oops >&2; exit 0')
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hi from user in /home/user\n", "oops\n")

    sb.files.write("notes/a.txt", "alpha")  # relative: the user's home; parents made
    assert sb.files.read("/home/user/notes/a.txt") == "alpha"
    assert sb.files.read("notes/a.txt", format="bytes") == bytearray(b"alpha")
    infos = sb.files.write_files([{"path": "/tmp/b.bin", "data": b"\x00\x01\xff"},
                                  {"path": "/tmp/c.txt", "data": "gamma"}])
    assert sorted(i.path for i in infos) == ["/tmp/b.bin", "/tmp/c.txt"]
    assert sb.commands.run("od -An -tx1 /tmp/b.bin").stdout.split() == ["00", "01", "ff"]
    listed = {e.name: e for e in sb.files.list("/home/user/notes")}
    assert listed["a.txt"].size == 5 and listed["a.txt"].owner == "user"
    assert sb.files.exists("/tmp/c.txt") and not sb.files.exists("/tmp/nope")
    assert sb.files.make_dir("/tmp/d1/d2") is True and sb.files.make_dir("/tmp/d1/d2") is False
    moved = sb.files.rename("/tmp/c.txt", "/tmp/d1/c2.txt")
    assert moved.path == "/tmp/d1/c2.txt" and sb.files.read("/tmp/d1/c2.txt") == "gamma"
    assert sb.files.get_info("/tmp/d1").type.value == "dir"
    sb.files.remove("/tmp/d1")
    assert not sb.files.exists("/tmp/d1/c2.txt")
    with pytest.raises(FileNotFoundException):
        sb.files.read("/tmp/missing.txt")

    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id and info.metadata == {"run": "t1"} and info.state.value == "running"
    ids = [s.sandbox_id for s in Sandbox.list(**opts).next_items()]
    assert sb.sandbox_id in ids
    assert sb.is_running()

    assert sb.kill() is True
    assert workspace_ids_of_server(server) & new == set(), "kill reclaims the workspace"
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**opts).next_items()]
    assert Sandbox.kill(sb.sandbox_id, **opts) is False  # gone: the SDK's 404


def test_command_exit_code_env_cwd_user_and_timeout(sandbox):
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; exit 7")
    assert e.value.exit_code == 7 and e.value.stdout == "partial\n"

    r = sandbox.commands.run("echo $A-$B; pwd; id -u", envs={"A": "1", "B": "two"}, cwd="/tmp", user="root")
    assert r.stdout == "1-two\n/tmp\n0\n"

    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - t0 < 15
    # the timed-out command was killed, not left running
    time.sleep(1)
    assert "sleep 30" not in sandbox.commands.run("ps -eo args", user="root").stdout


def test_background_streaming_connect_list_kill_and_stdin(sandbox):
    seen: list[str] = []
    h = sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.4; done", background=True)
    result = h.wait(on_stdout=seen.append)
    assert result.stdout == "line1\nline2\nline3\n"
    assert len(seen) >= 2, f"output arrived as it was printed, not at the end: {seen}"

    h = sandbox.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sandbox.commands.list()]
    h.disconnect()
    again = sandbox.commands.connect(h.pid)
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert h.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(h.pid) is False

    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "fed through stdin\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "fed through stdin\n"


def test_fork_copies_state_and_each_copy_is_independent(server, sandbox, opts):
    sandbox.commands.run("echo base > /tmp/state; python3 -c 'import time; time.sleep(600)' &", user="root")
    sandbox.commands.run("sleep 300", background=True)  # a live process, forked too
    before = workspace_ids_of_server(server)
    forks = sandbox.fork(count=3)
    try:
        assert all(isinstance(f, Sandbox) for f in forks), forks
        assert len(workspace_ids_of_server(server) - before) == 3
        for i, f in enumerate(forks):
            assert f.sandbox_id != sandbox.sandbox_id
            assert f.files.read("/tmp/state") == "base\n"
            assert "sleep 600" in f.commands.run("ps -eo args", user="root").stdout.replace("time.sleep(600)",
                                                                                              "sleep 600")
            f.files.write("/tmp/state", f"fork{i}\n")
        assert [f.files.read("/tmp/state") for f in forks] == ["fork0\n", "fork1\n", "fork2\n"]
        assert sandbox.files.read("/tmp/state") == "base\n"
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()
    assert workspace_ids_of_server(server) - before == set()


def test_named_snapshot_is_a_template(sandbox, opts):
    sandbox.files.write("/tmp/mark", "snapped")
    info = sandbox.create_snapshot(name="marked")
    assert info.snapshot_id == "marked"
    sandbox.files.write("/tmp/mark", "changed later")
    a = Sandbox.create("marked", **opts)
    b = Sandbox.create("marked", **opts)
    try:
        assert a.files.read("/tmp/mark") == b.files.read("/tmp/mark") == "snapped"
    finally:
        a.kill()
        b.kill()
    assert "marked" in [s.snapshot_id for s in Sandbox.list_snapshots(**opts).next_items()]
    assert Sandbox.delete_snapshot("marked", **opts) is True
    with pytest.raises(SandboxException, match="404: unknown template 'marked'"):
        Sandbox.create("marked", **opts)


def test_pause_resume_keeps_memory(server, sandbox, opts):
    sandbox.commands.run("python3 -c 'import time; x=bytearray(b\"m\"*50_000_000); time.sleep(9999)' >/dev/null &"
                         " echo $! > /tmp/pid", user="root")
    pid = sandbox.files.read("/tmp/pid").strip()
    before = workspace_ids_of_server(server)
    assert sandbox.pause() is True
    assert workspace_ids_of_server(server) < before or not (workspace_ids_of_server(server) & before), \
        "a paused sandbox holds no workspace"
    assert Sandbox.list(**opts).next_items()[0].state.value == "paused"
    with pytest.raises(SandboxException):
        sandbox.commands.run("true")
    with pytest.raises(SandboxException):  # not "already exists": the sandbox is paused
        sandbox.files.make_dir("/tmp/new-dir")
    sandbox.connect()
    assert sandbox.files.make_dir("/tmp/new-dir") is True
    # the same process, memory and all, runs again
    assert sandbox.commands.run(f"cat /proc/{pid}/cmdline | tr '\\0' ' '", user="root").stdout.startswith("python3")
    assert sandbox.get_info().state.value == "running"


def test_set_timeout_and_expiry(server, opts):
    sb = Sandbox.create("base", timeout=3, **opts)
    sb.set_timeout(60)
    time.sleep(4)
    assert sb.is_running(), "set_timeout extended it"
    sb.set_timeout(1)
    deadline = time.monotonic() + 20
    while sb.sandbox_id in [s.sandbox_id for s in Sandbox.list(**opts).next_items()]:
        assert time.monotonic() < deadline, "the reaper did not kill an expired sandbox"
        time.sleep(0.5)
    assert not sb.is_running()


def test_errors_are_clear_statuses(server, opts):
    with pytest.raises(SandboxException, match="404: unknown template 'no-such-image'"):
        Sandbox.create("no-such-image", **opts)
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", **{**opts, "api_key": "wrong-key-0000000"})
    bob = Sandbox.create("base", **e2b_opts(server, BOB))
    try:
        with pytest.raises(RateLimitException, match="quota exceeded"):
            Sandbox.create("base", **e2b_opts(server, BOB))
        with pytest.raises(NotFoundException):  # alice cannot see or kill bob's sandbox
            Sandbox.connect(bob.sandbox_id, **opts)
        assert Sandbox.kill(bob.sandbox_id, **opts) is False
    finally:
        bob.kill()
    assert leases(server, BOB) == []
    with server.client() as c:
        for method, path, body in [("POST", "/v2/sandboxes", b"{not json"), ("POST", "/v2/sandboxes", b"[1]"),
                                   ("POST", "/v2/sandboxes", b'{"templateID": 5}'),
                                   ("POST", "/v2/sandboxes", b'{"timeout": -4}'),
                                   ("POST", "/sandboxes/nope/fork", b'{"count": 1}'),
                                   ("DELETE", "/sandboxes/nope", b""),
                                   ("POST", "/process.Process/List", b"{}"),
                                   ("POST", "/filesystem.Filesystem/Stat", b'{"path": "/"}')]:
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert r.text  # a message, not an empty answer
        assert c.get("/health").status_code == 204  # still serving


def test_timeout_pauses_when_asked(server, opts):
    sb = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "pause"}, **opts)
    try:
        sb.files.write("/tmp/kept", "yes")
        deadline = time.monotonic() + 30
        while Sandbox.list(**opts).next_items()[0].state.value != "paused":
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(0.5)
        sb.connect()
        assert sb.files.read("/tmp/kept") == "yes"
    finally:
        sb.kill()


def test_async_sdk(server, opts):
    import asyncio

    from e2b import AsyncSandbox

    async def main() -> tuple[str, str, int]:
        sb = await AsyncSandbox.create("base", **opts)
        try:
            r = await sb.commands.run("echo async; echo e >&2")
            await sb.files.write("/tmp/a.txt", "from async")
            forks = await sb.fork(count=2)
            try:
                texts = [await f.files.read("/tmp/a.txt") for f in forks]
            finally:
                for f in forks:
                    await f.kill()
            return r.stdout, "".join(texts), len(forks)
        finally:
            await sb.kill()

    assert asyncio.run(main()) == ("async\n", "from asyncfrom async", 2)


HOLD_VSOCK = ("import socket, time\n"
              "s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n"
              "open('/tmp/held', 'w').write('yes')\n"
              "time.sleep(3600)\n")


def test_a_fork_criu_cannot_make_fails_with_criu_s_line_and_the_sandbox_goes_on(server, sandbox, opts):
    sandbox.files.write("/tmp/hold.py", HOLD_VSOCK)
    sandbox.commands.run("python3 /tmp/hold.py", background=True, timeout=0)  # a descriptor CRIU cannot dump
    deadline = time.monotonic() + 20
    while not sandbox.files.exists("/tmp/held"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = workspace_ids_of_server(server)
    with pytest.raises(SandboxException, match=r"500: .*CRIU dump of workspace ws-\w+ failed .*log: "):
        sandbox.fork(count=2)
    with pytest.raises(SandboxException, match="CRIU dump"):
        sandbox.pause()
    assert workspace_ids_of_server(server) == before, "no half-made copy is left"
    assert sandbox.commands.run("echo alive").stdout == "alive\n"  # the source runs on, thawed
    assert sandbox.get_info().state.value == "running"
