"""Screenshots of a desktop RemoteEnv travel as frame deltas (the rectangles X says were
drawn), over the env channel or HTTP, and every one the client gets is byte-for-byte the
server env's own: checked against a second handle on the same env that receives whole
screenshots, across steps, a lost answer, two clients, a clone, a reset, a rollback and a
dropped channel; over the local channel (a client on the server's host), a WebSocket channel
and HTTP."""

from __future__ import annotations

import json
import socket
import struct
import time

import gymnasium as gym
import numpy as np
import pytest

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.remote import RemoteEnv
from bunshin_gym.remote_channel import Channel

from .conftest import ALICE

ENV = "Bunshin-OSWorld-v0"
KW = dict(action_space="computer_13", require_a11y_tree=False, wait_seconds=0.0, max_steps=10**6)
WAIT = {"action_type": "WAIT"}


def shot(env: RemoteEnv, action: dict = WAIT) -> np.ndarray:
    obs, _, _, _, info = env.step(action)
    assert "error" not in info, info["error"]
    return obs["screenshot"]


def exact_now(env: RemoteEnv, truth: RemoteEnv) -> np.ndarray:
    """``env``'s screenshot now, checked against whole screenshots of the same env taken just
    before and after it (once the screen stands still: a screenshot depends on the state only)."""
    for _ in range(20):
        before, got, after = shot(truth), shot(env), shot(truth)
        if before.tobytes() == after.tobytes():
            assert got.tobytes() == before.tobytes(), "a delta-built screenshot is not the env's"
            assert got.dtype == before.dtype and got.shape == before.shape
            return got
    raise AssertionError("the screen never stood still")


def drawn_since(truth: RemoteEnv, old: np.ndarray) -> None:
    """Wait until ``truth``'s screen differs from ``old``: an app draws what it was sent some
    milliseconds after the action returns, and faster steps can look before it did."""
    for _ in range(200):
        if shot(truth).tobytes() != old.tobytes():
            return
        time.sleep(0.01)
    raise AssertionError("nothing was drawn within 2 s")


def wire_ref(server, env: RemoteEnv, action: dict) -> tuple[dict, int]:
    """Step ``env`` outside its handle, naming the frames the handle holds, and throw the
    answer away (a lost answer), over the handle's channel or HTTP as it uses; returns the
    screenshot's reference and the answer's size."""
    body = {"action": action, "frames": env._held.ids()}
    if env._use_channel:
        content, _, _ = Channel(server.url, env.remote_id, ALICE, 60).call("step", body)
        content = bytes(content)
    else:
        with server.client() as c:
            r = c.post(f"/envs/{env.remote_id}/step", json=body)
        assert r.status_code == 200, r.text
        content = r.content
    (n,) = struct.unpack(">I", content[4:8])
    return json.loads(content[8:8 + n])["value"]["observation"]["screenshot"], len(content)


@pytest.mark.slow
@pytest.mark.parametrize("channel", [True, "websocket", False], ids=["local-channel", "websocket", "http"])
def test_desktop_screenshots_as_deltas_are_the_env_s_own(server, opts, channel):
    env = gym.make(ENV, server=server.url, token=ALICE, channel=channel, **KW)
    envs, views = [env], []  # envs are closed at the end; views (more handles on them) let go
    try:
        obs, _ = env.reset(options={"task": "osworld/editor-append-item"})
        truth = RemoteEnv.attach(ENV, server.url, env.remote_id, token=ALICE, frame_deltas=False)
        views.append(truth)
        first = exact_now(env, truth)
        assert not first.flags.writeable
        assert shot(env) is first, "an unchanged screenshot is not sent again: the same array comes back"

        shot(env, {"action_type": "TYPING", "text": "delta"})
        drawn_since(truth, first)
        typed = exact_now(env, truth)
        assert typed.tobytes() != first.tobytes()

        ref, size = wire_ref(server, env, {"action_type": "TYPING", "text": " lost"})  # its answer is lost
        for _ in range(50):  # and the next ones, until one carries the text's pixels
            if ref["codec"] != "same":
                break
            ref, size = wire_ref(server, env, WAIT)
        # what X drew since the handle's frame, nothing compared; not a 6 MB screenshot
        assert ref["codec"] == "zstd-rects" and size < 100_000, (ref["codec"], size)
        after_loss = exact_now(env, truth)  # a delta against the older base the handle still holds
        assert after_loss.tobytes() != typed.tobytes()
        if channel:  # the channel drops between two calls: the next call opens a new one
            env.unwrapped._channel._sock.shutdown(socket.SHUT_RDWR)
            exact_now(env, truth)  # exact (not compared with after_loss: the caret blinks)

        other = RemoteEnv.attach(ENV, server.url, env.remote_id, token=ALICE)  # a second client
        views.append(other)
        exact_now(other, truth)
        shot(env, {"action_type": "TYPING", "text": " two"})
        exact_now(other, truth)
        exact_now(env, truth)

        (clone,) = env.clone(1)
        envs.append(clone)
        assert shot(clone) is env._held.get("/observation/screenshot")[1], \
            "a clone's first screenshot is a delta against its parent's"
        clone_truth = RemoteEnv.attach(ENV, server.url, clone.remote_id, token=ALICE, frame_deltas=False)
        views.append(clone_truth)
        before_typing = exact_now(clone, clone_truth)
        shot(clone, {"action_type": "TYPING", "text": " clone"})
        drawn_since(clone_truth, before_typing)
        mine = exact_now(clone, clone_truth)
        assert exact_now(env, truth).tobytes() != mine.tobytes(), "the clone went its own way"

        obs, _ = env.reset(options={"task": "osworld/editor-append-item"})
        exact_now(env, truth)
        snap = env.snapshot()
        shot(env, {"action_type": "TYPING", "text": " gone"})
        back = env.rollback(snap)["screenshot"]
        exact_now(env, truth)
        assert back.dtype == np.uint8 and back.shape == first.shape

        with server.client() as c:
            r = c.post(f"/envs/{env.remote_id}/step", json={"action": WAIT, "frames": ["not", "a", "map"]})
        assert r.status_code == 400 and "frames must be" in r.json()["message"]
    finally:
        for view in views:
            view.detach()
        for e in envs:
            e.close()
