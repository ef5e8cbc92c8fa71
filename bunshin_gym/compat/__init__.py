"""Faithful interfaces of other benchmarks (OSWorld, BrowserGym) over bunshin-gym envs."""
