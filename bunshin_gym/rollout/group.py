"""``GroupVectorEnv``: the G rollouts of one GRPO group as forks of one workspace.

The group's task is set up once, in one workspace; the G members are forks of it, so they
share every page they do not write. Members step independently (each in its own thread
under :meth:`run_group`, or together through the vector ``step``); a finished member stays
finished (no autoreset) and :attr:`active` says who still runs. A member that fails (its
thread raised, or its workspace died mid-step) ends with a failed step (error observation,
reward 0, ``info["error"]``); the others run on.

Example:
    >>> envs = gym.make_vec("Bunshin-Shell-v0", num_envs=4, vectorization_mode="vector_entry_point")
    >>> obs, infos = envs.reset(options={"task": "shell/count-files"})
    >>> trajs = envs.run_group(lambda i, obs, hist: "ls /data | wc -l > answer.txt" if not hist else "DONE")
    >>> [t.reward for t in trajs]
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from bunshin_gym.core.env import printable
from bunshin_gym.rollout.signature import signature

Policy = Callable[[int, Any, list], Any]
log = logging.getLogger(__name__)


@dataclass
class Step:
    action: Any
    observation: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    think_s: float  # time the policy took to choose the action
    tool_s: float  # time the env took to answer it


@dataclass
class Trajectory:
    """One member's episode under :meth:`GroupVectorEnv.run_group`."""

    member: int
    task_id: str
    first_observation: Any
    steps: list[Step] = field(default_factory=list)
    wall_s: float = 0.0
    #: why the member failed (its policy or env raised, its workspace died); None if it did not
    error: str | None = None
    #: the exception behind ``error``, when one was raised
    exception: BaseException | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def reward(self) -> float:
        return self.steps[-1].reward if self.steps else 0.0

    @property
    def actions(self) -> list:
        return [s.action for s in self.steps]


class GroupVectorEnv(VectorEnv):
    """A GRPO group: one task, ``num_envs`` forked members.

    Args:
        env_id: the single env's id (``Bunshin-Shell-v0``, ...).
        num_envs: group size G.
        cache: a :class:`~bunshin_gym.rollout.prefix_cache.PrefixCache` serving members'
            tool-call prefixes (the outermost wrapper of each member).
        speculation: a :class:`~bunshin_gym.rollout.speculation.Speculation` running
            predicted calls in forks (inside the cache).
        member_wrappers: more callables applied to each member env, innermost first.
        lazy: fork a member's workspace only when it is first needed (default: with a
            cache, which can serve steps without one).
        max_workers: threads stepping members at once (default G).
        step_log: a :class:`~bunshin_gym.rollout.steplog.StepLog` recording every group, step
            and member's end (what ``bunshin explore`` shows).
        park_root: close the root's workspace when the members are forked (it is idle until
            the next reset; the snapshot the members fork keeps its state, and it is forked
            back from there if used): a group then holds G workspaces, not G + 1.
        **env_kwargs: passed to ``gym.make(env_id, ...)``.
    """

    metadata = {"autoreset_mode": AutoresetMode.DISABLED}

    def __init__(self, env_id: str, num_envs: int, *, cache: Any = None, speculation: Any = None,
                 member_wrappers: list[Callable] | None = None, lazy: bool | None = None,
                 max_workers: int | None = None, step_log: Any = None, park_root: bool = True,
                 **env_kwargs: Any):
        if num_envs < 1:
            raise ValueError(f"a group needs num_envs >= 1, got {num_envs}")
        self.env_id = env_id
        self.num_envs = num_envs
        self.root = gym.make(env_id, **env_kwargs)
        self.cache, self.speculation = cache, speculation
        self.wrappers = list(member_wrappers or [])
        self.wrappers += [w.wrap for w in (speculation, cache) if w is not None]
        self.lazy = cache is not None if lazy is None else lazy
        self.park_root = park_root
        self.single_observation_space = self.root.observation_space
        self.single_action_space = self.root.action_space
        self.members: list[gym.Env] = []
        self.active = np.zeros(num_envs, dtype=bool)
        self._last: list[tuple] = []
        self._pool = ThreadPoolExecutor(max_workers=max_workers or num_envs, thread_name_prefix="member")
        self.task_id: str | None = None
        self.step_log = step_log
        self._group_id = ""  # the step log's id of the current group
        self._depth = [0] * num_envs  # steps each member made (the step log's depth)

    # vector API ------------------------------------------------------------------------
    @functools.cached_property
    def observation_space(self) -> gym.Space:
        """The members' observation spaces batched (made when first asked for: a desktop's
        screenshot bounds batched for G members are G x 6 MB twice, and most runs never ask)."""
        return batch_space(self.single_observation_space, self.num_envs)

    @functools.cached_property
    def action_space(self) -> gym.Space:
        return batch_space(self.single_action_space, self.num_envs)

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        """Set the task up once in the root workspace and fork the G members from it (the
        root's workspace is then closed unless ``park_root`` is False)."""
        self._close_members()
        obs, info = self._reset_root(seed if isinstance(seed, int) else None, options)
        self.task_id = info.get("task_id")
        root = self.root.unwrapped
        if self.park_root and not self.lazy:
            self._park_root()  # its state (the reset snapshot, or one dump) is what the members fork
        members = root.clone(self.num_envs, lazy=self.lazy)
        if self.park_root and self.lazy and members:
            self._park_root(members[0]._pending)  # the root keeps the state its members fork
        for i, env in enumerate(members):
            for wrap in self.wrappers:
                env = wrap(env)
            members[i] = env
            if hasattr(env, "start_episode"):
                env.start_episode(obs, info)
        self.members = members
        self.active[:] = True
        self._depth = [0] * self.num_envs
        if self.step_log is not None:
            self._group_id = self.step_log.group(task=self.task_id or "", members=self.num_envs,
                                                 instruction=info.get("instruction") or "", obs=obs)
        self._last = [(obs, 0.0, False, False, dict(info)) for _ in members]
        return self._batch_obs([obs] * self.num_envs), {"task_id": self.task_id, "instruction": info.get("instruction")}

    def _park_root(self, state: Any = None) -> None:
        try:
            self.root.unwrapped.park(state)
        except Exception:  # noqa: BLE001 - the members fork anyway (from a live root): it costs memory only
            log.exception("group %s: closing the root's workspace failed; it stays up", self.task_id)

    def _reset_root(self, seed: int | None, options: dict | None) -> tuple[Any, dict]:
        """The root's reset: the task set up in its workspace; with a cache that keeps the
        task's start (an earlier group's set-up, which the members would fork anyway), that
        start as it is, with its reset's observation and info: no set-up runs."""
        kept = self.cache.kept_start(self.root, options) if self.cache is not None else None
        if kept is None:
            return self.root.reset(seed=seed, options=options)
        start, obs, info = kept
        self.root.unwrapped.reset_to(start, seed=seed)
        return obs, info

    def step(self, actions):
        """Step every active member with its action (members that finished are skipped and
        keep reporting their final step with reward 0)."""
        actions = list(actions)
        futures = {i: self._pool.submit(_timed, self.members[i].step, actions[i])
                   for i in range(self.num_envs) if self.active[i]}
        rewards = np.zeros(self.num_envs)
        for i, fut in futures.items():
            try:
                (obs, reward, term, trunc, info), tool_s = fut.result()
            except Exception as e:  # noqa: BLE001 - one member's failure ends that member only
                (obs, reward, term, trunc, info), tool_s = self._failed_step(i, e), 0.0
            self._record(i, actions[i], (obs, reward, term, trunc, info), tool_s, None)
            self._last[i] = (obs, reward, term, trunc, info)
            rewards[i] = reward
            if term or trunc:
                self.active[i] = False
        obs = [last[0] for last in self._last]
        terms = np.array([last[2] for last in self._last])
        truncs = np.array([last[3] for last in self._last])
        infos = {"active": self.active.copy(), "member_info": [last[4] for last in self._last]}
        return self._batch_obs(obs), rewards, terms, truncs, infos

    def run_group(self, policy: Policy, *, options: dict | None = None, max_steps: int | None = None,
                  on_step: Callable[[int, Step], None] | None = None) -> list[Trajectory]:
        """Run the whole group against a policy: each member in its own thread, policy call
        (think time) and tool call alternating, until every member has finished.

        Args:
            policy: ``policy(member, observation, history) -> action``; ``history`` is the
                member's list of :class:`Step` so far.
            options: reset options (the task); omit to run on the current reset.
            max_steps: optional cap below the task's own.
            on_step: called after each step (progress reporting, logging).
        """
        if options is not None or not self.members:
            self.reset(options=options)
        first_obs = self._last[0][0]

        def episode(i: int) -> Trajectory:
            env, traj = self.members[i], Trajectory(i, self.task_id or "", first_obs)
            obs, t_start = first_obs, time.perf_counter()
            while self.active[i] and (max_steps is None or len(traj.steps) < max_steps):
                t0 = t1 = time.perf_counter()
                action = None
                try:
                    action = policy(i, obs, traj.steps)
                    t1 = time.perf_counter()
                    obs, reward, term, trunc, info = env.step(action)
                except Exception as e:  # noqa: BLE001 - the member fails, the group goes on
                    traj.error, traj.exception = info_error(e), e
                    obs, reward, term, trunc, info = self._failed_step(i, e)
                if info.get("workspace_failed") and traj.error is None:
                    traj.error = info.get("error")
                step = Step(action, obs, float(reward), term, trunc, info, t1 - t0, time.perf_counter() - t1)
                traj.steps.append(step)
                self._record(i, action, (obs, reward, term, trunc, info), step.tool_s, step.think_s)
                self._last[i] = (obs, reward, term, trunc, info)
                if on_step:
                    on_step(i, step)
                if term or trunc:
                    self.active[i] = False
            traj.wall_s = time.perf_counter() - t_start
            if self.step_log is not None:
                self.step_log.end(self._group_id, i, reward=traj.reward, steps=len(traj.steps), wall_s=traj.wall_s,
                                  error=traj.error)
            return traj

        return list(self._pool.map(episode, range(self.num_envs)))

    def _record(self, i: int, action: Any, result: tuple, tool_s: float, think_s: float | None) -> None:
        """Member ``i``'s step in the step log, if there is one (a recording failure is logged
        and the rollout goes on: the log is for looking at, not for training)."""
        depth, self._depth[i] = self._depth[i], self._depth[i] + 1
        if self.step_log is None:
            return
        obs, reward, term, trunc, info = result
        env = self.members[i] if i < len(self.members) else None
        try:
            sig = signature(action, env) if env is not None and action is not None else None
        except Exception:  # noqa: BLE001 - an action the signature cannot parse is logged by its text
            sig = None
        try:
            self.step_log.step(self._group_id, i, depth, action=action, obs=obs, reward=reward, terminated=term,
                               truncated=trunc, info=info, duration=tool_s,
                               think_s=think_s, signature=sig, episode=getattr(env, "episode", None))
        except Exception:  # noqa: BLE001
            log.exception("group %s, member %d: recording step %d in the step log failed", self.task_id, i, depth)

    def _failed_step(self, i: int, error: Exception) -> tuple:
        """The last step of member ``i`` after it raised: an error observation (its env's, else
        its last one), reward 0, truncated; the member stops."""
        message = info_error(error)
        log.warning("group %s, member %d failed: %s", self.task_id, i, message, exc_info=error)
        self.active[i] = False
        try:
            obs = self.members[i].unwrapped.error_observation(printable(message))
        except Exception:  # noqa: BLE001 - not a WorkspaceEnv, or it cannot even say that
            obs = self._last[i][0]
        return obs, 0.0, False, True, {"error": message, "member_failed": True, "success": False}

    def close_extras(self, **kwargs: Any) -> None:
        self._close_members()
        self._pool.shutdown(wait=True)
        self.root.close()

    def _close_members(self) -> None:
        for i, env in enumerate(self.members):
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a failed member must not keep the others open
                log.exception("group %s: closing member %d failed", self.task_id, i)
        self.members = []
        self.active[:] = False

    def _batch_obs(self, observations: list) -> Any:
        out = create_empty_array(self.single_observation_space, self.num_envs)
        return concatenate(self.single_observation_space, observations, out)


def _timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def info_error(error: BaseException) -> str:
    """A failure as the ``error`` text of a step's info."""
    return f"member failed: {type(error).__name__}: {error}"
