"""``RemoteEnv`` against a real server: ``gym.make(ID, server=URL)``, reset, step, clone,
snapshot, rollback, close, on the shell env; the same episode as a local env gives."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.remote import RemoteEnv, RemoteError, RemoteSnapshot
from bunshin_gym.serve import codec

from .conftest import ALICE, BOB, leases, workspace_ids_of_server

TASK = "shell/count-files"


def test_gym_make_with_server_gives_a_remote_env_that_plays_like_a_local_one(server, opts):
    before = workspace_ids_of_server(server)
    env = gym.make("Bunshin-Shell-v0", server=server.url, token=ALICE)
    try:
        assert isinstance(env, RemoteEnv) and isinstance(env, gym.Env)
        local_spaces = gym.make("Bunshin-Shell-v0")
        assert env.observation_space == local_spaces.observation_space
        assert env.action_space == local_spaces.action_space

        obs, info = env.reset(options={"task": TASK})
        assert info["task_id"] == TASK and "number of files" in obs["instruction"]
        obs, reward, terminated, truncated, info = env.step("ls /data | wc -l")
        assert obs["output"].strip() == "7" and obs["exit_code"] == 0 and reward == 0.0
        assert not terminated and not truncated
        assert env.last_step_timing["step_s"] > 0
        obs, reward, terminated, truncated, info = env.step("ls /data | wc -l > /home/user/answer.txt")
        obs, reward, terminated, truncated, info = env.step("DONE")
        assert (reward, terminated, info["success"]) == (1.0, True, True)
        assert len(workspace_ids_of_server(server) - before) == 1
        # a step after the end raises what a local env raises, and the env (and its connection) go on
        with pytest.raises(gym.error.ResetNeeded, match="reset"):
            env.step("true")
        obs, info = env.reset(options={"task": TASK})
        assert env.step("ls /data | wc -l")[0]["output"].strip() == "7"
    finally:
        env.close()
    assert workspace_ids_of_server(server) - before == set(), "close reclaims the env's workspace"
    assert leases(server) == []
    with pytest.raises(RemoteError, match="closed"):
        env.step("true")


def test_clone_snapshot_rollback(server, opts):
    env = RemoteEnv("Bunshin-Shell-v0", server.url, token=ALICE, task=TASK)
    clones: list[RemoteEnv] = []
    try:
        env.reset()
        env.step("echo one > /tmp/f")
        snap = env.snapshot(note="after one")
        assert isinstance(snap, RemoteSnapshot) and snap.steps == 1
        clones = env.clone(2)
        assert len({c.remote_id for c in clones} | {env.remote_id}) == 3
        clones[0].step("echo zero > /tmp/f")
        clones[1].step("echo first > /tmp/f")
        env.step("echo two > /tmp/f")
        outs = [e.step("cat /tmp/f")[0]["output"].strip() for e in (env, *clones)]
        assert outs == ["two", "zero", "first"], "clones evolve independently"

        env.rollback(snap)
        assert env.step("cat /tmp/f")[0]["output"].strip() == "one"
        clones[0].rollback(snap)  # a clone may roll back to its parent's snapshot
        assert clones[0].step("cat /tmp/f")[0]["output"].strip() == "one"
        obs = env.rollback()  # the state right after reset
        assert env.step("cat /tmp/f 2>&1; true")[0]["output"].strip().endswith("No such file or directory")
        assert "number of files" in obs["instruction"]
        with pytest.raises(RemoteError, match="404: no snapshot 'snap-nope'"):
            env.rollback(RemoteSnapshot("snap-nope", 0, False))
    finally:
        for e in (env, *clones):
            e.close()


def test_bad_requests_get_clear_errors_and_leave_nothing(server, opts):
    with pytest.raises(RemoteError, match="404: unknown env 'Bunshin-Nope-v0'"):
        RemoteEnv("Bunshin-Nope-v0", server.url, token=ALICE)
    with pytest.raises(RemoteError, match="401"):
        RemoteEnv("Bunshin-Shell-v0", server.url, token="not-a-token-000")
    with pytest.raises(RemoteError, match="cannot be set through the server"):
        RemoteEnv("Bunshin-Shell-v0", server.url, token=ALICE, workspace_factory="x")
    for path in ("/etc/passwd.json", "shell/../../../../etc/x", "x.json", "/root/.ssh/id_rsa"):
        with pytest.raises(RemoteError, match="400: task .*give a shipped task id"):  # no server files read
            RemoteEnv("Bunshin-Shell-v0", server.url, token=ALICE, task=path)
    with pytest.raises(RemoteError, match="400: Bunshin-Shell-v0: .*unexpected keyword"):
        RemoteEnv("Bunshin-Shell-v0", server.url, token=ALICE, no_such_option=1)
    env = RemoteEnv("Bunshin-Shell-v0", server.url, token=BOB, task=TASK)
    try:
        env.reset()
        with pytest.raises(RemoteError, match="429: quota exceeded"):
            env.clone(1)  # bob may hold one workspace
        with pytest.raises(RemoteError, match="404"):  # alice cannot touch bob's env
            with server.client(ALICE) as c:
                r = c.post(f"/envs/{env.remote_id}/step", json={"action": "true"})
                raise RemoteError(f"{r.status_code}: {r.text}", r.status_code)
        with server.client(BOB) as c:
            for body in (b"{", b"[]", b'{"no_action": 1}'):
                r = c.post(f"/envs/{env.remote_id}/step", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and json.loads(r.text)["message"], r.text
            assert c.post(f"/envs/{env.remote_id}/clone", json={"n": 0}).status_code == 400
            assert c.post(f"/envs/{env.remote_id}/reset", json={"seed": "x"}).status_code == 400
            for frames in ([], {"/observation/screenshot": 3}, "f-1"):  # the arrays a client holds, by place
                r = c.post(f"/envs/{env.remote_id}/step", json={"action": "true", "frames": frames})
                assert r.status_code == 400 and "frames must be" in r.json()["message"], r.text
        with pytest.raises(RemoteError, match="400: task '/etc/hostname'"):
            env.reset(options={"task": "/etc/hostname"})
        # a malformed action is the env's business: an error in info, the episode goes on
        obs, reward, terminated, truncated, info = env.step("bad\0action")
        assert "error" in info and not terminated
    finally:
        env.close()
    assert leases(server, BOB) == []


def test_arrays_travel_as_compressed_bytes():
    screenshot = np.full((1080, 1920, 3), 230, np.uint8)
    screenshot[200:600, 300:1200] = (20, 40, 60)
    value = {"observation": {"screenshot": screenshot, "accessibility_tree": "<tree/>"}, "reward": 0.5,
             "info": {"n": np.int64(3), "raw": b"\x00\xff"}}
    data = codec.encode(value)
    assert len(data) < screenshot.nbytes / 50, "compressed, not a JSON list of numbers"
    back = codec.decode(data)
    assert back["observation"]["screenshot"].dtype == np.uint8
    assert np.array_equal(back["observation"]["screenshot"], screenshot)
    assert back["info"] == {"n": 3, "raw": b"\x00\xff"} and back["reward"] == 0.5
    with pytest.raises(codec.FrameError):
        codec.decode(b"nope")
    with pytest.raises(codec.FrameError):
        codec.decode(data[:-10])


@pytest.mark.parametrize("space", [
    spaces.Dict({"a": spaces.Box(0, 255, (4, 5, 3), np.uint8), "b": spaces.Discrete(512, start=-256)}),
    spaces.Text(100, min_length=1, charset="abc\n"),
    spaces.Tuple([spaces.MultiBinary(3), spaces.MultiDiscrete([2, 3])]),
    spaces.Box(np.array([0.0, -1.0], np.float32), np.array([1.0, 2.0], np.float32), (2,), np.float32),
])
def test_spaces_round_trip(space):
    assert codec.space_from_json(json.loads(json.dumps(codec.space_to_json(space)))) == space


@pytest.mark.slow
def test_desktop_env_over_the_server_sends_screenshots_compressed(server, opts):
    env = gym.make("Bunshin-OSWorld-v0", server=server.url, token=ALICE, action_space="computer_13",
                   require_a11y_tree=False)
    try:
        obs, info = env.reset(options={"task": "osworld/editor-append-item"})
        shot = obs["screenshot"]
        assert shot.dtype == np.uint8 and shot.shape == (1080, 1920, 3) and shot.std() > 0
        assert env.observation_space["screenshot"].shape == (1080, 1920, 3)
        obs, reward, terminated, truncated, info = env.step({"action_type": "MOVE_TO", "x": 300, "y": 300})
        assert "error" not in info and obs["screenshot"].shape == shot.shape
        with server.client() as c:  # the same step's answer on the wire: a compressed frame
            r = c.post(f"/envs/{env.remote_id}/step", json={"action": {"action_type": "WAIT"}})
        assert r.headers["content-type"] == codec.MEDIA_TYPE and len(r.content) < shot.nbytes / 10
    finally:
        env.close()
