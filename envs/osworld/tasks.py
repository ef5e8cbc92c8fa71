"""OSWorld tasks as they are: the JSON format, config steps, getters and the evaluator.

A task file (``envs/osworld/tasks/<domain>/<id>.json`` for the shipped ones) has OSWorld's
keys ``id, snapshot, instruction, source, config, related_apps, evaluator`` (plus
``trajectory``, ``proxy``, ignored). bunshin adds one optional key: ``oracle``, a scripted
solution as a list of actions in the ``pyautogui`` action space.

Config steps (``config`` and ``evaluator.postconfig``): launch, open, execute, command,
sleep, activate_window, chrome_open_tabs, chrome_close_tabs, download. ``download`` and
the ``cloud_file`` / ``cache_file`` getters resolve urls from local cache directories (see
:class:`FileCache`); a missing url is an error naming it. Getters: vm_command_line,
vm_command_error, vm_terminal_output, vm_file, cloud_file, cache_file, list_directory, rule,
vm_screen_size, accessibility_tree, open_tabs_info, active_tab_info, active_url_from_accessTree,
enable_do_not_track, bookmarks. Metrics: :mod:`bunshin_gym.envs.osworld.metrics`. Anything
else is a :class:`TaskError` naming it when the task is loaded, never a silent pass.

Example:
    >>> task = load_task("osworld/terminal-mkdir-projects")
    >>> task.instruction
    'Create a folder named projects in my home directory.'
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bunshin_gym.core.task import Task, TaskError, check_max_steps, field, identify, read_task_file
from bunshin_gym.envs.osworld import desktop
from bunshin_gym.envs.osworld.metrics import METRICS
from bunshin_gym.workspace import pristine

HERE = Path(__file__).parent
TASKS_DIR = HERE / "tasks"
ASSETS_DIR = HERE / "assets"
PASSWORD = "password"

# the app that ``open`` starts for a file, by extension (else the text editor)
OPENERS = {
    **dict.fromkeys((".xlsx", ".xls", ".ods", ".csv", ".docx", ".doc", ".odt", ".pptx", ".odp"), "libreoffice"),
    **dict.fromkeys((".html", ".htm", ".pdf", ".svg"), "chromium"),
}
CSV_FILTER = "--infilter=CSV:44,34,76,1"


class FileCache:
    """Where ``download`` urls come from: local directories, searched in order.

    A directory maps a url to a file by its ``index.json`` (``{url: relative path}``), or by
    OSWorld's own cache naming ``<uuid5(NAMESPACE_URL, url)>_<basename of the target>``
    (directly or under ``<task id>/``), so an OSWorld cache directory works as it is.
    """

    def __init__(self, dirs: list[str | Path]):
        self.dirs = [Path(d) for d in dirs]

    def resolve(self, url: str, target_name: str = "", task_id: str = "") -> Path:
        tried = []
        for d in self.dirs:
            index = d / "index.json"
            if index.exists():
                rel = json.loads(index.read_text()).get(url)
                if rel is not None and (d / rel).is_file():
                    return d / rel
            base = Path(target_name).name
            name = f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{base}"
            cands = [d / name, d / task_id / name] + ([d / task_id / base] if task_id and base else [])
            for cand in cands:
                if cand.is_file():
                    return cand
            tried.append(str(d))
        raise TaskError(f"download: url {url!r} is not in the local cache (looked in {', '.join(tried)}); "
                        f"put the file there (index.json or OSWorld's <uuid5>_{Path(target_name).name} name)")


# config steps ------------------------------------------------------------------------------
def _placeholders(text: str, env: Any) -> str:
    w, h = env.screen_size
    for k, v in {"{CLIENT_PASSWORD}": PASSWORD, "{SCREEN_WIDTH}": w, "{SCREEN_HEIGHT}": h,
                 "{SCREEN_WIDTH_HALF}": w // 2, "{SCREEN_HEIGHT_HALF}": h // 2}.items():
        text = text.replace(k, str(v))
    return text


def _command(params: dict, env: Any) -> str | list[str]:
    cmd = params["command"]
    if isinstance(cmd, str):
        cmd = _placeholders(cmd, env)
        return cmd if params.get("shell", True) or " " in cmd else [cmd]
    cmd = [_placeholders(str(c), env) for c in cmd]
    return shlex.join(cmd) if params.get("shell") else cmd


def _home_path(path: str) -> str:
    path = os.path.expanduser(path.replace("~", desktop.HOME, 1)) if path.startswith("~") else path
    return path if path.startswith("/") else f"{desktop.HOME}/{path}"


def step_launch(env: Any, p: dict) -> None:
    env.workspace_spawn(_command(p, env))


def step_execute(env: Any, p: dict) -> None:
    res = desktop.session_run(env.workspace, _command(p, env), timeout=float(p.get("timeout", 120)))
    env.setup_log.append({"execute": p["command"], "exit_code": res.exit_code,
                          "stderr": res.stderr.decode(errors="replace")[-500:]})


def step_sleep(env: Any, p: dict) -> None:
    time.sleep(float(p["seconds"]))


def step_open(env: Any, p: dict) -> None:
    path = _home_path(p["path"])
    ext = Path(path).suffix.lower()
    app = OPENERS.get(ext, "mousepad")
    argv = [app, path]
    if app == "libreoffice":
        argv = ["libreoffice", "--nologo", "--norestore", *([CSV_FILTER] if ext == ".csv" else []), path]
    env.workspace_spawn(argv)
    if not desktop.wait_window(env.workspace, Path(path).name, float(p.get("timeout", 90))):
        raise TaskError(f"open: no window for {path} appeared (started {argv[0]})")
    time.sleep(float(p.get("settle", 1.0)))


def step_activate_window(env: Any, p: dict) -> None:
    name = p["window_name"]
    flags = ["-x"] if p.get("by_class") else []
    flags += ["-F"] if p.get("strict") else []
    res = env.workspace.exec(["wmctrl", *flags, "-a", name], user=desktop.USER, env=desktop.DESKTOP_ENV, timeout=10)
    env.setup_log.append({"activate_window": name, "exit_code": res.exit_code})


def step_download(env: Any, p: dict) -> None:
    for f in p["files"]:
        url, path = f.get("url"), f.get("path")
        if not url or not path:
            raise TaskError(f"download: a file entry needs url and path, got {f!r}")
        src = env.cache.resolve(url, path, env.task.id if env.task else "")
        target = _home_path(path)
        parent = str(Path(target).parent)
        if parent.startswith(desktop.HOME):  # folders the user can write into, as a download makes
            env.workspace.exec(["mkdir", "-p", parent], user=desktop.USER, check=True)
        env.workspace.write_file(target, src.read_bytes(), owner=desktop.USER)


def _cdp(env: Any, path: str, timeout: float = 10.0, checker: bool = False) -> Any:
    """A DevTools HTTP endpoint of the workspace's chromium (port 9222 on its loopback).

    ``checker``: for a getter, fetch it with the image's python3 from outside the workspace
    (:func:`_checker_run`, in the workspace's network namespace), not the workspace's own."""
    code = ("import sys,urllib.request;sys.stdout.write(urllib.request.urlopen("
            f"'http://127.0.0.1:9222{path}', timeout={timeout}).read().decode())")
    if checker:
        res = _checker_run(env, ["python3", "-c", code], timeout=timeout + 5, workspace_net=True)
    else:
        res = env.workspace.exec(["python3", "-c", code], user=desktop.USER, timeout=timeout + 5)
    if not res.ok:
        return None
    try:
        return json.loads(res.text)
    except json.JSONDecodeError:
        return res.text


def _pages(env: Any, checker: bool = False) -> list[dict] | None:
    tabs = _cdp(env, "/json/list", checker=checker)
    if not isinstance(tabs, list):
        return None
    return [t for t in tabs if t.get("type") == "page"]


def step_chrome_open_tabs(env: Any, p: dict) -> None:
    urls = list(p["urls_to_open"])
    if _pages(env) is None:
        env.workspace_spawn(["chromium", *urls])
        if not desktop.wait_window(env.workspace, "Chromium", 90):
            raise TaskError("chrome_open_tabs: chromium did not start")
    else:
        for url in urls:
            _cdp(env, f"/json/new?{url}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pages = _pages(env) or []
        if all(any(t["url"].rstrip("/") == u.rstrip("/") for t in pages) for u in urls):
            time.sleep(0.5)
            return
        time.sleep(0.3)
    raise TaskError(f"chrome_open_tabs: tabs {urls} did not load")


def step_chrome_close_tabs(env: Any, p: dict) -> None:
    for url in p["urls_to_close"]:
        for t in _pages(env) or []:
            if t["url"].rstrip("/") == url.rstrip("/"):
                _cdp(env, f"/json/close/{t['id']}")
                break


CONFIG_STEPS: dict[str, Callable[[Any, dict], None]] = {
    "launch": step_launch,
    "open": step_open,
    "execute": step_execute,
    "command": step_execute,
    "sleep": step_sleep,
    "activate_window": step_activate_window,
    "download": step_download,
    "chrome_open_tabs": step_chrome_open_tabs,
    "chrome_close_tabs": step_chrome_close_tabs,
}


def run_config(env: Any, steps: list[dict], where: str) -> None:
    for i, step in enumerate(steps):
        fn = CONFIG_STEPS[step["type"]]
        try:
            fn(env, step.get("parameters", {}))
        except TaskError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise TaskError(f"{where}[{i}] ({step['type']}): bad parameters: {e}") from e


# getters -------------------------------------------------------------------------------------
def _local(env: Any, name: str) -> Path:
    return Path(env.eval_dir) / Path(name).name


def _checker_run(env: Any, cmd: str | list[str], timeout: float = 60.0, workspace_net: bool = False) -> Any:
    """Run a getter's command over the workspace's files with the image's binaries, outside the
    workspace (:mod:`bunshin_gym.workspace.pristine`): a policy with sudo may have replaced
    ``cat``, ``python3`` or the loader inside, and those must not produce the evaluated value.
    It runs in the user's home with ``HOME`` set to it, as OSWorld's commands expect (``~``),
    but not in the desktop session: a getter command cannot talk to the workspace's X server
    or session bus (none of the shipped tasks needs to)."""
    line = cmd if isinstance(cmd, str) else shlex.join(cmd)
    return pristine.run(env.workspace, line, cwd=desktop.HOME, home=desktop.HOME, user=desktop.USER,
                        timeout=timeout, workspace_net=workspace_net, freeze=not workspace_net)


def get_vm_command_line(env: Any, c: dict) -> str | None:
    res = _checker_run(env, _command({"command": c["command"], "shell": c.get("shell", False)}, env))
    return res.stdout.decode(errors="replace")


def get_vm_command_error(env: Any, c: dict) -> str | None:
    res = _checker_run(env, _command({"command": c["command"], "shell": c.get("shell", False)}, env))
    return res.stderr.decode(errors="replace")


def get_vm_terminal_output(env: Any, c: dict) -> str | None:
    return env.terminal_output()


def get_vm_file(env: Any, c: dict) -> Any:
    # read through the agent: the bytes are the workspace's data, which the policy controls anyway;
    # no workspace binary computes anything from them (the metrics run here, on the host)
    if c.get("multi"):
        paths, dests = c["path"], c["dest"]
        out = [get_vm_file(env, {"path": p, "dest": d}) for p, d in zip(paths, dests, strict=True)]
        gives = c.get("gives", [0])
        return out[gives[0]] if len(gives) == 1 else [out[i] for i in gives]
    try:
        data = env.workspace.read_file(_home_path(c["path"]))
    except Exception:  # noqa: BLE001 - a missing file scores 0, as in OSWorld
        return None
    local = _local(env, c.get("dest") or c["path"])
    local.write_bytes(data)
    return str(local)


def get_cloud_file(env: Any, c: dict) -> Any:
    if c.get("multi"):
        out = [get_cloud_file(env, {"path": p, "dest": d}) for p, d in zip(c["path"], c["dest"], strict=True)]
        gives = c.get("gives", [0])
        return out[gives[0]] if len(gives) == 1 else [out[i] for i in gives]
    src = env.cache.resolve(c["path"], c.get("dest", ""), env.task.id if env.task else "")
    local = _local(env, c.get("dest") or src.name)
    local.write_bytes(src.read_bytes())
    return str(local)


def get_cache_file(env: Any, c: dict) -> str:
    for d in env.cache.dirs:
        if (d / c["path"]).exists():
            return str(d / c["path"])
    raise TaskError(f"cache_file: {c['path']!r} is not in the local cache")


def get_list_directory(env: Any, c: dict) -> dict | None:
    code = ("import json,os,sys\n"
            "def t(d):\n"
            " out={'type':'directory','name':os.path.basename(d.rstrip('/')),'children':[]}\n"
            " for e in sorted(os.listdir(d)):\n"
            "  p=os.path.join(d,e)\n"
            "  d2=os.path.isdir(p) and not os.path.islink(p)\n"
            "  out['children'].append(t(p) if d2 else {'type':'file','name':e})\n"
            " return out\n"
            "sys.stdout.write(json.dumps(t(sys.argv[1])))\n")
    res = _checker_run(env, ["python3", "-c", code, _home_path(c["path"])], timeout=30)
    return json.loads(res.text) if res.ok else None


def get_rule(env: Any, c: dict) -> Any:
    return c["rules"]


def get_vm_screen_size(env: Any, c: dict) -> dict:
    w, h = env.screen_size
    return {"width": w, "height": h}


def get_accessibility_tree(env: Any, c: dict) -> str:
    return env.accessibility_tree()


def get_open_tabs_info(env: Any, c: dict) -> list | None:
    pages = _pages(env, checker=True)
    # /json/list answers most recently active first; OSWorld lists tabs in strip order,
    # which for tabs opened in sequence is the order they were created (oldest first)
    return None if pages is None else [{"title": t.get("title", ""), "url": t.get("url", "")}
                                       for t in reversed(pages)]


def get_active_tab_info(env: Any, c: dict) -> dict | None:
    """The active tab: the page whose title the chromium window shows (else the newest)."""
    pages = _pages(env, checker=True)
    if not pages:
        return None
    titles = [t for cls, t in desktop.windows(env.workspace) or [] if "chromium" in cls.lower()]
    active = pages[0]
    for title in titles:
        match = [p for p in pages if title in (f"{p.get('title')} - Chromium", p.get("title"))]
        if match:
            active = match[0]
            break
    return {"title": active.get("title", ""), "url": active.get("url", "")}


def get_active_url_from_accessTree(env: Any, c: dict) -> str | None:  # noqa: N802 - OSWorld's name
    info = get_active_tab_info(env, c)
    return None if info is None else info["url"]


PROFILE = f"{desktop.HOME}/.config/chromium-bunshin"


def _chrome_json(env: Any, name: str) -> dict | None:
    try:
        return json.loads(env.workspace.read_file(f"{PROFILE}/Default/{name}"))
    except Exception:  # noqa: BLE001 - absent until chromium writes it
        return None


def get_enable_do_not_track(env: Any, c: dict) -> str:
    prefs = _chrome_json(env, "Preferences") or {}
    return "true" if prefs.get("enable_do_not_track") else "false"


def get_bookmarks(env: Any, c: dict) -> dict | None:
    data = _chrome_json(env, "Bookmarks")
    return None if data is None else data.get("roots")


GETTERS: dict[str, Callable[[Any, dict], Any]] = {
    name[4:]: fn for name, fn in dict(globals()).items() if name.startswith("get_") and callable(fn)
}


# the task ------------------------------------------------------------------------------------
def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


class OSWorldTask(Task):
    """One OSWorld task (see the module docstring for what is supported)."""

    def __init__(self, config: dict, source: str | None = None):
        config, where = identify(config, "osworld", source)
        task_id = field(config, "id", str, where, required=True)
        instruction = field(config, "instruction", str, where, required=True)
        self.evaluator: dict = field(config, "evaluator", dict, where, required=True)
        self.steps_config: list[dict] = list(field(config, "config", list, where, default=[], items=dict))
        field(self.evaluator, "postconfig", list, f"{where}: evaluator", items=dict)
        for kind, steps in (("config", self.steps_config), ("evaluator.postconfig",
                                                           self.evaluator.get("postconfig") or [])):
            for i, step in enumerate(steps):
                field(step, "parameters", dict, f"{where}: {kind}[{i}]")
        field(config, "oracle", list, where)
        super().__init__(task_id, instruction, check_max_steps(config.get("max_steps", 15), where), config)
        self._check()

    def _check(self) -> None:
        where = f"task {self.id}"
        for kind, steps in (("config", self.steps_config), ("postconfig", self.evaluator.get("postconfig") or [])):
            for i, step in enumerate(steps):
                t = step.get("type")
                if t not in CONFIG_STEPS:
                    raise TaskError(f"{where}: {kind}[{i}] has an unsupported config type {t!r} "
                                    f"(supported: {', '.join(sorted(CONFIG_STEPS))})")
        funcs = _as_list(self.evaluator.get("func"))
        for f in funcs:
            if f not in METRICS:
                raise TaskError(f"{where}: unsupported metric {f!r} (supported: {', '.join(sorted(METRICS))})")
        if funcs == ["infeasible"]:
            return
        for key in ("result", "expected"):
            for g in _as_list(self.evaluator.get(key) or []):
                if g is None:
                    continue
                if g.get("type") not in GETTERS:
                    raise TaskError(f"{where}: unsupported getter {g.get('type')!r} in evaluator.{key} "
                                    f"(supported: {', '.join(sorted(GETTERS))})")
        if "result" not in self.evaluator:
            raise TaskError(f"{where}: evaluator has no result")
        if self.evaluator.get("conj", "and") not in ("and", "or"):
            raise TaskError(f"{where}: conj must be 'and' or 'or', not {self.evaluator['conj']!r}")

    @property
    def domain(self) -> str:
        return self.config.get("snapshot", "")

    def setup(self, env: Any) -> None:
        run_config(env, self.steps_config, f"task {self.id}: config")

    def validate(self, env: Any) -> float:
        """The evaluator's score: postconfig, then each metric on its getters' output."""
        funcs = _as_list(self.evaluator["func"])
        last = env.last_action
        if funcs == ["infeasible"]:
            return 1.0 if last == "FAIL" else 0.0
        if last == "FAIL":
            return 0.0
        run_config(env, self.evaluator.get("postconfig") or [], f"task {self.id}: postconfig")
        with tempfile.TemporaryDirectory(prefix="bunshin-osworld-eval-") as d:
            env.eval_dir = d
            try:
                return self._score(env, funcs)
            finally:
                env.eval_dir = None

    def _score(self, env: Any, funcs: list[str]) -> float:
        n = len(funcs)
        results = _as_list(self.evaluator["result"]) if n > 1 else [self.evaluator["result"]]
        expected_cfg = self.evaluator.get("expected")
        expecteds = (_as_list(expected_cfg) if n > 1 else [expected_cfg]) if expected_cfg is not None else [None] * n
        options = self.evaluator.get("options") or ({} if n == 1 else [{}] * n)
        options = _as_list(options) if n > 1 else [options]
        conj = self.evaluator.get("conj", "and")
        scores = []
        for f, rg, eg, opt in zip(funcs, results, expecteds, options, strict=True):
            try:
                result = GETTERS[rg["type"]](env, rg)
            except FileNotFoundError:
                result = None
            kwargs = dict(opt or {})
            if eg is not None:
                expected = GETTERS[eg["type"]](env, eg)
                score = float(METRICS[f](result, expected, **kwargs))
            else:
                score = float(METRICS[f](result, **kwargs))
            scores.append(score)
            if conj == "and" and score == 0.0:
                return 0.0
            if conj == "or" and score == 1.0:
                return 1.0
        return sum(scores) / len(scores) if conj == "and" else max(scores)


def task_paths() -> dict[str, Path]:
    """Shipped task files by id (``osworld/<name>``)."""
    out = {}
    for p in sorted(TASKS_DIR.glob("*/*.json")):
        out[json.loads(p.read_text())["id"]] = p
    return out


def load_task(spec: Any) -> OSWorldTask:
    """A shipped task id, a dict in OSWorld's format, or a path to a JSON file."""
    if isinstance(spec, OSWorldTask):
        return spec
    if isinstance(spec, dict):
        return OSWorldTask(spec)
    if str(spec).endswith(".json") and Path(str(spec)).exists():
        return OSWorldTask(read_task_file(str(spec)), source=str(spec))
    known = task_paths()
    if spec in known:
        return OSWorldTask(read_task_file(known[spec]), source=str(known[spec]))
    raise TaskError(f"no osworld task {spec!r}; shipped tasks: {', '.join(known)}")


def shipped_tasks() -> list[OSWorldTask]:
    return [OSWorldTask(read_task_file(p), source=str(p)) for p in task_paths().values()]

