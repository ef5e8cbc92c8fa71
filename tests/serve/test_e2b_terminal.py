"""The ``e2b`` SDK's PTY sessions and streamed stdin against ``bunshin serve``: a real
pseudo-terminal inside the workspace, typed into, resized, killed, with bounded output."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from e2b import AsyncSandbox, CommandExitException
from e2b.sandbox.commands.command_handle import PtySize

from bunshin_gym.serve import terminal


class Screen:
    """A PTY session's output, collected by a thread waiting on its handle."""

    def __init__(self, handle):
        self.handle, self.data, self.error, self.result = handle, bytearray(), None, None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        try:
            self.result = self.handle.wait(on_pty=self.data.extend)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def wait_for(self, text: bytes, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.data:
            assert time.monotonic() < deadline, f"{text!r} never appeared on the terminal: {bytes(self.data)[-2000:]!r}"
            assert self.thread.is_alive(), f"the session ended: {self.error!r}"
            time.sleep(0.05)

    def ended(self, timeout: float = 20):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the session did not end"
        return self.error


def test_pty_is_a_real_terminal_typed_into_resized_and_ended(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    screen = Screen(h)
    assert h.pid in [p.pid for p in sandbox.commands.list()]
    sandbox.pty.send_stdin(h.pid, b"tty; stty size; echo $TERM $((6 * 7)); whoami\n")
    screen.wait_for(b"24 80")
    screen.wait_for(b"xterm-256color 42")
    assert b"/dev/pts/" in screen.data and b"user" in screen.data
    assert b"\r\n" in screen.data, "the terminal translates newlines (a tty, not a pipe)"

    sandbox.pty.resize(h.pid, PtySize(rows=40, cols=132))
    sandbox.pty.send_stdin(h.pid, b"stty size\n")
    screen.wait_for(b"40 132")

    # the shell's own job control: ^C stops the foreground job, the shell goes on
    sandbox.pty.send_stdin(h.pid, b"sleep 100\n")
    time.sleep(0.5)
    sandbox.pty.send_stdin(h.pid, b"\x03echo after-$((3 * 3))-interrupt\n")
    screen.wait_for(b"after-9-interrupt")

    sandbox.pty.send_stdin(h.pid, b"exit 3\n")
    error = screen.ended()
    assert isinstance(error, CommandExitException) and error.exit_code == 3, error
    assert h.pid not in [p.pid for p in sandbox.commands.list()]
    with pytest.raises(Exception, match="already ended"):
        sandbox.pty.send_stdin(h.pid, b"too late\n")


def test_pty_kill_and_bounded_output(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    screen = Screen(h)
    kept = terminal.SEGMENT * terminal.SEGMENTS_KEPT
    # three times what the workspace keeps, then a marker: the client reads it all as it comes
    sandbox.pty.send_stdin(h.pid, f"head -c {3 * kept} /dev/zero | tr '\\0' x; echo; echo END-$((1+1))\n".encode())
    screen.wait_for(b"END-2", timeout=60)
    # all of it when the client kept up; on a loaded host it may fall behind, and then it
    # skips to the oldest segment kept: never less than the last segment or so
    got = screen.data.count(b"x")
    assert kept - 2 * terminal.SEGMENT <= got <= 3 * kept + 16, got  # (+ the x of the typed line)
    segments = sandbox.commands.run("cat /tmp/.bunshin-e2b/*/pty.* | wc -c; ls /tmp/.bunshin-e2b/*/ | grep -c pty",
                                    user="root").stdout.split()
    assert int(segments[0]) <= kept and int(segments[1]) <= terminal.SEGMENTS_KEPT, segments
    # a client that connects now gets what the workspace kept, from the oldest kept segment on
    again = Screen(sandbox.pty.connect(h.pid))
    again.wait_for(b"END-2", timeout=60)
    assert kept - terminal.SEGMENT <= len(again.data) <= kept, len(again.data)

    assert sandbox.pty.kill(h.pid) is True
    error = screen.ended()
    assert isinstance(error, CommandExitException) and error.exit_code != 0
    time.sleep(0.5)
    assert "bash -i -l" not in sandbox.commands.run("ps -eo args", user="root").stdout, "the shell was killed too"
    assert sandbox.pty.kill(h.pid) is False


def test_pty_is_carried_by_fork_and_pause(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    screen = Screen(h)
    sandbox.pty.send_stdin(h.pid, b"X=kept; cd /tmp; echo ready-$((1+1))\n")
    screen.wait_for(b"ready-2")
    forks = sandbox.fork(count=2)
    try:
        for i, f in enumerate(forks):
            copy = Screen(f.pty.connect(h.pid))
            f.pty.send_stdin(h.pid, f"echo $X-$PWD-fork-$(({i}+10))\n".encode())
            copy.wait_for(f"kept-/tmp-fork-{i + 10}".encode())  # the same shell, its variables and cwd
    finally:
        for f in forks:
            f.kill()
    sandbox.pause()
    sandbox.connect()
    resumed = Screen(sandbox.pty.connect(h.pid))
    sandbox.pty.send_stdin(h.pid, b"echo $X-resumed-$((2+2))\n")
    resumed.wait_for(b"kept-resumed-4")
    assert sandbox.pty.kill(h.pid) is True


def test_pty_bad_requests_are_clear_errors(sandbox):
    with pytest.raises(Exception, match="1 to 1000 rows and columns"):
        sandbox.pty.create(PtySize(rows=0, cols=80))
    h = sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(Exception, match="has no terminal"):
        sandbox.pty.resize(h.pid, PtySize(rows=10, cols=10))
    with pytest.raises(Exception, match="has no terminal"):
        sandbox.pty.send_stdin(h.pid, b"x")
    assert sandbox.commands.kill(h.pid) is True


def test_stream_input_feeds_stdin_in_order(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(h.pid, ["one\n", b"two\n", "three\n"])
    sandbox.commands.stream_input(h.pid, (f"{i}\n" for i in range(3)))
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "one\ntwo\nthree\n0\n1\n2\n"


def test_async_pty_on_data(server, opts):
    async def main() -> bytes:
        sb = await AsyncSandbox.create("base", **opts)
        try:
            seen = bytearray()
            h = await sb.pty.create(PtySize(rows=30, cols=90), on_data=seen.extend, timeout=0)
            await sb.pty.send_stdin(h.pid, b"stty size; echo async-$((2+3))\n")
            deadline = time.monotonic() + 20
            while b"async-5" not in seen:
                assert time.monotonic() < deadline, bytes(seen)
                await asyncio.sleep(0.05)
            await sb.pty.send_stdin(h.pid, b"exit\n")
            result = await h.wait()
            assert result.exit_code == 0
            return bytes(seen)
        finally:
            await sb.kill()

    seen = asyncio.run(main())
    assert b"30 90" in seen


def test_command_output_past_the_agent_read_cap_streams_in_bounded_chunks(sandbox):
    from bunshin_gym.serve import sandbox as serve_sandbox

    size = 80 << 20  # over the agent's 64 MiB cap on one read: read a range at a time
    chunks: list[int] = []
    r = sandbox.commands.run(f"head -c {size} /dev/zero | tr '\\0' y; echo; echo done >&2", timeout=0,
                             on_stdout=lambda s: chunks.append(len(s)))
    assert len(r.stdout) == size + 1 and r.stdout.count("y") == size and r.stderr == "done\n"
    assert max(chunks) <= serve_sandbox.OUTPUT_CHUNK, "no event is over the chunk size"
