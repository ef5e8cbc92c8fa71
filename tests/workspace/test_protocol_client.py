"""The one client of the servers inside a workspace (protocol.Client, and WorkspaceClient
reaching a socket through a workspace's root): the reconnect policy, deadlines, size caps,
and how the socket is reached. Units against a server thread on a socket in tmp_path: no
workspace, no root (the same clients against real workspaces: tests/envs/test_bad_input.py,
tests/security/)."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from bunshin_gym.errors import ChannelError
from bunshin_gym.workspace.client import WorkspaceClient
from bunshin_gym.workspace.inroot import RootedPath
from bunshin_gym.workspace.protocol import Client, ProtocolError, connect_path, recv_msg, send_msg


class Server:
    """A unix-socket server thread: answers ``ping`` and ``act`` with the op and the number
    of its connection, notes every request in ``seen``; ``close_after_reply`` drops each
    connection after one reply (what a client sees when the server restarted between two
    requests). Special ops: ``drip`` (a reply one byte every 0.2 s), ``huge`` (a reply
    announcing 8 MiB of blobs, none of them sent), ``hang`` (no reply)."""

    def __init__(self, path: Path, close_after_reply: bool = False):
        self.path = path
        self.close_after_reply = close_after_reply
        self.seen: list[str] = []
        self.connections = 0
        self.closed = threading.Event()  # set when a client closes its connection
        self._stopping = threading.Event()
        self._conns: list[socket.socket] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(path))
        self._srv.listen(8)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            self._threads.append(threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True))
            self._threads[-1].start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            self._converse(conn, number)
        self.closed.set()  # the client went (or the server dropped it): the test's cue

    def _converse(self, conn: socket.socket, number: int) -> None:
        while True:
            try:
                req, _ = recv_msg(conn)
            except (ProtocolError, OSError):
                return
            op = req.get("op")
            self.seen.append(op)
            try:
                if op == "drip":
                    raw = json.dumps({"op": op, "_blobs": []}).encode()
                    for byte in struct.pack("!I", len(raw)) + raw:
                        conn.sendall(bytes([byte]))
                        time.sleep(0.2)
                elif op == "huge":
                    raw = json.dumps({"op": op, "_blobs": [8 << 20]}).encode()
                    conn.sendall(struct.pack("!I", len(raw)) + raw)
                    self._stopping.wait(30)  # the blob never comes: a client that waited for it times out
                elif op == "hang":
                    self._stopping.wait(30)
                else:
                    size = req.get("size", 0)
                    send_msg(conn, {"op": op, "connection": number}, [b"x" * size] if size else [])
            except OSError:  # the client went before the whole reply was sent
                return
            if self.close_after_reply:
                return

    def stop(self) -> None:
        self._stopping.set()
        self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self._srv.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(10)
            assert not thread.is_alive(), "a server thread outlived its test"


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "srv.sock")
    yield s
    s.stop()


@pytest.fixture
def restarting(tmp_path):
    s = Server(tmp_path / "srv.sock", close_after_reply=True)
    yield s
    s.stop()


def _client(path: Path, **kw) -> Client:
    kw.setdefault("error", ChannelError)
    return Client(lambda: connect_path(str(path), timeout=5), name="test server", **kw)


def test_a_request_gets_its_reply_and_blobs_on_one_lazy_connection(server):
    client = _client(server.path)
    assert not client.connected and server.connections == 0  # lazy: nothing opened yet
    for _ in range(3):
        reply, blobs = client.request({"op": "act", "size": 5})
        assert reply == {"op": "act", "connection": 1} and blobs == [b"xxxxx"]
    assert client.request({"op": "ping"}) == ({"op": "ping", "connection": 1}, [])
    assert server.connections == 1 and client.connected
    client.close()
    assert server.closed.wait(5)


def test_only_retry_ops_are_sent_again_on_a_stale_connection(restarting):
    """The server drops every connection after one reply. A ping on the stale connection is
    sent again on a fresh one; an action is not (the client cannot know whether the server
    ran it before it went), and the next request opens a fresh connection."""
    client = _client(restarting.path, retry_ops=("ping",))
    assert client.request({"op": "ping"})[0]["connection"] == 1
    assert client.request({"op": "ping"})[0]["connection"] == 2  # stale, sent again once
    with pytest.raises(ChannelError, match="test server: act: connection failed"):
        client.request({"op": "act"})
    assert not client.connected
    assert client.request({"op": "act"})[0]["connection"] == 3
    client.close()
    assert restarting.seen == ["ping", "ping", "act"]  # the failed act never reached a server


def test_a_fresh_connection_that_fails_is_not_retried(tmp_path):
    attempts = []

    def connect() -> socket.socket:
        attempts.append(1)
        return connect_path(str(tmp_path / "nothing.sock"), timeout=5)

    client = Client(connect, name="nobody", retry_ops=("ping",), error=ChannelError)
    with pytest.raises(ChannelError, match="nobody: ping: cannot connect"):
        client.request({"op": "ping"})
    assert len(attempts) == 1


def test_the_deadline_bounds_the_whole_reply_not_each_read(server):
    """A server dripping one byte every 0.2 s would satisfy a per-read timeout forever."""
    client = _client(server.path, retry_ops=("ping", "drip"))
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="request timed out"):
        client.request({"op": "drip"}, timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    assert not client.connected  # the stream is out of step: dropped
    assert client.request({"op": "ping"})[0]["connection"] == 2  # and the next request goes on
    assert server.seen.count("drip") == 1  # a timeout is never a reason to send again
    client.close()


def test_a_hung_server_costs_the_request_its_timeout(server):
    client = _client(server.path)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="no reply within 0.5 s"):
        client.request({"op": "hang"}, timeout=0.5)
    assert 0.4 < time.monotonic() - t0 < 3.0
    client.close()


def test_a_reply_over_the_cap_is_refused_before_it_is_read(server):
    """The reply announces 8 MiB and sends none of it: a client that read it would wait out
    its deadline; one that checks the announced size first refuses at once."""
    client = _client(server.path, max_blobs=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=r"reply refused: .*8388608 bytes of blobs \(cap 1048576\)"):
        client.request({"op": "huge"}, timeout=20)
    assert time.monotonic() - t0 < 5.0
    assert not client.connected
    # a request's own cap overrides the client's
    assert client.request({"op": "act", "size": 2 << 20}, max_blobs=4 << 20)[1] == [b"x" * (2 << 20)]
    with pytest.raises(ChannelError, match="reply refused"):
        client.request({"op": "act", "size": 2 << 20})
    client.close()


def test_the_workspace_client_connects_through_the_root_and_never_follows_a_symlink(server, tmp_path):
    """A name the workspace controls that is a symlink (to another server, say) is refused,
    not followed; the target is asked again at each connect."""
    link = tmp_path / "link.sock"
    link.symlink_to(server.path)
    where = {"path": link}
    client = WorkspaceClient(lambda: RootedPath(os.getpid(), str(where["path"])), name="ws-test: server",
                             retry_ops=("ping",))
    with pytest.raises(ChannelError, match="ws-test: server: ping: cannot connect: .*not a socket"):
        client.request({"op": "ping"})
    assert server.connections == 0
    where["path"] = server.path
    assert client.request({"op": "ping"})[0]["connection"] == 1
    client.close()


def test_wait_ready_waits_for_the_server_and_gives_up_when_it_dies(tmp_path):
    path = tmp_path / "late.sock"
    client = WorkspaceClient(RootedPath(os.getpid(), str(path)), name="late server")
    started: list[Server] = []
    timer = threading.Timer(0.3, lambda: started.append(Server(path)))
    timer.start()
    try:
        t0 = time.monotonic()
        assert client.wait_ready(10.0, interval=0.02)["op"] == "ping"
        assert 0.2 < time.monotonic() - t0 < 5.0
    finally:
        timer.join()
        client.close()
        for s in started:
            s.stop()
    gone = WorkspaceClient(RootedPath(os.getpid(), str(tmp_path / "never.sock")), name="dead server")
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="dead server: ping: cannot connect"):
        gone.wait_ready(30.0, alive=lambda: False)
    assert time.monotonic() - t0 < 2.0


def test_a_dropped_client_closes_its_connection_at_once(server):
    """No reference cycle through the connector: dropping the last reference closes the
    socket without a garbage collection (an open one would keep the workspace from a snapshot)."""
    import gc

    client = WorkspaceClient(RootedPath(os.getpid(), str(server.path)), name="s")
    client.request({"op": "ping"})
    gc.disable()
    try:
        del client
        assert server.closed.wait(5)
    finally:
        gc.enable()


def test_the_server_loop_answers_a_failing_request_with_an_error_and_serves_on(tmp_path):
    """serve_unix (the desktop input server's and the web driver's loop): a request whose
    handler raises gets an error reply on the same connection; the daemon does not die."""
    import subprocess
    import sys
    import textwrap

    from bunshin_gym.workspace import protocol

    sock = tmp_path / "daemon.sock"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(protocol.__file__).parent)!r})
        from protocol import serve_unix
        def handle(req, blobs):
            if req["op"] == "boom":
                raise RuntimeError("kaboom")
            return {{"op": req["op"]}}, []
        serve_unix({str(sock)!r}, handle, name="test daemon")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        client = _client(sock)
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        reply, _ = client.request({"op": "boom"})
        assert "kaboom" in reply["error"] and "test daemon" in reply["error"]
        assert client.connected  # the same connection answers the next request
        assert client.request({"op": "ping"})[0] == {"op": "ping"}
        assert proc.poll() is None
        client.close()
    finally:
        proc.kill()
        proc.wait()
