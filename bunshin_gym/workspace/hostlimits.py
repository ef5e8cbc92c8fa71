"""Host settings that workspaces need because all of them run under one range of host uids.

Every workspace's root is the same host uid (the user namespace base, ``BUNSHIN_USERNS_BASE``),
and the kernel keeps some accounts per user, not per namespace. One of them changes what
programs observe: pipe buffers. Past ``fs.pipe-user-pages-soft`` pages for one user (16384,
64 MiB, by default) every new pipe of that user gets one page instead of sixteen and
``F_SETPIPE_SZ`` is refused, so a workspace's pipes would depend on what its siblings hold,
and CRIU could not restore a pipe's size (forks failed at 256 live desktops). Pipe buffers are
charged to each workspace's memory cgroup, which bounds them, so the per-user soft limit is
turned off (0). The hard limit (``pipe-user-pages-hard``) is left as it is.

The other one is CRIU's: a dump hands a task's pages to CRIU through pipes (vmsplice), one
round trip to the task's parasite per pipe, and a pipe grows only up to ``fs.pipe-max-size``
(1 MiB by default) when, as in a container, the dumper lacks CAP_SYS_RESOURCE. A 300 MB heap
took ~300 round trips while frozen. CRIU's own largest pipe is 4 MiB (its pipe buffers kept
within one costly-order allocation, ``PIPE_MAX_SIZE``), so ``fs.pipe-max-size`` is raised to
that (never lowered): a background dump of the heap was frozen 233 ms with 1 MiB pipes and
205 ms with 4 MiB ones (medians of 8 pairs, alternating, on one noisy host; session 16,
``bench/results/bgdump-heap-pipes-ab.txt``). A program in a
workspace may then grow its own pipes to 4 MiB too, charged to its memory cgroup like any
pipe buffer.

And each workspace's network namespace gets TCP hash tables of its own
(``net.ipv4.tcp_child_ehash_entries``, read when a namespace is made, by the namespace that
makes it: here the host's, for sources and for CRIU's clones alike). By default every namespace
shares the host's table (262,144 buckets on this host), and a dump lists the workspace's TCP
sockets with sock_diag, which walks every bucket of it while the workspace is frozen: 6-10 ms
for IPv4 and as much for IPv6, against ~1.5 ms each with a table of 1,024 buckets. Only a
value of 0 (shared, the default) is changed: an administrator's own size is kept. Namespaces
other programs make afterwards get such tables too (what the kernel's documentation suggests
for hosts of many namespaces); what their programs observe is the same.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

PIPE_USER_PAGES_SOFT = Path("/proc/sys/fs/pipe-user-pages-soft")
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")
TCP_CHILD_EHASH_ENTRIES = Path("/proc/sys/net/ipv4/tcp_child_ehash_entries")
#: buckets of a workspace namespace's own TCP tables (a power of two; a desktop holds tens of
#: TCP sockets, the web env's shop and database a few hundred at most)
WORKSPACE_TCP_BUCKETS = 1024
#: CRIU's largest page pipe: 819 pages of pipe buffers in 32 KiB, which the kernel rounds up
#: to a power of two
CRIU_PIPE_BYTES = 4 << 20


def _set_sysctl(path: Path, value: int, is_fine: Callable[[int], bool], why: str, if_refused: str) -> bool:
    """Write ``value`` to the sysctl file ``path`` unless its value ``is_fine``; True if it is
    fine now (a refused write, say in a container without it, is logged and left as it is)."""
    try:
        current = int(path.read_text())
        if not is_fine(current):
            path.write_text(f"{value}\n")
            log.info("%s was %d: set to %d (%s)", path, current, value, why)
        return True
    except (OSError, ValueError) as e:
        log.warning("cannot set %s to %d (%s): %s", path, value, e, if_refused)
        return False


def lift_pipe_user_limit(path: Path = PIPE_USER_PAGES_SOFT) -> bool:
    """Turn the per-user pipe soft limit off; True if it is off now."""
    return _set_sysctl(path, 0, lambda v: v == 0,
                       "all workspaces share one host uid; their pipe buffers are bounded by their memory cgroups",
                       "past it, workspaces see one-page pipes and forks of workspaces with enlarged pipes fail")


def raise_pipe_max_size(path: Path = PIPE_MAX_SIZE, size: int = CRIU_PIPE_BYTES) -> bool:
    """Raise ``fs.pipe-max-size`` to ``size`` bytes if it is lower; True if it is at least that now."""
    return _set_sysctl(path, size, lambda v: v >= size, "CRIU hands pages over in pipes of up to that size",
                       "dumps hand pages over in smaller pipes, and a workspace is frozen longer")


def give_namespaces_own_tcp_tables(path: Path = TCP_CHILD_EHASH_ENTRIES,
                                   buckets: int = WORKSPACE_TCP_BUCKETS) -> bool:
    """Network namespaces made from now on get TCP tables of ``buckets`` of their own, unless
    the host already says how large they are; True if they get tables of their own now."""
    return _set_sysctl(path, buckets, lambda v: v != 0,
                       "each workspace's TCP sockets in a table of its own: a dump lists them without "
                       "walking the host's table",
                       "workspaces share the host's TCP table, which every dump walks while frozen")


@functools.cache
def prepare_host() -> None:
    """Once a process: the host settings above (before its first workspace or clone starts)."""
    lift_pipe_user_limit()
    raise_pipe_max_size()
    give_namespaces_own_tcp_tables()
