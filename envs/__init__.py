"""Env families, importable as ``bunshin_gym.envs.<family>``: shell, osworld, webarena.

Each family keeps its image recipe (``image.toml``), task suite (``tasks/``) and code together.
"""
