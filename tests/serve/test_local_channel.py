"""The local env channel (a Unix socket served on the env's own thread) against a real server
and real shell workspaces: a client on the server's host gets it by default, with the HTTP
API's auth and errors, bounded requests, no request sent twice, and the WebSocket channel
where it cannot reach it."""

from __future__ import annotations

import json
import socket

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.errors import ResetNeeded
from bunshin_gym.remote import RemoteEnv
from bunshin_gym.remote_channel import Channel, ChannelError, ChannelRefusal, LocalChannel
from bunshin_gym.serve.codec import LOCAL_ERROR, LOCAL_HEADER, LOCAL_JSON, LOCAL_OK
from bunshin_gym.serve.local_channel import MAX_REQUEST

from .conftest import ALICE, BOB, Server

ENV = "Bunshin-Shell-v0"
TASK = {"task": "shell/count-files"}


def socket_name(server) -> str:
    with server.client() as c:
        r = c.get("/channel/local")
    assert r.status_code == 200, r.text
    return r.json()["abstract_socket"]


def raw_connect(server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect("\0" + socket_name(server))
    return s


def send(s: socket.socket, kind: int, data: bytes) -> None:
    s.sendall(LOCAL_HEADER.pack(kind, len(data)) + data)


def receive(s: socket.socket) -> tuple[int, bytes] | None:
    head = b""
    while len(head) < LOCAL_HEADER.size:
        chunk = s.recv(LOCAL_HEADER.size - len(head))
        if not chunk:
            return None
        head += chunk
    kind, n = LOCAL_HEADER.unpack(head)
    data = b""
    while len(data) < n:
        data += s.recv(n - len(data))
    return kind, data


def test_a_client_on_the_server_s_host_steps_over_the_local_channel(server, opts):
    env = gym.make(ENV, server=server.url, token=ALICE, max_steps=5)
    ws = RemoteEnv.attach(ENV, server.url, env.unwrapped.remote_id, token=ALICE, channel="websocket")
    try:
        obs, _ = env.reset(options=TASK)
        assert isinstance(env.unwrapped._channel, LocalChannel), "not the local channel by default"
        obs, reward, term, trunc, info = env.step("echo local; exit 4")
        assert obs["output"] == "local\n" and obs["exit_code"] == 4
        assert {"server_s", "encode_s", "decode_s", "request_s", "step_s"} <= set(env.unwrapped.last_step_timing)
        # the same env through a WebSocket handle between two local calls: one env, one order
        assert ws.step("echo 1 > /tmp/order")[0]["output"] == ""
        assert isinstance(ws._channel, Channel)
        snap = env.unwrapped.snapshot()  # HTTP, run on the env's thread between channel requests
        env.step("echo 2 >> /tmp/order")
        assert env.step("cat /tmp/order")[0]["output"] == "1\n2\n"
        env.unwrapped.rollback(snap)
        assert env.step("cat /tmp/order")[0]["output"] == "1\n"
        with pytest.raises(ResetNeeded):  # max_steps=5 reached: as locally
            for _ in range(3):
                env.step("true")
        env.reset(options=TASK)  # the channel goes on after an error answer
        assert env.step("echo again")[0]["output"] == "again\n"
    finally:
        ws.detach()
        env.close()
    assert env.unwrapped._channel._sock is None


def test_the_local_channel_has_the_http_api_s_auth(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE)
    name = socket_name(server)
    try:
        with pytest.raises(ChannelError, match="API key") as e:
            LocalChannel(name, env.remote_id, "wrong-token", 10).call("step", {"action": "true"})
        assert e.value.status == 401
        with pytest.raises(ChannelError, match="no envlease") as e:  # another owner's env: not found
            LocalChannel(name, env.remote_id, BOB, 10).call("step", {"action": "true"})
        assert e.value.status == 404
        with server.client() as c:
            assert c.get("/channel/local", headers={"X-API-KEY": "nope"}).status_code == 401
        env.reset(options=TASK)
        other = LocalChannel(name, env.remote_id, ALICE, 10)
        other.call("step", {"action": "true"})
    finally:
        env.close()
    # the env's close closed its channels on the server: the open one finds it closed, opens
    # again and is refused
    with pytest.raises(ChannelError, match="no envlease") as e:
        other.call("step", {"action": "true"})
    assert e.value.status == 404
    other.close()


def test_bad_requests_are_answered_and_bounded(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE)
    try:
        env.reset(options=TASK)
        ch = env._channel
        assert isinstance(ch, LocalChannel)
        for body, status, words in [({"op": "nop"}, 400, "op must be one of"),
                                    ({"op": "step"}, 400, "needs an action"),
                                    ({"op": "reset", "options": {"task": "../../etc/passwd"}}, 400, "shipped task id"),
                                    ({"op": "rollback", "snapshot": "snap-nope"}, 404, "no snapshot")]:
            op = body.pop("op")
            with pytest.raises(ChannelRefusal, match=words) as e:
                ch.call(op, body)
            assert e.value.status == status
        assert env.step("echo still")[0]["output"] == "still\n"

        # by hand: a request that is not JSON, then one longer than the server takes
        s = raw_connect(server)
        with s:
            send(s, LOCAL_JSON, json.dumps({"token": ALICE, "env": env.remote_id}).encode())
            assert receive(s) == (LOCAL_OK, b"")
            send(s, LOCAL_JSON, b"{not json")
            kind, data = receive(s)
            assert kind == LOCAL_ERROR and json.loads(data)["status"] == 400
            s.sendall(LOCAL_HEADER.pack(LOCAL_JSON, MAX_REQUEST + 1))
            kind, data = receive(s)
            assert kind == LOCAL_ERROR and json.loads(data)["status"] == 413
            assert receive(s) is None, "the server kept a channel whose request it could not read"
        # a hello that is no hello, and a connection that says nothing and goes
        s = raw_connect(server)
        with s:
            send(s, LOCAL_JSON, b"[1, 2]")
            kind, data = receive(s)
            assert kind == LOCAL_ERROR and json.loads(data)["status"] == 400 and receive(s) is None
        raw_connect(server).close()
        assert env.step("echo still here")[0]["output"] == "still here\n"
    finally:
        env.close()


def test_a_client_that_cannot_reach_the_socket_uses_a_websocket(server, opts):
    """Another host (or network namespace) has no such socket: nothing was sent, and the
    request goes over a WebSocket channel instead, once."""
    env = RemoteEnv(ENV, server.url, token=ALICE)
    try:
        env.reset(options=TASK)
        env._conn._local = "bunshin-serve-not-on-this-host"
        env._channel = None
        assert env.step("echo 1 >> /tmp/n; cat /tmp/n")[0]["output"] == "1\n"
        assert isinstance(env._channel, Channel) and env._use_channel == "websocket"
        assert env.step("cat /tmp/n")[0]["output"] == "1\n"
    finally:
        env.close()


def test_a_server_without_local_channels_is_stepped_over_a_websocket(tmp_path):
    srv = Server(tmp_path, "--close-on-exit", "--no-local-channel")
    try:
        env = RemoteEnv(ENV, srv.url, token=ALICE)
        try:
            env.reset(options=TASK)
            assert isinstance(env._channel, Channel)
            assert env.step("echo ws")[0]["output"] == "ws\n"
        finally:
            env.close()
    finally:
        srv.stop()
