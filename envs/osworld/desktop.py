"""The desktop inside a workspace: boot (Xvfb, session bus, AT-SPI, openbox, input server,
terminal) and the host-side clients that drive it.

Everything here starts with ``ws.spawn`` as user ``user`` from ``OSWorldEnv.boot``, so the
boot snapshot captures a running desktop and every reset is a rollback. The host reaches
the desktop through two unix sockets under the workspace root (the X display and the
input server); both are closed by ``OSWorldEnv.release_connections`` before any
snapshot, clone or rollback, and reopened on the next use.

Example:
    >>> boot_desktop(ws, 1920, 1080)
    >>> DesktopClient(ws).request({"op": "pyautogui", "code": "pyautogui.press('enter')"})
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from bunshin_gym.errors import WorkspaceError
from bunshin_gym.workspace.client import WorkspaceClient
from bunshin_gym.workspace.inroot import RootedPath

RUNTIME = Path(__file__).parent / "runtime"
OPT = "/opt/bunshin"
STATE = "/tmp/.bunshin"  # tmpfs inside the workspace: sockets, logs, the terminal transcript
DESKTOP_SOCKET = f"{STATE}/desktop.sock"
X_SOCKET = "/tmp/.X11-unix/X0"
TERMINAL_LOG = f"{STATE}/terminal.log"
DBUS_ADDRESS = f"unix:path={STATE}/dbus"
USER, HOME = "user", "/home/user"
PYTHON_SITE = "/usr/local/lib/python3.11/dist-packages"

#: environment of every desktop program and of task commands (OSWorld runs them in the session)
DESKTOP_ENV = {
    "DISPLAY": ":0",
    "DBUS_SESSION_BUS_ADDRESS": DBUS_ADDRESS,
    "XDG_RUNTIME_DIR": f"{STATE}/xdg",
    "SAL_USE_VCLPLUGIN": "gtk3",
    "GTK_THEME": "Adwaita",
    "LANG": "C.UTF-8",
    "SHELL": "/bin/bash",
    "NO_AT_BRIDGE": "",
}
DESKTOP_ENV.pop("NO_AT_BRIDGE")  # documented: it must NOT be set, or GTK apps hide from AT-SPI


#: cap on one input-server reply (the largest is the fallback screenshot: 4 bytes a pixel)
MAX_REPLY = 64 << 20


def sock_path(ws: Any, inner: str) -> RootedPath:
    """``inner`` inside the workspace's root, resolved without following its symlinks."""
    return RootedPath(ws.pid, inner)


def _wait(pred, timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise WorkspaceError(f"desktop boot: {what} did not come up within {timeout:.0f} s")
        time.sleep(interval)


def install_runtime(ws: Any) -> None:
    """Write the env's in-workspace programs (input server, pyautogui module, tree dumper)."""
    for name in ("desktop_server.py", "a11y_dump.py", "pyautogui.py", "session_exec.py"):
        ws.write_file(f"{OPT}/{name}", (RUNTIME / name).read_bytes(), mode=0o644)
    ws.write_file(f"{PYTHON_SITE}/pyautogui.py", (RUNTIME / "pyautogui.py").read_bytes(), mode=0o644)
    # no blinking carets: a screenshot then depends only on the state, not on when it is taken
    ws.exec(["mkdir", "-p", f"{HOME}/.config/gtk-3.0"], user=USER, check=True)
    ws.write_file(f"{HOME}/.config/gtk-3.0/settings.ini", "[Settings]\ngtk-cursor-blink = false\n", owner=USER)


def session_argv(cmd: str | list[str]) -> list[str]:
    """``cmd`` (argv, or a shell line) wrapped to run in the session: as ``user``, no inotify."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
    return ["python3", f"{OPT}/session_exec.py", "--", *argv]


def session_spawn(ws: Any, cmd: str | list[str], log: str | None = None, cwd: str = HOME) -> int:
    """Start a long-running program in the desktop session (see ``runtime/session_exec.py``)."""
    return ws.spawn(session_argv(cmd), env=DESKTOP_ENV, cwd=cwd, log=log or f"{STATE}/desktop.log")


def session_run(ws: Any, cmd: str | list[str], timeout: float = 120.0, cwd: str = HOME) -> Any:
    """Run a command to completion in the desktop session; returns the ``ExecResult``."""
    return ws.exec(session_argv(cmd), env=DESKTOP_ENV, cwd=cwd, timeout=timeout)


def boot_desktop(ws: Any, width: int, height: int, terminal: bool = True, timeout: float = 60.0) -> None:
    """Start the desktop in a fresh workspace of the ``osworld`` image."""
    install_runtime(ws)
    ws.exec(f"mkdir -p {STATE}/xdg && chown -R {USER}:{USER} {STATE} && chmod 700 {STATE}/xdg", check=True)
    env = dict(DESKTOP_ENV)
    log = f"{STATE}/desktop.log"
    session_spawn(ws, ["Xvfb", ":0", "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp", "-ac",
                       "-dpi", "96", "+extension", "RANDR", "-extension", "MIT-SHM"], log=f"{STATE}/xvfb.log")
    _wait(lambda: _x_answers(sock_path(ws, X_SOCKET)), timeout, "Xvfb")
    session_spawn(ws, ["dbus-daemon", "--session", f"--address={DBUS_ADDRESS}", "--nofork", "--nopidfile"], log=log)
    _wait(lambda: sock_path(ws, f"{STATE}/dbus").exists(), timeout, "the session bus")
    session_spawn(ws, ["/usr/libexec/at-spi-bus-launcher", "--launch-immediately"], log=log)
    session_spawn(ws, ["python3", f"{OPT}/desktop_server.py"], log=f"{STATE}/desktop_server.log")
    client = DesktopClient(ws)
    _wait(lambda: client.ping(), timeout, "the input server")
    client.close()
    # accessibility on for every app started from now on (GTK, LibreOffice, chromium)
    deadline = time.monotonic() + timeout
    while True:
        res = ws.exec(["dbus-send", "--session", "--print-reply", "--dest=org.a11y.Bus", "/org/a11y/bus",
                       "org.freedesktop.DBus.Properties.Set", "string:org.a11y.Status", "string:IsEnabled",
                       "variant:boolean:true"], user=USER, env=env, timeout=10)
        if res.ok:
            break
        if time.monotonic() > deadline:
            raise WorkspaceError(f"desktop boot: AT-SPI bus: {res.stderr.decode(errors='replace')[-300:]}")
        time.sleep(0.1)
    for attempt in range(3):  # a window manager that lost a start-up race is started again
        session_spawn(ws, ["openbox", "--sm-disable"], log=log)
        try:
            _wait(lambda: window_names(ws) is not None, min(timeout, 10.0), "the window manager")
            break
        except WorkspaceError:
            if attempt == 2:
                raise WorkspaceError("desktop boot: openbox did not start: "
                                     + ws.exec(f"tail -5 {log}").text) from None
            ws.exec(["pkill", "-x", "openbox"])
    if terminal:
        # xterm's own log is the transcript (a `script` pty inside xterm's does not survive a
        # dump of a restored workspace: its shell gets killed)
        session_spawn(ws, ["xterm", "-T", "Terminal", "-fa", "DejaVu Sans Mono", "-fs", "11", "-geometry",
                           "110x32+80+60", "-l", "-lf", TERMINAL_LOG], log=log)
        if not wait_window(ws, "XTerm", timeout, by_class=True):
            raise WorkspaceError("desktop boot: the terminal window did not appear")


def windows(ws: Any) -> list[tuple[str, str]] | None:
    """(WM_CLASS "instance.Class", title) of each managed window; None while no window manager answers."""
    res = ws.exec(["wmctrl", "-lx"], user=USER, env=DESKTOP_ENV, timeout=10)
    if not res.ok:
        return None
    out = []
    for ln in res.text.splitlines():
        parts = ln.split(None, 4)
        if len(parts) >= 3:
            out.append((parts[2], parts[4] if len(parts) == 5 else ""))
    return out


def _x_answers(path: RootedPath) -> bool:
    from bunshin_gym.envs.osworld.xclient import XScreen

    scr = XScreen(path, timeout=2.0)
    try:
        scr.connect()
        return True
    except OSError:
        return False
    finally:
        scr.close()


def window_names(ws: Any) -> list[str] | None:
    """Titles of the managed windows (None while no window manager answers)."""
    found = windows(ws)
    return None if found is None else [title for _, title in found]


def wait_window(ws: Any, name: str, timeout: float = 60.0, strict: bool = False, by_class: bool = False) -> bool:
    """Wait until a window whose title (or WM_CLASS, ``by_class``) contains, or with ``strict``
    equals, ``name`` is mapped. Returns False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        found = windows(ws) or []
        keys = [cls if by_class else title for cls, title in found]
        if by_class and not strict:
            keys = [k for cls in keys for k in (cls, *cls.split("."))]
        if any((k == name) if strict else (name.lower() in k.lower()) for k in keys):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78cDEHM]")


def terminal_text(raw: bytes, limit: int = 16384) -> str:
    """The terminal transcript as plain text: escape sequences dropped, CR and BS applied."""
    text = _ANSI.sub("", raw.decode(errors="replace"))
    lines = []
    for line in text.split("\n"):
        if "\r" in line:
            parts = [p for p in line.split("\r") if p]
            line = parts[-1] if parts else ""
        while "\b" in line:
            i = line.index("\b")
            line = line[:max(0, i - 1)] + line[i + 1:]
        lines.append("".join(c for c in line if c == "\t" or c >= " "))
    out = "\n".join(lines)
    return out if len(out) <= limit else out[-limit:]


class DesktopClient:
    """The host's connection to the in-workspace input server (lazy, droppable).

    Every request has a deadline and its reply a size cap; a failure is a
    :class:`~bunshin_gym.errors.ChannelError` naming the workspace
    (:class:`~bunshin_gym.workspace.client.WorkspaceClient`).
    """

    def __init__(self, ws: Any):
        self.ws = ws
        # the path is taken at each connect: a rollback gives the workspace a new PID 1. Only
        # what changes nothing is retried on a connection that broke: a server that dropped the
        # connection may have run the action (and died), so an action is never sent twice
        self._client = WorkspaceClient(lambda: sock_path(ws, DESKTOP_SOCKET), name=f"{ws.id}: the desktop input server",
                                       timeout=120.0, max_blobs=MAX_REPLY,
                                       retry_ops=("ping", "screenshot", "a11y_tree"))

    def close(self) -> None:
        self._client.close()

    @property
    def connected(self) -> bool:
        return self._client.connected

    def ping(self) -> bool:
        try:
            return "pid" in self.request({"op": "ping"}, timeout=5.0)
        except WorkspaceError:
            return False

    def request(self, header: dict, timeout: float = 120.0) -> dict:
        return self._client.request(header, timeout=timeout)[0]

    def a11y_tree(self, seconds: float, max_nodes: int = 3000, memo: bool = True,
                  reply_timeout: float | None = None) -> str:
        """The accessibility tree's XML, dumped by the input server (the fast walker); a
        :class:`~bunshin_gym.errors.WorkspaceError` if it failed there. ``memo``: the server
        keeps what never changes (objects' interfaces, Calc cell names) from dump to dump;
        False asks everything (for comparisons). ``reply_timeout``: the longest wait for an
        app's next reply (default the walker's, 5 s)."""
        reply, blobs = self._client.request({"op": "a11y_tree", "seconds": seconds, "max_nodes": max_nodes,
                                             "memo": memo, "reply_timeout": reply_timeout},
                                            timeout=seconds + 20 + (reply_timeout or 0))
        if "error" in reply or len(blobs) != 1:
            raise WorkspaceError(f"{self.ws.id}: the input server's tree dump failed: {reply.get('error')}")
        return blobs[0].decode(errors="replace")
