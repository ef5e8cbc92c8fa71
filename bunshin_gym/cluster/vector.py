"""``ClusterGroupVectorEnv``: one GRPO group on a host of a :class:`BunshinCluster`, driven
from the caller like the local :class:`~bunshin_gym.rollout.group.GroupVectorEnv`.

    >>> envs = gym.make_vec("Bunshin-Shell-v0", num_envs=4, vectorization_mode="vector_entry_point",
    ...                     cluster=cluster)
    >>> obs, infos = envs.reset(options={"task": "shell/count-files"})   # placed, then forked there
    >>> trajs = envs.run_group(policy)

The group lives whole on one host (a ``GroupVectorEnv`` inside its :class:`HostActor`: root
workspace and G forks there); each ``reset``/``step``/``run_group`` is one call to that actor,
so observations, rewards and infos are the local group's. The host is chosen by the cluster's
placement at each ``reset`` that names a task (its own load not counted): the group moves
(closed there, opened on the new host: its workspaces are made at reset anyway) only when the
placement names another host for a cached prefix of the task, or its host died.

``run_group``'s policy runs on the host (it must pickle) and ``on_step`` is called on the
caller's side once the group is done, member by member in step order (the steps happen on
the host). A host that dies fails the call with :class:`HostLost`; the cluster drops it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from bunshin_gym.cluster.placement import Decision
from bunshin_gym.errors import BunshinError

log = logging.getLogger(__name__)


class HostLost(BunshinError, RuntimeError):
    """The host of a cluster group died: the group's members are lost with it."""


class ClusterGroupVectorEnv(VectorEnv):
    """A GRPO group of ``num_envs`` members on one host of ``cluster``.

    Args:
        cluster: a :class:`~bunshin_gym.cluster.cluster.BunshinCluster`.
        env_id: the single env's id.
        num_envs: group size G.
        prefix_cache: serve the members from their host's prefix cache (the cluster's index
            then learns what the group cached, for later placements).
        prefix: call signatures the group is known to start with (placement).
        speculation: run speculative tool execution on the host, with a selector trained on
            the host's trajectory log (as :meth:`HostActor.run_group` does; nothing is
            speculated until that log holds trajectories).
        **env_kwargs: passed to ``gym.make(env_id, ...)`` on the host (they must pickle).
    """

    metadata = {"autoreset_mode": AutoresetMode.DISABLED}

    def __init__(self, cluster: Any, env_id: str, num_envs: int, *, prefix_cache: bool = False,
                 prefix: Sequence[str] = (), speculation: bool = False, **env_kwargs: Any):
        if num_envs < 1:
            raise ValueError(f"a group needs num_envs >= 1, got {num_envs}")
        if not isinstance(speculation, bool):
            raise ValueError("speculation= is True or False on a cluster: the host trains its own selector")
        for key in ("cache", "member_wrappers", "step_log"):
            if env_kwargs.get(key) is not None:
                raise ValueError(f"{key}= is a local object: a cluster group uses its host's (prefix_cache=True)")
        self.cluster, self.env_id, self.num_envs = cluster, env_id, num_envs
        self.prefix_cache, self.prefix, self.speculation = prefix_cache, tuple(prefix), speculation
        self.env_kwargs = env_kwargs
        self.host: str | None = None
        self.decision: Decision | None = None
        self.task_id: str | None = None
        self.active = np.zeros(num_envs, dtype=bool)
        self._gid: str | None = None
        task = env_kwargs.get("task")
        self._open(self.cluster.place(task if isinstance(task, str) else ""))

    # placement -------------------------------------------------------------------------
    def _open(self, decision: Decision) -> None:
        out = self._call(self.cluster.hosts[decision.host].open_group, self.env_id, self.num_envs,
                         prefix_cache=self.prefix_cache, speculation=self.speculation, env_kwargs=self.env_kwargs,
                         host=decision.host)
        self.host, self.decision, self._gid = decision.host, decision, out["id"]
        self.single_observation_space = out["observation_space"]
        self.single_action_space = out["action_space"]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        log.info("group %s of %s on host %s (%s)", self._gid, self.env_id, self.host, decision.reason)

    def _place(self, task: str) -> None:
        """Move the group to the host the placement names for ``task``, when that is a cached
        prefix elsewhere (or its host is gone)."""
        loads = self.cluster.loads()
        if self.host in loads:
            loads[self.host] -= 1  # this group's own load
        decision = self.cluster.place(task, self.prefix, loads=loads)
        if decision.host == self.host:
            self.decision = decision
            return
        if self.host in loads and decision.reason != "prefix" and not decision.migrate_from:
            return  # no cache to go to: the group stays where it is
        self._close_remote()
        self._open(decision)

    # vector API ------------------------------------------------------------------------
    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        """Place the group (by ``options["task"]``), then set the task up on its host and fork
        the G members there."""
        task = (options or {}).get("task")
        if isinstance(task, str) or self.host not in self.cluster.alive:
            self._place(task if isinstance(task, str) else "")
        obs, info = self._host_call("group_reset", seed, options)
        self.task_id = info.get("task_id")
        self.active[:] = True
        self._learn()
        return obs, info

    def step(self, actions):
        obs, rewards, terms, truncs, infos, active = self._host_call("group_step", list(actions))
        self.active[:] = active
        return obs, rewards, terms, truncs, infos

    def run_group(self, policy: Callable[[int, Any, list], Any], *, options: dict | None = None,
                  max_steps: int | None = None, on_step: Callable[[int, Any], None] | None = None) -> list:
        """:meth:`GroupVectorEnv.run_group <bunshin_gym.rollout.group.GroupVectorEnv.run_group>`
        on the group's host (``policy`` runs there); ``on_step`` is called here afterwards."""
        if options is not None:
            task = options.get("task")
            if isinstance(task, str) or self.host not in self.cluster.alive:
                self._place(task if isinstance(task, str) else "")
        out = self._host_call("group_run", policy, options, max_steps)
        self.task_id, self.active[:] = out["task_id"], out["active"]
        self._learn()
        trajs = out["trajectories"]
        if on_step is not None:
            for traj in trajs:
                for step in traj.steps:
                    on_step(traj.member, step)
        return trajs

    def close_extras(self, **kwargs: Any) -> None:
        self._close_remote()

    # calls to the host -----------------------------------------------------------------
    def _host_call(self, method: str, *args: Any) -> Any:
        if self._gid is None:
            raise RuntimeError("the cluster group is closed")
        return self._call(getattr(self.cluster.hosts[self.host], method), self._gid, *args, host=self.host)

    def _call(self, method: Any, *args: Any, host: str, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(method.remote(*args, **kwargs))
        except RayActorError as e:
            self.cluster._host_died(host, e)
            if host == self.host:
                self._gid, self.active[:] = None, False
            raise HostLost(f"host {host} of the group died: its members are lost ({e.__class__.__name__})") from e

    def _learn(self) -> None:
        """What the group cached on its host, into the cluster's index."""
        if self.prefix_cache:
            self.cluster.apply_events(self.host)

    def _close_remote(self) -> None:
        gid, self._gid = self._gid, None
        if gid is None or self.host not in self.cluster.alive:
            return
        try:
            self._call(self.cluster.hosts[self.host].close_group, gid, host=self.host)
            self._learn()
        except HostLost:
            log.warning("group %s: its host %s died before it was closed", gid, self.host)
