"""Run a command in the desktop session: as user ``user``.

Usage (as root, from the workspace agent): ``python3 session_exec.py CMD [ARGS...]``.

inotify, which CRIU cannot dump on the overlay root (a desktop with inotify watches could
not be snapshotted), is refused with ENOSYS by the workspace's own seccomp filter
(``bunshin-init.c``) for every process, so GLib polls and chromium and dbus-daemon go
without; this wrapper used to install that rule itself, which needs CAP_SYS_ADMIN, no longer
held by workspace root.
"""

from __future__ import annotations

import os
import pwd
import sys


def main() -> None:
    argv = sys.argv[1:]
    user = "user"
    if argv[:1] == ["--user"]:
        user, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: session_exec.py [--user NAME] [--] CMD [ARGS...]")
    if os.getuid() == 0 and user != "root":
        pw = pwd.getpwnam(user)
        os.initgroups(user, pw.pw_gid)
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        os.environ.update(HOME=pw.pw_dir, USER=user, LOGNAME=user)
        if os.getcwd() in ("/root", "/"):
            os.chdir(pw.pw_dir)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.exit(f"session_exec: {argv[0]}: {e.strerror}")


if __name__ == "__main__":
    main()
