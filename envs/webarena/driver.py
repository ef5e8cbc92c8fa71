"""The in-workspace browser driver: a long-lived process holding a playwright browser.

Runs inside a web workspace with the image's python3 (playwright installed, Debian's
chromium), started by ``WebArenaEnv.boot``, so the boot snapshot holds it with its browser
and page. It serves one controller connection at a time on a unix socket
(``/run/bunshin/web.sock``) with bunshin's one protocol (``/.bunshin/protocol.py``, shipped
in the runtime layer): a request is a JSON header (``op`` and arguments), a reply a JSON
header (``error`` on failure) plus blobs (a screenshot). The controller closes its
connection before every snapshot; the driver then goes back to ``accept``.

Everything stays CRIU-dumpable: playwright talks to its node driver and node to chromium
over pipes inside the workspace, and the workspace's PID 1 keeps io_uring out.

Containment. The driver is started as root only to bind its socket in ``/run/bunshin``
(root's directory, next to the agent's socket); before it starts playwright it becomes
``--user`` (no supplementary groups, no capabilities, ``no_new_privs``, so not even the
user's sudo works from a browser process), so node and every chromium process run
unprivileged. Chromium keeps ``--no-sandbox``: its own sandbox puts the zygote and the
renderers in nested user and pid namespaces (Debian ships no setuid helper), and CRIU cannot
checkpoint those (tried: started as ``user`` without ``--no-sandbox`` in a web workspace,
chromium runs, and the snapshot fails with "Can't dump nested pid namespace"), and the
contained workspace's seccomp filter refuses new user namespaces (issue 13) in any case. What contains a compromised
renderer instead is the workspace (its namespaces, reduced capabilities, seccomp filter,
memory/pids limits, only ``lo``) plus this unprivileged user without new privileges.
Where the browser may go: only ``about:blank`` and the env's sites (``--allow-origin``).
The controller refuses other ``goto`` URLs before they reach here; here every URL the
driver is asked to open is checked again, requests to other origins are aborted by a
playwright route, and after each action a page that still ended elsewhere (a ``file://``
link, a redirect) is taken back and the action fails.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import re
import sys
import time
import traceback

sys.path.insert(0, "/.bunshin")
from playwright.sync_api import Error as PlaywrightError  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402
from protocol import serve_unix  # noqa: E402  (bunshin's one wire protocol, from the runtime layer)
from urlguard import origin  # noqa: E402  (written next to this file by the env)

#: the desktop's chromium flags (envs/osworld/image/chromium.sh), fewer processes included: no
#: zygotes, the GPU thread and the network service in the browser process, no spare renderer
#: (each process is one more task every snapshot dumps and every clone restores)
CHROMIUM_ARGS = [
    "--no-sandbox", "--no-zygote", "--disable-gpu", "--in-process-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--enable-features=NetworkServiceInProcess2",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic", "--disable-default-apps",
    "--disable-extensions", "--no-default-browser-check", "--disable-breakpad", "--disable-crash-reporter",
    "--password-store=basic", "--use-mock-keychain", "--force-renderer-accessibility",
    "--disable-features=Translate,MediaRouter,OptimizationHints,OptimizationGuideModelDownloading,"
    "AutofillServerCommunication,OnDeviceModelPerformanceParams,SpareRendererForSitePerProcess",
]
KEYS = {"ctrl": "Control", "control": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
        "enter": "Enter", "return": "Enter", "esc": "Escape", "escape": "Escape", "tab": "Tab", "space": "Space",
        "backspace": "Backspace", "delete": "Delete", "del": "Delete", "up": "ArrowUp", "down": "ArrowDown",
        "left": "ArrowLeft", "right": "ArrowRight", "pageup": "PageUp", "pagedown": "PageDown", "home": "Home",
        "end": "End"}
#: how long an action waits for its element's box before it runs (the action itself then waits
#: for the element as long as it waits; a box not found in time is left out)
BOX_TIMEOUT_MS = 1000


def drop_privileges(user: str) -> None:
    """Become ``user`` for good: its uid and gid, no other group, no capability, and no way
    back up through a setuid binary (PR_SET_NO_NEW_PRIVS)."""
    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0):  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.environ.update(HOME=pw.pw_dir, USER=user, LOGNAME=user)
    os.chdir(pw.pw_dir if os.path.isdir(pw.pw_dir) else "/tmp")


class Driver:
    def __init__(self, chromium: str, width: int, height: int, timeout_ms: int, origins: list[str] = ()):
        self.origins = {o for o in (origin(u) for u in origins) if o}
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        self.viewport = {"width": width, "height": height}
        self.timeout_ms = timeout_ms
        self.context = None
        self.active = 0
        self._new_context(None)
        self.page.goto("about:blank")

    # pages -----------------------------------------------------------------------------
    def _new_context(self, storage_state: str | None) -> None:
        if self.context is not None:
            self.context.close()
        self.context = self.browser.new_context(viewport=self.viewport, storage_state=storage_state)
        # a JavaScript dialog would block every later call: accept it, as a user clicking OK
        self.context.on("page", lambda page: page.on("dialog", lambda dialog: dialog.accept()))
        self.context.set_default_timeout(self.timeout_ms)
        self.context.set_default_navigation_timeout(max(self.timeout_ms, 15000))
        if self.origins:
            # only requests to other origins come up to Python (the pattern is matched in
            # playwright's node driver), so the site's own pages load at full speed
            sites = "|".join(re.escape(chromium_prefix(o)) for o in sorted(self.origins))
            self.context.route(re.compile(rf"^(?!(?:{sites})(?:[/?#]|$))"),
                               lambda route: route.abort("blockedbyclient"))
        self.context.new_page()
        self.active = 0

    def allowed(self, url: str) -> bool:
        return url == "about:blank" or not self.origins or origin(url) in self.origins

    def check_url(self, url: str) -> str:
        if not self.allowed(url):
            raise ValueError(f"the browser may only open the env's sites ({', '.join(sorted(self.origins))}), "
                             f"not {url[:200]!r}")
        return url

    def _pull_back(self) -> None:
        """Take every page that ended outside the sites back (history, else about:blank);
        raise for the action that led there."""
        left = []
        for page in self.context.pages:
            if not self.allowed(page.url):
                left.append(page.url)
                try:
                    page.go_back(timeout=5000)
                except PlaywrightError:
                    pass
                if not self.allowed(page.url):
                    page.goto("about:blank")
        if left:
            raise ValueError(f"navigation to {left[0][:200]!r} was blocked: the browser may only open the "
                             f"env's sites ({', '.join(sorted(self.origins))})")

    @property
    def page(self):
        pages = self.context.pages
        if not pages:
            self.context.new_page()
            pages = self.context.pages
        self.active = min(self.active, len(pages) - 1)
        return pages[self.active]

    def _settle(self, before: int) -> None:
        """After an action: follow a tab it opened, wait for the page to load."""
        pages = self.context.pages
        if len(pages) > before:
            self.active = len(pages) - 1
        try:
            self.page.wait_for_load_state("load", timeout=10000)
        except PlaywrightError:
            pass

    # operations ------------------------------------------------------------------------
    def op_ping(self, req: dict) -> tuple[dict, list]:
        return {"pid": os.getpid(), "pages": len(self.context.pages)}, []

    def op_setup(self, req: dict) -> tuple[dict, list]:
        """A fresh browser context (cookies from a storage state file) with one tab per URL."""
        self._new_context(req.get("storage_state"))
        for i, url in enumerate(req.get("urls") or ["about:blank"]):
            page = self.context.pages[0] if i == 0 else self.context.new_page()
            page.goto(self.check_url(url))
        self.active = 0
        self.page.bring_to_front()
        return {}, []

    def op_observe(self, req: dict) -> tuple[dict, list]:
        try:  # a page that went elsewhere by itself (a timed redirect) is never observed there
            self._pull_back()
        except ValueError:
            pass
        page = self.page
        aria = ""
        for attempt in range(4):
            try:
                aria = page.aria_snapshot(mode="ai")
                break
            except PlaywrightError:
                if attempt == 3:
                    raise
                try:
                    page.wait_for_load_state("load", timeout=5000)
                except PlaywrightError:
                    time.sleep(0.2)
        tabs = []
        for p in self.context.pages:
            try:
                title = p.title()
            except PlaywrightError:
                title = ""
            tabs.append({"title": title, "url": p.url})
        blobs = [page.screenshot(type="png")] if req.get("screenshot") else []
        return {"url": page.url, "aria": aria, "tabs": tabs, "active": self.active}, blobs

    def op_act(self, req: dict) -> tuple[dict, list]:
        """One action. One that targets an element answers (and, failed, carries on its
        error) ``element_box``: where the element was before the action ran."""
        page = self.page
        target = page.locator(f"aria-ref={req['ref']}") if req.get("ref") else None
        box = self._element_box(target) if target is not None else None
        try:
            self._act(req, page, target)
        except Exception as e:
            if box is not None:
                e.element_box = box  # serve() puts it in the error reply
            raise
        return ({"element_box": box} if box is not None else {}), []

    def _element_box(self, target) -> dict | None:
        """The element's bounding box now, before the action runs (a click first scrolls its
        element into view, so this box is where it was on the page the action was chosen on):
        ``x``, ``y``, ``width``, ``height`` in the viewport's CSS pixels, which are the
        screenshot's (the env scales a screenshot to the viewport). None when the element is
        not rendered (hidden, detached) or not found within BOX_TIMEOUT_MS: the action
        then reports why."""
        try:
            box = target.bounding_box(timeout=min(BOX_TIMEOUT_MS, self.timeout_ms))
        except PlaywrightError:
            return None
        return None if box is None else {k: round(float(box[k]), 2) for k in ("x", "y", "width", "height")}

    def _act(self, req: dict, page, target) -> None:
        kind = req["kind"]
        before = len(self.context.pages)
        if kind == "click":
            target.click()
        elif kind == "hover":
            target.hover()
        elif kind == "select":
            target.select_option(label=req["option"])
        elif kind == "type":
            text = req["text"]
            role = req.get("role", "")
            if role in ("combobox", "listbox") and target.evaluate("e => e.tagName") == "SELECT":
                target.select_option(label=text)
            else:
                try:
                    target.fill(text)
                except PlaywrightError as e:
                    if "not an <input>" not in str(e):
                        raise
                    target.click()
                    page.keyboard.type(text)
            if req.get("enter"):
                target.press("Enter")
        elif kind == "press":  # on an element (BrowserGym's press(bid, key)) or wherever the focus is
            (target or page.keyboard).press(_key_combo(req["key"]))
        elif kind == "scroll":
            dy = self.viewport["height"] * (1 if req["direction"] == "down" else -1)
            page.mouse.wheel(0, dy)
            time.sleep(0.1)
        elif kind == "new_tab":
            self.context.new_page()
            self.active = len(self.context.pages) - 1
        elif kind == "tab_focus":
            index = int(req["index"])
            if not 0 <= index < len(self.context.pages):
                raise ValueError(f"there is no tab {index} (open tabs: 0-{len(self.context.pages) - 1})")
            self.active = index
            self.page.bring_to_front()
        elif kind == "close_tab":
            page.close()
            if not self.context.pages:
                self.context.new_page()
            self.active = len(self.context.pages) - 1
            self.page.bring_to_front()
            return
        elif kind == "goto":
            page.goto(self.check_url(req["url"]))
        elif kind == "go_back":
            page.go_back()
        elif kind == "go_forward":
            page.go_forward()
        else:
            raise ValueError(f"unknown action kind {kind!r}")
        self._settle(before)
        self._pull_back()

    def op_evaluate(self, req: dict) -> tuple[dict, list]:
        """Evaluate a JS expression (``js``) or take the HTML (no ``js``) of the active page or,
        with ``url``, of that URL loaded in a temporary tab (the agent's tabs are untouched)."""
        url = req.get("url")
        page = self.context.new_page() if url else self.page
        try:
            if url:
                page.goto(self.check_url(url))
            if req.get("js"):
                value = page.evaluate(f"() => {req['js']}")
                text = "" if value is None else (value if isinstance(value, str) else json.dumps(value))
            else:
                text = page.content()
        finally:
            if url:
                page.close()
        return {"value": text, "url": page.url}, []


def _key_combo(combo: str) -> str:
    parts = [p.strip() for p in combo.replace(" ", "").split("+") if p.strip()]
    return "+".join(KEYS.get(p.lower(), p if len(p) > 1 else p) for p in parts)


def chromium_prefix(o: str) -> str:
    """How chromium writes an origin at the start of a URL (no default port)."""
    for default in ("http://", "https://"):
        port = ":80" if default == "http://" else ":443"
        if o.startswith(default) and o.endswith(port):
            return o[: -len(port)]
    return o


def serve(make_driver, path: str) -> None:
    """Serve on ``path``; the driver (the browser) is made by ``make_driver()`` on the first
    request, once the socket is bound, so that a root-started driver binds and then drops."""
    state = {}

    def handle(req: dict, _blobs: list[bytes]) -> tuple[dict, list[bytes]]:
        if "driver" not in state:
            state["driver"] = make_driver()
        driver = state["driver"]
        fn = getattr(driver, "op_" + str(req.get("op")), None)
        try:
            if fn is None:
                raise ValueError(f"unknown operation {req.get('op')!r}")
            return fn(req)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the controller
            if not isinstance(e, (PlaywrightError, ValueError, KeyError)):
                traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {_first_line(e)}"}
            if getattr(e, "element_box", None) is not None:  # where a failed action's element was
                reply["element_box"] = e.element_box
            return reply, []

    serve_unix(path, handle, name="bunshin web driver")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    head = text.split("\nCall log:")[0].strip()
    return head[:600]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", default="/run/bunshin/web.sock")
    ap.add_argument("--chromium", default="/usr/lib/chromium/chromium")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--timeout-ms", type=int, default=5000)
    ap.add_argument("--allow-origin", action="append", default=[],
                    help="a site the browser may open (repeat); none: no restriction")
    ap.add_argument("--user", help="run the browser as this user (the driver binds its socket first)")
    args = ap.parse_args()

    def make_driver() -> Driver:
        if args.user and os.getuid() == 0:
            drop_privileges(args.user)
        return Driver(args.chromium, args.width, args.height, args.timeout_ms, args.allow_origin)

    serve(make_driver, args.socket)


if __name__ == "__main__":
    main()
