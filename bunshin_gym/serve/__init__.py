"""``bunshin serve``: bunshin workspaces and envs as a network service.

- an E2B-compatible sandbox API (the ``e2b`` SDK from PyPI works against it: point
  ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` at the server and use a token as ``E2B_API_KEY``),
  with fork (one freeze, N copies) and pause/resume keeping memory;
- the env API behind :class:`bunshin_gym.remote.RemoteEnv` (``gym.make(ID, server=URL)``).

See the README section "bunshin serve" for what works and what does not.
"""

__all__ = ["ServeConfig", "create_app", "run"]


def __getattr__(name: str):
    # lazily: `bunshin` builds its parser from bunshin_gym.serve.__main__ on every command,
    # and must not pay for importing FastAPI and the e2b SDK then
    if name in __all__:
        from bunshin_gym.serve import app

        return getattr(app, name)
    raise AttributeError(name)
