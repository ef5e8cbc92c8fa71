"""WebArena task configs, loaded as they are (``config_files/<task_id>.json`` of WebArena).

A config names its ``sites`` (``shopping``), a ``start_url`` with placeholders
(``__SHOPPING__``; several start tabs are joined by `` |AND| ``), ``require_login`` and an
``eval`` block (see :mod:`bunshin_gym.envs.webarena.evaluators`). The placeholders are mapped
to the workspace's sites; ``require_login`` loads the site's stored session (its
``auth_state`` file inside the workspace) whatever ``storage_state`` path the config
names. ``geolocation`` and ``require_reset`` need nothing: every episode starts from the
booted snapshot.

The shipped tasks (``envs/webarena/tasks/<task_id>.json``) add one key, ``oracle``: a
scripted solution, a list of action strings whose elements are named by tree line
(``click [link 'My Account']``), resolved at each step against the live page.

Example:
    >>> task = load_task("webarena/1001", {"__SHOPPING__": "http://127.0.0.1:7770"})
    >>> task.instruction
    'What is the price of ...'
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from bunshin_gym.core.task import Task, TaskError, check_max_steps, field, identify, read_task_file
from bunshin_gym.envs.webarena import evaluators

TASKS_DIR = Path(__file__).parent / "tasks"
REQUIRED = ("task_id", "sites", "start_url", "intent", "eval")


def placeholder(site: str) -> str:
    """``shopping`` -> ``__SHOPPING__`` (WebArena's naming)."""
    return f"__{site.upper()}__"


class WebArenaTask(Task):
    """One WebArena config.

    Args:
        config: the config dict, as in WebArena's ``config_files``.
        site_urls: placeholder -> URL of the site in the workspace.
    """

    def __init__(self, config: dict, site_urls: dict[str, str], source: str | None = None):
        config, where = identify(config, "WebArena", source, "task_id")
        missing = [k for k in REQUIRED if k not in config]
        if missing:
            raise TaskError(f"{where}: missing keys {missing}")
        task_id = field(config, "task_id", (int, str), where, required=True)
        intent = field(config, "intent", str, where, required=True)
        field(config, "sites", list, where, required=True, items=str)
        field(config, "start_url", str, where, required=True)
        field(config, "eval", dict, where, required=True)
        field(config["eval"], "eval_types", list, f"{where}: eval", items=str)
        field(config, "oracle", list, where, items=str)
        super().__init__(f"webarena/{task_id}", intent, check_max_steps(config.get("max_steps", 30), where), config)
        self.site_urls = dict(site_urls)
        for site in config["sites"]:
            if placeholder(site) not in self.site_urls:
                raise TaskError(f"task {self.id} uses site {site!r} ({placeholder(site)}) but the env serves only "
                                f"{sorted(self.site_urls)}; configure it with sites={{{site!r}: Site(...)}}")
        ev = config["eval"]
        unknown = set(ev.get("eval_types") or []) - {"string_match", "url_match", "program_html"}
        if unknown:
            raise TaskError(f"task {self.id}: unsupported eval types {sorted(unknown)}")

    @property
    def require_login(self) -> bool:
        return bool(self.config.get("require_login"))

    def resolve(self, text: str) -> str:
        """The text with every site placeholder replaced by its URL."""
        for ph, url in self.site_urls.items():
            text = text.replace(ph, url.rstrip("/"))
        return text

    def start_urls(self) -> list[str]:
        return [self.resolve(u.strip()) for u in str(self.config["start_url"]).split(" |AND| ") if u.strip()]

    def setup(self, env: Any) -> None:
        env.open_start_pages(self)

    def validate(self, env: Any) -> float:
        return evaluators.evaluate(self.config, env.answer, env.page, self.resolve, env.eval_helpers(self))

    def oracle(self) -> list[str] | None:
        actions = self.config.get("oracle")
        return [self.resolve(a) for a in actions] if actions else None


@cache
def _shipped_index() -> dict[str, Path]:
    index = {}
    for p in sorted(TASKS_DIR.glob("*.json")):
        index[str(json.loads(p.read_text())["task_id"])] = p
    return index


def shipped_task_ids() -> list[str]:
    """Ids (``webarena/<task_id>``) of the tasks shipped in ``envs/webarena/tasks``."""
    return [f"webarena/{k}" for k in sorted(_shipped_index(), key=lambda k: (len(k), k))]


def load_config(spec: Any) -> dict:
    """A config dict from a dict, a shipped id (``webarena/1001``, ``1001``) or a JSON path."""
    if isinstance(spec, dict):
        return spec
    text = str(spec)
    if text.endswith(".json") and Path(text).exists():
        return read_task_file(text)
    key = text.removeprefix("webarena/")
    path = _shipped_index().get(key)
    if path is None:
        raise TaskError(f"no WebArena task {spec!r}: give a config dict, a JSON path or one of the shipped ids "
                        f"({', '.join(shipped_task_ids()[:5])}, ... {len(_shipped_index())} in all)")
    return read_task_file(path)


def load_task(spec: Any, site_urls: dict[str, str]) -> WebArenaTask:
    return spec if isinstance(spec, WebArenaTask) else WebArenaTask(load_config(spec), site_urls)
