"""Every env id of bunshin-gym, registered in this one place (imported by ``bunshin_gym``).

The envs are registered without gymnasium's default wrappers (OrderEnforcing,
PassiveEnvChecker, TimeLimit): a ``WorkspaceEnv`` enforces order and truncation itself,
and ``gym.make`` then returns the env with ``clone``/``snapshot``/``rollback`` in reach.
"""

from __future__ import annotations

import gymnasium as gym

ENVS = {
    "Bunshin-Shell-v0": "bunshin_gym.envs.shell.env:ShellEnv",
    "Bunshin-OSWorld-v0": "bunshin_gym.envs.osworld.env:OSWorldEnv",
    "Bunshin-WebArena-v0": "bunshin_gym.envs.webarena.env:WebArenaEnv",
}


def group_creator(env_id: str):
    """The vector entry point of ``env_id``: ``gym.make_vec(env_id, num_envs=G,
    vectorization_mode="vector_entry_point", **kwargs)`` builds one GRPO group
    (:class:`~bunshin_gym.rollout.group.GroupVectorEnv`) of that env."""

    def create(num_envs: int, **kwargs):
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
