"""``RemoteEnv`` handles used from Ray workers: envs of a real ``bunshin serve`` (started by the
test) made and stepped by Ray tasks and an actor in other processes, and a handle made here
passed to a Ray task (pickled: it reattaches to the same env on the server) that keeps working
there and here."""

from __future__ import annotations

import os
import pickle

import gymnasium as gym
import pytest
import ray
from serve.conftest import ALICE, Server, leases  # the serve tests' real server (tests/ is on sys.path)

import bunshin_gym  # noqa: F401 - registers the envs
from bunshin_gym.envs.shell.env import load_shell_task
from bunshin_gym.remote import RemoteEnv, RemoteError

ENV = "Bunshin-Shell-v0"
COUNT, HELLO = "shell/count-files", "shell/hello-file"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-ray"), "--close-on-exit")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def no_leases_left(server):
    yield
    left = leases(server)
    assert not left, f"the test left {left} on the server"


@ray.remote(num_cpus=0)
def solve_there(url: str, token: str, task: str) -> dict:
    """Make an env of the server in this worker, solve the task with its oracle, close it."""
    env = gym.make(ENV, server=url, token=token)
    try:
        obs, info = env.reset(options={"task": task})
        steps = [env.step(a) for a in load_shell_task(task).oracle()]
        return {"pid": os.getpid(), "type": type(env).__name__, "task": info["task_id"],
                "rewards": [s[1] for s in steps], "terminated": steps[-1][2]}
    finally:
        env.close()


@ray.remote(num_cpus=0)
class Stepper:
    """An actor that keeps a RemoteEnv across calls."""

    def __init__(self, url: str, token: str):
        import bunshin_gym  # noqa: F401, F811 - a fresh worker: the envs are registered by the import, as anywhere

        self.env = gym.make(ENV, server=url, token=token)

    def pid(self) -> int:
        return os.getpid()

    def reset(self, task: str) -> str:
        return self.env.reset(options={"task": task})[1]["task_id"]

    def step(self, action: str) -> tuple:
        return self.env.step(action)[:3]

    def close(self) -> None:
        self.env.close()


@ray.remote(num_cpus=0)
def step_handle(env: RemoteEnv, action: str) -> tuple:
    """Step a handle that was pickled to this worker; leave the env open for its owner."""
    try:
        obs, reward, term, _, _ = env.step(action)
        return os.getpid(), env.remote_id, obs["output"], reward, term
    finally:
        env.detach()


@ray.remote(num_cpus=0)
def attach_and_step(url: str, remote_id: str, token: str, action: str) -> tuple:
    """Rebuild a handle from the server's URL and the env's id, step it, drop the handle."""
    env = RemoteEnv.attach(ENV, url, remote_id, token=token)
    try:
        obs, reward, term, _, _ = env.step(action)
        return os.getpid(), obs["output"], reward, term, env.action_space == gym.make(ENV).action_space
    finally:
        env.detach()


def test_ray_tasks_and_an_actor_make_and_step_remote_envs(ray_local, server, no_leases_left):
    done = ray.get([solve_there.remote(server.url, ALICE, task) for task in (COUNT, HELLO)])
    for out, task in zip(done, (COUNT, HELLO), strict=True):
        assert out["pid"] != os.getpid() and out["type"] == "RemoteEnv", out
        assert out["task"] == task and out["rewards"][-1] == 1.0 and out["terminated"], out
    stepper = Stepper.remote(server.url, ALICE)
    try:
        assert ray.get(stepper.pid.remote()) != os.getpid()
        assert ray.get(stepper.reset.remote(HELLO)) == HELLO
        obs, reward, term = ray.get(stepper.step.remote("echo hello world > hello.txt; cat hello.txt"))
        assert obs["output"] == "hello world\n" and not term
        assert ray.get(stepper.step.remote("DONE"))[1:] == (1.0, True)
        ray.get(stepper.close.remote())
    finally:
        ray.kill(stepper)


def test_a_handle_passed_to_a_ray_task_keeps_working_there_and_here(ray_local, server, no_leases_left):
    env = gym.make(ENV, server=server.url, token=ALICE)
    try:
        env.reset(options={"task": COUNT})
        pid, rid, _, reward, term = ray.get(step_handle.remote(env, "ls /data | wc -l > answer.txt"))
        assert pid != os.getpid() and rid == env.remote_id and (reward, term) == (0.0, False)
        # the same env on the server: what the worker's step wrote is here
        obs, *_ = env.step("cat answer.txt")
        count = obs["output"].strip()
        assert count.isdigit(), obs
        # rebuilt from URL + id in a worker: the same env again; its DONE ends the episode
        pid, out, reward, term, same_space = ray.get(attach_and_step.remote(server.url, env.remote_id, ALICE,
                                                                             "cat answer.txt"))
        assert pid != os.getpid() and out.strip() == count and same_space
        pid, rid, _, reward, term = ray.get(step_handle.remote(env, "DONE"))
        assert (reward, term) == (1.0, True)
        # (no step after the end here: the server answers ResetNeeded as an unhandled 500 and
        # drops the connection, so the next request on it may be reset: a serve issue)
    finally:
        env.close()
    with pytest.raises(RemoteError, match="closed"):
        pickle.dumps(env)
    with pytest.raises(RemoteError, match="404"):
        RemoteEnv.attach(ENV, server.url, env.remote_id, token=ALICE)
    with pytest.raises(RemoteError, match="needs a token"):
        RemoteEnv.attach(ENV, server.url, env.remote_id, token="")
