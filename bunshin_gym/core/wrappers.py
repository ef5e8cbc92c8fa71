"""``BunshinWrapper``: the base of wrappers over bunshin envs; it forwards the fork methods.

gymnasium wrappers do not forward unknown attributes, so ``clone``, ``snapshot`` and
``rollback`` of a ``WorkspaceEnv`` would be hidden under a plain ``gym.Wrapper``. Wrappers
derived from this class forward them; :func:`fork_api` reaches them through any wrapper
stack, gymnasium's own wrappers included.

Example:
    >>> class CountSteps(BunshinWrapper):
    ...     def step(self, action):
    ...         self.n = getattr(self, "n", 0) + 1
    ...         return self.env.step(action)
    >>> env = CountSteps(gym.make("Bunshin-Shell-v0"))
    >>> env.reset(options={"task": "shell/count-files"})
    >>> a, b = env.clone(2)          # two CountSteps-wrapped clones
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym


class BunshinWrapper(gym.Wrapper):
    """A ``gym.Wrapper`` whose ``clone``/``snapshot``/``rollback`` reach the workspace env."""

    def clone(self, n: int = 1, **kwargs: Any) -> list[gym.Env]:
        """Clones of the inner env, each wrapped like this one (see :meth:`_rewrap`)."""
        return [self._rewrap(inner) for inner in fork_api(self.env).clone(n, **kwargs)]

    def snapshot(self, **kwargs: Any):
        return fork_api(self.env).snapshot(**kwargs)

    def rollback(self, snapshot=None, **kwargs: Any) -> Any:
        return fork_api(self.env).rollback(snapshot, **kwargs)

    def _rewrap(self, inner: gym.Env) -> gym.Env:
        """This wrapper around a clone of the inner env. The default is a shallow copy (state
        shared by reference, e.g. a cache, stays shared); override for per-episode state."""
        twin = copy.copy(self)
        twin.env = inner
        return twin


class _ForkAPI:
    def __init__(self, env: gym.Env):
        self._env = env

    def clone(self, n: int = 1, **kwargs: Any) -> list[gym.Env]:
        return self._env.get_wrapper_attr("clone")(n, **kwargs)

    def snapshot(self, **kwargs: Any):
        return self._env.get_wrapper_attr("snapshot")(**kwargs)

    def rollback(self, snapshot=None, **kwargs: Any):
        return self._env.get_wrapper_attr("rollback")(snapshot, **kwargs)


def fork_api(env: gym.Env) -> Any:
    """The fork methods of ``env`` through any wrappers: ``fork_api(env).clone(2)``.

    A ``BunshinWrapper`` on top answers itself (so clones come back wrapped); otherwise
    the call goes to the innermost env that has the method.
    """
    if isinstance(env, BunshinWrapper) or not isinstance(env, gym.Wrapper):
        return env
    return _ForkAPI(env)
