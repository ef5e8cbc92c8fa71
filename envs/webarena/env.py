"""Bunshin-WebArena-v0: forkable web-shopping workspaces running WebArena tasks.

Each workspace holds the site (One Stop Market: ``envs/webarena/shop``, SQLite), and a
headless Debian chromium driven by playwright from a driver process inside the workspace
(``envs/webarena/driver.py``), so a snapshot, a clone or a rollback carries the database,
the browser, its pages, history and cookies together.

Observation (a dict): ``accessibility_tree`` (WebArena's ``[id] role 'name'`` text),
``url``, ``tabs`` (``Tab 0 (current): title | Tab 1: ...``), ``instruction``,
``last_action_error`` ("" when the last action worked) and, with ``screenshot=True``,
``screenshot`` (H x W x 3 uint8). Action: a WebArena action string (see
:mod:`bunshin_gym.envs.webarena.actions`); ``stop [answer]`` ends the episode, which is
then scored by the task's ``eval``. A malformed or impossible action leaves an error in
``last_action_error`` (and ``info["error"]``) and the episode goes on.

Example:
    >>> import gymnasium as gym, bunshin_gym
    >>> env = gym.make("Bunshin-WebArena-v0")
    >>> obs, info = env.reset(options={"task": "webarena/1001"})
    >>> print(obs["accessibility_tree"][:200])
    >>> obs, reward, terminated, truncated, info = env.step("click [link 'My Account']")
    >>> a, b = env.clone(2)     # same page, same signed-in session, separate databases
"""

from __future__ import annotations

import io
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from bunshin_gym.core.env import ActionError, WorkspaceEnv, blank_observation, check_text, printable
from bunshin_gym.core.spaces import PrintableText
from bunshin_gym.envs.webarena.actions import ActionSyntaxError, URLRefused, check_url, parse_action
from bunshin_gym.envs.webarena.browser import SOCKET, BrowserClient, DriverError
from bunshin_gym.envs.webarena.observation import Target, find_element, parse_aria, render_tree, tabs_line
from bunshin_gym.envs.webarena.tasks import WebArenaTask, load_task, placeholder
from bunshin_gym.errors import WorkspaceError

DRIVER_SOURCE = Path(__file__).with_name("driver.py")
URLGUARD_SOURCE = Path(__file__).with_name("urlguard.py")  # imported by the driver
DRIVER_PATH = "/var/lib/bunshin-web/driver.py"
#: the user chromium and its playwright driver run as (unprivileged; see driver.py)
BROWSER_USER = "user"
MAX_TEXT = 400_000
MAX_ACTION = 8192


@dataclass
class Site:
    """A web site served inside the workspace.

    Args:
        url: its address inside the workspace (only ``lo`` exists there).
        command: the service start command (a shell line or argv), run at boot with
            ``ws.spawn``; None when the image starts it some other way.
        user: user the service runs as (None: root).
        auth_state: playwright storage-state JSON (cookies) inside the workspace, loaded for
            tasks with ``require_login`` (WebArena's ``.auth/<site>_state.json``).
        ready_path: polled at boot until it answers HTTP.

    Example:
        >>> Site(url="http://127.0.0.1:8080", command="python3 /srv/app.py", auth_state=None)
    """

    url: str
    command: str | list[str] | None = None
    user: str | None = "user"
    auth_state: str | None = None
    ready_path: str = "/"
    env: dict[str, str] = field(default_factory=dict)


#: the shop of the ``webarena`` image (envs/webarena/image.toml)
SHOP = Site(
    url="http://127.0.0.1:7770",
    command="python3 /opt/shop/server.py --db /var/lib/shop/shop.db --port 7770",
    user="user",
    auth_state="/var/lib/shop/auth/shopping_state.json",
)


class WebArenaEnv(WorkspaceEnv):
    """WebArena tasks in forkable web workspaces.

    Args:
        task: default task: a shipped id (``webarena/1001``), a WebArena config dict or a path.
        sites: WebArena site name -> :class:`Site` (or a dict of its fields); default
            ``{"shopping": SHOP}``. With ``image=`` this points the env at your own site image.
        screenshot: add a ``screenshot`` array to each observation.
        viewport: browser viewport (width, height).
        chromium: the chromium binary inside the image.
        action_timeout: seconds an element action waits for its element.
        boot_timeout: seconds for the sites and the browser to come up.
        **kwargs: see :class:`~bunshin_gym.core.env.WorkspaceEnv` (``image``, ``memory_mode``, ...).

    Example:
        >>> env = WebArenaEnv(image="myshop", sites={"shopping": Site(
        ...     url="http://127.0.0.1:8080", command="/srv/start.sh", auth_state="/srv/auth.json")})
    """

    default_image = "webarena"

    def __init__(self, task: Any = None, *, sites: dict[str, Site | dict] | None = None, screenshot: bool = False,
                 viewport: tuple[int, int] = (1280, 720), chromium: str = "/usr/lib/chromium/chromium",
                 action_timeout: float = 5.0, boot_timeout: float = 90.0, **kwargs: Any):
        super().__init__(task, **kwargs)
        sites = sites if sites is not None else {"shopping": SHOP}
        self.sites = {k: v if isinstance(v, Site) else Site(**v) for k, v in sites.items()}
        self.site_urls = {placeholder(k): s.url.rstrip("/") for k, s in self.sites.items()}
        self.screenshot = screenshot
        self.viewport = tuple(viewport)
        self.chromium = chromium
        self.action_timeout = action_timeout
        self.boot_timeout = boot_timeout
        text = PrintableText(MAX_TEXT, min_length=0)
        obs = {"instruction": text, "accessibility_tree": text, "url": text, "tabs": text,
               "last_action_error": text}
        if screenshot:
            obs["screenshot"] = spaces.Box(0, 255, (self.viewport[1], self.viewport[0], 3), np.uint8)
        self.observation_space = spaces.Dict(obs)
        self.action_space = PrintableText(MAX_ACTION, min_length=1)
        self._client: BrowserClient | None = None
        self._element_box: dict | None = None  # the element box of the step running now
        self.open_tabs: list[dict] = []
        self.active_tab = 0
        self._clear_episode()

    def _clear_episode(self) -> None:
        self.answer: str | None = None
        self._tree = ""
        self._targets: dict[int, Target] = {}
        self._last_error = ""

    # connection to the driver ------------------------------------------------------------
    @property
    def browser(self) -> BrowserClient:
        """The connection to the workspace's browser driver (opened on first use)."""
        if self._client is None:
            self._client = BrowserClient(self.workspace.pid, timeout=max(60.0, self.action_timeout * 4))
        return self._client

    def release_connections(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # hooks ---------------------------------------------------------------------------------
    def load_task(self, spec: Any) -> WebArenaTask:
        return load_task(spec, self.site_urls)

    def boot_config(self) -> dict:
        return {"sites": self.sites, "viewport": self.viewport, "chromium": self.chromium,
                "action_timeout": self.action_timeout}

    def boot(self, ws: Any) -> None:
        for name, site in self.sites.items():
            if site.command:
                ws.spawn(site.command, user=site.user, env=site.env or None, log=f"/var/log/bunshin-site-{name}.log")
        for name, site in self.sites.items():
            self._wait_http(ws, name, site)
        ws.write_file(DRIVER_PATH, DRIVER_SOURCE.read_bytes())
        ws.write_file(str(Path(DRIVER_PATH).with_name("urlguard.py")), URLGUARD_SOURCE.read_bytes())
        # started as root to bind its socket next to the agent's; the browser runs as `user`
        origins = [a for s in self.sites.values() for a in ("--allow-origin", s.url)]
        ws.spawn(["python3", DRIVER_PATH, "--socket", SOCKET, "--chromium", self.chromium, "--user", BROWSER_USER,
                  *origins, "--width", str(self.viewport[0]), "--height", str(self.viewport[1]),
                  "--timeout-ms", str(int(self.action_timeout * 1000))], log="/var/log/bunshin-web-driver.log")
        try:
            self.browser.wait_ready(self.boot_timeout)
        except WorkspaceError as e:
            log = ws.exec("tail -n 30 /var/log/bunshin-web-driver.log", timeout=10).text
            raise WorkspaceError(f"{e}\nthe browser driver did not come up; its log:\n{log}") from e

    def _wait_http(self, ws: Any, name: str, site: Site) -> None:
        url = site.url.rstrip("/") + site.ready_path
        probe = ("import time, urllib.request, urllib.error, sys\n"
                 f"end = time.monotonic() + {self.boot_timeout}\n"
                 "while True:\n"
                 "    try:\n"
                 f"        urllib.request.urlopen({url!r}, timeout=5).read(); break\n"
                 "    except urllib.error.HTTPError: break\n"
                 "    except Exception as e:\n"
                 "        if time.monotonic() > end: sys.exit(f'{e}')\n"
                 "        time.sleep(0.05)\n")
        res = ws.exec(["python3", "-c", probe], timeout=self.boot_timeout + 10)
        if not res.ok:
            log = ws.exec(f"tail -n 20 /var/log/bunshin-site-{shlex.quote(name)}.log", timeout=10).text
            raise WorkspaceError(f"site {name!r} did not answer at {url}: {res.stderr.decode(errors='replace')[-300:]}"
                                 f"\nits log:\n{log}")

    def open_start_pages(self, task: WebArenaTask) -> None:
        """A fresh browser context for the task: its start URLs, signed in if it requires it."""
        state = None
        if task.require_login:
            sites = [s for k, s in self.sites.items() if k in task.config["sites"] and s.auth_state]
            if not sites:
                raise WorkspaceError(f"task {task.id} requires a login but no site of it has an auth_state")
            state = sites[0].auth_state
        self.browser.request({"op": "setup", "storage_state": state, "urls": task.start_urls()})

    def step(self, action: Any):
        """One action (see :meth:`WorkspaceEnv.step`). An action that targets an element adds
        ``info["element_box"]``, failed or not: the element's bounding box before the action
        ran (``x``, ``y``, ``width``, ``height`` in the screenshot's pixels, which are the
        viewport's CSS pixels; relative to the page as the step's previous observation showed
        it), for drawing the action where it acted. The observation is unchanged."""
        with self._lock:  # the box is this step's: no other thread's step in between
            self._element_box = None
            obs, reward, terminated, truncated, info = super().step(action)
            if self._element_box is not None:
                info["element_box"] = self._element_box
            return obs, reward, terminated, truncated, info

    def execute(self, action: Any) -> dict:
        self._last_error = ""
        try:
            check_text(action, what="a WebArena action", max_bytes=4 * MAX_ACTION)
            if len(action) > MAX_ACTION:
                raise ActionError(f"a WebArena action is {len(action)} characters, over the limit of {MAX_ACTION}")
            act = parse_action(action)
        except (ActionSyntaxError, ActionError) as e:
            return self._fail(str(e))
        if act.kind == "stop":
            self.answer = act.answer
            self.done = True
            return {"answer": act.answer}
        if act.kind == "noop":  # BrowserGym's noop(wait_ms): the page may still be loading
            time.sleep(act.wait_s or 0.0)
            return {"action": act.raw}
        req: dict[str, Any] = {"op": "act", "kind": act.kind}
        if act.element is not None:
            target = self._target(act.element)
            if target.ref is None:
                return self._fail(f"element [{act.element}] ({target.role} {target.name!r}) cannot be acted on")
            req["ref"], req["role"] = target.ref, target.role
            if target.option is not None:
                if act.kind not in ("click", "type"):
                    return self._fail(f"an option can only be chosen (click), not {act.kind}")
                req.update(kind="select", option=target.option)
        if act.kind == "type":
            req.update(text=act.text, enter=act.enter)
        if act.kind == "select":  # BrowserGym's select_option(bid, label) on the list's own id
            req["option"] = act.option
        req.update(key=act.key, direction=act.direction, index=act.index)
        if act.url is not None:
            try:
                req["url"] = check_url(self._resolve_url(act.url), list(self.site_urls.values()))
            except URLRefused as e:
                return self._fail(f"{act.raw}: refused: {e}")
        try:
            reply, _ = self.browser.request(req)
        except DriverError as e:
            self._element_box = _box((getattr(e, "reply", None) or {}).get("element_box"))
            return self._fail(f"{act.raw}: {e}")
        self._element_box = _box(reply.get("element_box"))
        return {"action": act.raw}

    def _fail(self, message: str) -> dict:
        self._last_error = printable(message)
        raise ActionError(message)

    def error_observation(self, message: str) -> dict:
        obs = blank_observation(self.observation_space)
        obs.update(instruction=self.task.instruction if self.task else "", last_action_error=message)
        return obs

    def _target(self, element: str) -> Target:
        if element.isdigit():
            target = self._targets.get(int(element))
            if target is None:
                self._fail(f"there is no element with id [{element}] in the current observation")
            return target
        try:
            return self._targets[find_element(self._targets, self._tree, element)]
        except KeyError as e:
            self._fail(str(e.args[0]))

    def _resolve_url(self, url: str) -> str:
        for ph, site_url in self.site_urls.items():
            url = url.replace(ph, site_url)
        # a bare host[:port][/path] gets http://; a URL with a scheme (file:, data:, ...) stays
        # as it is, for check_url to refuse by name
        if "://" not in url and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:(?!\d)", url):
            url = "http://" + url
        return url

    def observe(self) -> dict:
        reply, blobs = self.browser.request({"op": "observe", "screenshot": self.screenshot})
        tabs, active = reply["tabs"], reply["active"]
        self.open_tabs, self.active_tab = tabs, active  # [{"title", "url"}, ...]: BrowserGym's page lists
        title = tabs[active]["title"] if 0 <= active < len(tabs) else ""
        self._tree, self._targets = render_tree(parse_aria(reply["aria"]), title)
        obs = {
            "instruction": self.task.instruction if self.task else "",
            "accessibility_tree": self._tree[:MAX_TEXT],
            "url": reply["url"],
            "tabs": tabs_line(tabs, active),
            "last_action_error": self._last_error,
        }
        if self.screenshot:
            from PIL import Image

            img = Image.open(io.BytesIO(blobs[0])).convert("RGB")
            if img.size != self.viewport:
                img = img.resize(self.viewport)
            obs["screenshot"] = np.asarray(img, dtype=np.uint8)
        return obs

    # evaluation ------------------------------------------------------------------------------
    @property
    def page(self) -> _Page:
        """The browser as the evaluators see it (current URL, JS evaluation)."""
        return _Page(self)

    def eval_helpers(self, task: WebArenaTask) -> dict:
        """WebArena's ``func:`` URL helpers, answered from the live site."""
        def latest_order_url() -> str:
            history = task.resolve("__SHOPPING__/sales/order/history/")
            url = self.page.evaluate("document.querySelector('#my-orders-table tbody tr td a')?.href || ''",
                                     history)
            return url or history
        return {"shopping_get_latest_order_url": latest_order_url}

    # episode state -----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._clear_episode()
        return super().reset(seed=seed, options=options)

    def episode_state(self) -> dict:
        return {"answer": self.answer, "tree": self._tree, "targets": dict(self._targets),
                "last_error": self._last_error}

    def restore_episode_state(self, state: dict) -> None:
        self._client = None  # a clone (or a rollback) talks to its own workspace's driver
        self.answer = state.get("answer")
        self._tree = state.get("tree", "")
        self._targets = dict(state.get("targets", {}))
        self._last_error = state.get("last_error", "")


def _box(value: Any) -> dict | None:
    """The driver's ``element_box``, checked: four finite numbers, or None."""
    if not isinstance(value, dict):
        return None
    try:
        box = {k: float(value[k]) for k in ("x", "y", "width", "height")}
    except (KeyError, TypeError, ValueError):
        return None
    return box if all(np.isfinite(v) for v in box.values()) and box["width"] >= 0 and box["height"] >= 0 else None


class _Page:
    def __init__(self, env: WebArenaEnv):
        self.env = env

    def current_url(self) -> str:
        return self.env.browser.request({"op": "evaluate", "js": "document.location.href"})[0]["value"]

    def evaluate(self, js: str | None, url: str | None = None) -> str:
        try:
            return self.env.browser.request({"op": "evaluate", "js": js, "url": url})[0]["value"]
        except DriverError as e:
            raise RuntimeError(str(e)) from e
