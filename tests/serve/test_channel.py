"""The WebSocket env channel (a WebSocket per env handle for reset, step and rollback; what a
client on another host uses, ``channel="websocket"`` here) against a real server and a real
shell workspace: the same answers as HTTP, the HTTP API's auth and errors,
a channel that drops or goes idle, and a server without channels."""

from __future__ import annotations

import json
import os
import select
import socket
import threading

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.errors import ResetNeeded
from bunshin_gym.remote import RemoteEnv, RemoteError
from bunshin_gym.remote_channel import Channel, ChannelError, ChannelRefusal, LocalChannel

from .conftest import ALICE, BOB

ENV = "Bunshin-Shell-v0"
TASK = {"task": "shell/count-files"}


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_hot_calls_go_over_the_channel_and_answer_as_http_does(server, opts):
    before_fds, before_threads = fds(), threading.active_count()
    env = gym.make(ENV, server=server.url, token=ALICE, max_steps=3, channel="websocket")
    http = RemoteEnv.attach(ENV, server.url, env.unwrapped.remote_id, token=ALICE, channel=False)
    try:
        obs, info = env.reset(options=TASK)
        assert isinstance(env.unwrapped._channel, Channel) and env.unwrapped._channel._sock is not None
        obs, reward, term, trunc, info = env.step("echo over the channel; exit 3")
        assert obs["output"] == "over the channel\n" and obs["exit_code"] == 3 and not term
        assert {"server_s", "encode_s", "decode_s", "request_s", "step_s"} <= set(env.unwrapped.last_step_timing)
        # the other handle, over HTTP, steps the same env: same kind of answer
        obs_http, *_ = http.step("echo over http")
        assert obs_http["output"] == "over http\n" and http._channel is None
        snap = env.unwrapped.snapshot()
        env.step("touch /tmp/after")
        back = env.unwrapped.rollback(snap)
        assert back["instruction"] == obs["instruction"]
        assert env.step("test -e /tmp/after; echo $?")[0]["output"] == "1\n"  # rolled back
        with pytest.raises(ResetNeeded):  # max_steps=3 reached (snapshot counted 2 steps): as locally
            env.step("true")
            env.step("true")
        env.reset(options=TASK)  # the channel is still usable after an error answer
        assert env.step("echo again")[0]["output"] == "again\n"
    finally:
        http.detach()
        env.close()
    for handle in (env.unwrapped, http):
        handle._keepalive.join(10)
    assert env.unwrapped._channel._sock is None
    assert fds() <= before_fds and threading.active_count() <= before_threads, "a socket or thread leaked"


def test_bad_requests_are_answered_and_the_channel_goes_on(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE, channel="websocket")
    try:
        env.reset(options=TASK)
        ch = env._channel
        for body, status, words in [({"op": "nop"}, 400, "op must be one of"),
                                    ({"op": "step"}, 400, "needs an action"),
                                    ({"op": "reset", "options": [1]}, 400, "options must be an object"),
                                    ({"op": "reset", "options": {"task": "../../etc/passwd"}}, 400, "shipped task id"),
                                    ({"op": "rollback", "snapshot": "snap-nope"}, 404, "no snapshot")]:
            op = body.pop("op")
            with pytest.raises(ChannelRefusal, match=words) as e:
                ch.call(op, body)
            assert e.value.status == status
        assert env.step("echo still")[0]["output"] == "still\n"
    finally:
        env.close()


def test_a_lone_surrogate_is_the_env_s_to_refuse(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE, channel="websocket")
    local = gym.make(ENV)
    try:
        env.reset(options=TASK)
        local.reset(options=TASK)
        remote_info = env.step("echo \ud800")[4]
        local_info = local.step("echo \ud800")[4]
        assert "error" in remote_info and remote_info["error"] == local_info["error"]
    finally:
        env.close()
        local.close()


def test_the_channel_has_the_http_api_s_auth(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE, channel="websocket")
    try:
        with pytest.raises(ChannelError, match="API key") as e:
            Channel(server.url, env.remote_id, "wrong-token", 10).call("step", {"action": "true"})
        assert e.value.status == 401
        with pytest.raises(ChannelError, match="no envlease") as e:  # another owner's env: not found
            Channel(server.url, env.remote_id, BOB, 10).call("step", {"action": "true"})
        assert e.value.status == 404
        env.reset(options=TASK)
    finally:
        env.close()
    with pytest.raises(ChannelError, match="no envlease"):  # closed: the next call says so
        Channel(server.url, env.remote_id, ALICE, 10).call("step", {"action": "true"})


@pytest.mark.parametrize("channel", ["websocket", True], ids=["websocket", "local"])  # True: the local one here
def test_a_call_interrupted_with_its_request_out_leaves_no_answer_for_the_next(server, opts, channel):
    """Ctrl-C (or an error in the work done while waiting) after the request went out: its
    answer still comes, and must not be taken for the next request's."""
    env = RemoteEnv(ENV, server.url, token=ALICE, channel=channel)
    try:
        env.reset(options=TASK)
        assert isinstance(env._channel, LocalChannel) == (channel is True)

        def interrupted():
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            env._channel.call("step", {"action": "sleep 0.3; echo first >> /tmp/log; echo first"}, interrupted)
        assert env.step("echo second")[0]["output"] == "second\n"
        assert env.step("cat /tmp/log")[0]["output"] == "first\n", "the interrupted step ran once"
    finally:
        env.close()


@pytest.mark.parametrize("channel", ["websocket", True], ids=["websocket", "local"])  # True: the local one here
def test_a_dropped_channel_is_opened_again_and_a_broken_request_is_not_sent_twice(server, opts, channel):
    env = RemoteEnv(ENV, server.url, token=ALICE, channel=channel)
    try:
        env.reset(options=TASK)
        env.step("echo 1 >> /tmp/count")
        assert isinstance(env._channel, LocalChannel) == (channel is True)
        sock = env._channel._sock
        cut = threading.Timer(0.5, sock.shutdown, (socket.SHUT_RDWR,))  # the connection drops mid-step
        cut.start()
        with pytest.raises(RemoteError, match="broke while the request was out"):
            env.step("sleep 1.5; echo 2 >> /tmp/count")  # it may have run: not sent again
        cut.join()
        # the next call opens a new channel, and is served after the step that was out
        assert env.step("cat /tmp/count")[0]["output"] == "1\n2\n", "the broken request ran exactly once"

        # the server closes the channel between two calls (as after its idle timeout or a
        # restart): the client finds it closed before its next request and opens a new one
        old = env._channel._sock
        old.shutdown(socket.SHUT_WR)  # the server reads the end and closes its side
        assert select.select([old], [], [], 10)[0], "the server did not close its side"
        assert env.step("echo 3 >> /tmp/count; cat /tmp/count")[0]["output"] == "1\n2\n3\n"
        assert env._channel._sock is not old and old.fileno() == -1
    finally:
        env.close()


def test_a_server_without_channels_is_stepped_over_http(server, opts):
    """A channel refused with 403 (what a server without the route answers) falls back to HTTP
    before anything was sent."""
    env = RemoteEnv(ENV, server.url, token=ALICE, channel="websocket")
    try:
        env._channel = Channel(server.url + "/no-channels-here", env.remote_id, ALICE, 10)
        obs, _ = env.reset(options=TASK)
        assert "instruction" in obs and not env._use_channel
        assert env.step("echo http")[0]["output"] == "http\n"
        assert "server_s" not in env.last_step_timing
    finally:
        env.close()


def test_clones_have_their_own_channels(server, opts):
    env = RemoteEnv(ENV, server.url, token=ALICE, channel="websocket")
    clones = []
    try:
        env.reset(options=TASK)
        env.step("echo parent > /tmp/who")
        clones = env.clone(2)
        for i, c in enumerate(clones):
            assert c.step(f"echo {i} >> /tmp/who; cat /tmp/who")[0]["output"] == f"parent\n{i}\n"
        assert len({id(x._channel) for x in [env, *clones]}) == 3
        assert env.step("cat /tmp/who")[0]["output"] == "parent\n"
    finally:
        for c in clones:
            c.close()
        env.close()


def test_channel_errors_are_json_like_http_errors(server, opts):
    """What a refused upgrade and an error answer carry: the HTTP API's status and message."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /envs/env-nope/channel HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                  b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer " + ALICE.encode() + b"\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404") and json.loads(body)["message"] == "no envlease 'env-nope'"
