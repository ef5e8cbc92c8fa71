"""Host settings that workspaces need because all of them run under one range of host uids.

Every workspace's root is the same host uid (the user namespace base, ``BUNSHIN_USERNS_BASE``),
and the kernel keeps some accounts per user, not per namespace. One of them changes what
programs observe: pipe buffers. Past ``fs.pipe-user-pages-soft`` pages for one user (16384,
64 MiB, by default) every new pipe of that user gets one page instead of sixteen and
``F_SETPIPE_SZ`` is refused, so a workspace's pipes would depend on what its siblings hold,
and CRIU could not restore a pipe's size (forks failed at 256 live desktops). Pipe buffers are
charged to each workspace's memory cgroup, which bounds them, so the per-user soft limit is
turned off (0). The hard limit (``pipe-user-pages-hard``) is left as it is.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

PIPE_USER_PAGES_SOFT = Path("/proc/sys/fs/pipe-user-pages-soft")


def lift_pipe_user_limit(path: Path = PIPE_USER_PAGES_SOFT) -> bool:
    """Turn the per-user pipe soft limit off; True if it is off now (a host that refuses the
    write, say a container without it, is logged and left as it is)."""
    try:
        current = int(path.read_text())
        if current != 0:
            path.write_text("0\n")
            log.info("%s was %d pages: set to 0 (all workspaces share one host uid; their pipe "
                     "buffers are bounded by their memory cgroups)", path, current)
        return True
    except (OSError, ValueError) as e:
        log.warning("cannot turn off the per-user pipe limit (%s): past it, workspaces see one-page "
                    "pipes and forks of workspaces with enlarged pipes fail", e)
        return False


@functools.cache
def prepare_host() -> None:
    """Once a process: the host settings above (before its first workspace or clone starts)."""
    lift_pipe_user_limit()
