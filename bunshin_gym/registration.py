"""Every env id of bunshin-gym, registered in this one place (imported by ``bunshin_gym``).

The envs are registered without gymnasium's default wrappers (OrderEnforcing,
PassiveEnvChecker, TimeLimit): a ``WorkspaceEnv`` enforces order and truncation itself,
and ``gym.make`` then returns the env with ``clone``/``snapshot``/``rollback`` in reach.
"""

from __future__ import annotations

import gymnasium as gym

#: the env classes, by id
CLASSES = {
    "Bunshin-Shell-v0": "bunshin_gym.envs.shell.env:ShellEnv",
    "Bunshin-OSWorld-v0": "bunshin_gym.envs.osworld.env:OSWorldEnv",
    "Bunshin-WebArena-v0": "bunshin_gym.envs.webarena.env:WebArenaEnv",
}


def _creator(env_id: str):
    """The entry point of ``env_id``: the env class, or with ``server=URL`` a
    :class:`~bunshin_gym.remote.RemoteEnv` of that env on a ``bunshin serve`` server."""

    def make(server: str | None = None, **kwargs):
        if server is not None:
            from bunshin_gym.remote import RemoteEnv

            return RemoteEnv(env_id, server, **kwargs)
        return gym.envs.registration.load_env_creator(CLASSES[env_id])(**kwargs)

    return make


make_shell = _creator("Bunshin-Shell-v0")
make_osworld = _creator("Bunshin-OSWorld-v0")
make_webarena = _creator("Bunshin-WebArena-v0")
#: the entry points, by id
ENVS = {
    "Bunshin-Shell-v0": f"{__name__}:make_shell",
    "Bunshin-OSWorld-v0": f"{__name__}:make_osworld",
    "Bunshin-WebArena-v0": f"{__name__}:make_webarena",
}


def group_creator(env_id: str):
    """The vector entry point of ``env_id``: ``gym.make_vec(env_id, num_envs=G,
    vectorization_mode="vector_entry_point", **kwargs)`` builds one GRPO group
    (:class:`~bunshin_gym.rollout.group.GroupVectorEnv`) of that env; with ``cluster=C`` (a
    :class:`~bunshin_gym.cluster.BunshinCluster`) the group lives on one host of C, chosen by
    its placement (:class:`~bunshin_gym.cluster.vector.ClusterGroupVectorEnv`)."""

    def create(num_envs: int, cluster=None, **kwargs):
        if cluster is not None:
            from bunshin_gym.cluster.vector import ClusterGroupVectorEnv

            return ClusterGroupVectorEnv(cluster, env_id, num_envs, **kwargs)
        from bunshin_gym.rollout.group import GroupVectorEnv

        return GroupVectorEnv(env_id, num_envs, **kwargs)

    create.env_id = env_id
    return create


def register_envs() -> None:
    for env_id, entry_point in ENVS.items():
        if env_id in gym.registry:
            continue
        gym.register(
            id=env_id,
            entry_point=entry_point,
            vector_entry_point=group_creator(env_id),
            order_enforce=False,
            disable_env_checker=True,
            kwargs={},
        )
