"""Run a task's checker over a workspace's files with the binaries of its pristine image.

A policy with sudo owns the workspace: it can replace ``/usr/bin/wc``, ``sqlite3`` or
``python3``, add ``/etc/ld.so.preload``, point ``/lib64`` at its own loader, or ptrace any
process that runs there, so a checker that executes inside the workspace reports whatever
the policy wants. Checkers therefore run on the host, in a throw-away sandbox:

* a private mount namespace whose ``/`` is a read-only overlay (``nosuid,nodev``) of the
  workspace's own layers (its upper layer, the runtime layer, the image): the checker sees
  the workspace's files exactly as the episode left them, as data;
* a top overlay layer made here (the *pin*) that fixes what code is loaded from: ``/bin``,
  ``/lib``, ``/lib64``, ``/sbin`` are the image's symlinks, ``/etc/ld.so.cache`` is the
  image's, ``/etc/ld.so.preload`` is a whiteout, and ``/usr``, ``/dev``, ``/tmp`` are opaque
  directories on which the image's read-only ``/usr``, a five-node ``/dev`` and a small tmpfs
  are mounted. The pin is the top layer, so none of these paths can be a symlink the policy
  planted: every mount target is resolved through a directory made here;
* fresh pid, net (only a down ``lo``; or, for checkers that query a live service such as
  chromium's DevTools, the workspace's own net namespace), ipc and uts namespaces, so the
  checker can neither see nor signal the workspace's processes, nor they it;
* when the workspace runs in a user namespace (its files' owners shifted on disk, its image
  layer the image's shifted copy, :mod:`~bunshin_gym.workspace.idmap`), that same copy and a
  user namespace with the workspace's id map, so owners read as they do inside;
* ``chroot`` into that root, then ``setpriv`` to ``nobody`` keeping only the capabilities to
  read and search every file (``dac_override``, ``dac_read_search``; everything else out of
  the bounding set, no new privileges), a clean environment (``PATH=/usr/bin:/usr/sbin``,
  ``PYTHONNOUSERSITE``), a time limit and capped output.

Why this and not the alternatives: running the checker inside the workspace, even from a
bind-mounted pristine ``/usr``, leaves it in a pid and user namespace where the policy's root
can ptrace it; computing every check on the host in Python would change the task formats
(shell checkers are shell lines, OSWorld's getters run commands). The overlay costs a
mount of existing layers (no copy) and the workspace is frozen while the checker reads it,
so a background process of the policy cannot change the files mid-check. (The kernel logs
"lowerdir is in-use as upperdir ... undefined behavior" for each check: that is about both
mounts changing the layer at once, which the freeze rules out; a read-only btrfs snapshot of
the upper layer instead would silence it at ~10 ms and a subvolume per check.)

What stays the policy's: the data. A checker reading ``/etc/passwd`` or a dotfile in
``$HOME`` reads the workspace's; checks should compare the workspace's files against
values or pristine files (``/usr/...``), which is what the shipped tasks do. A checker
cannot use software the episode installed under ``/usr``.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bunshin_gym.config import paths
from bunshin_gym.workspace.client import ExecResult
from bunshin_gym.workspace.errors import WorkspaceError
from bunshin_gym.workspace.idmap import lower_image

log = logging.getLogger(__name__)

#: bytes kept of each of the checker's output streams (the rest is read and dropped)
MAX_OUTPUT = 1 << 20

_SETUP = r"""
set -eu
pin=$1 root=$2 lower=$3 image=$4 cwd=$5 cmd=$6
mount -t overlay overlay -o "ro,nosuid,nodev,lowerdir=$pin:$lower" "$root"
mount --bind -o ro,nosuid,nodev "$image/usr" "$root/usr"
mount -t tmpfs -o nosuid,nodev,size=64m,mode=1777 checker-tmp "$root/tmp"
mount -t tmpfs -o nosuid,noexec,size=64k,mode=755 checker-dev "$root/dev"
mknod -m 666 "$root/dev/null" c 1 3
mknod -m 666 "$root/dev/zero" c 1 5
mknod -m 666 "$root/dev/full" c 1 7
mknod -m 666 "$root/dev/random" c 1 8
mknod -m 666 "$root/dev/urandom" c 1 9
ip link set lo up 2>/dev/null || true
checker() {  # "$@": how to start it (exec, or nsenter into a user namespace)
    "$@" chroot "$root" /usr/bin/setpriv --reuid=65534 --regid=65534 --clear-groups \
        --inh-caps=-all,+dac_override,+dac_read_search --ambient-caps=-all,+dac_override,+dac_read_search \
        --bounding-set=-all,+dac_override,+dac_read_search --no-new-privs -- \
        /usr/bin/env -i PATH=/usr/bin:/usr/sbin HOME="$CHECK_HOME" USER="$CHECK_USER" LOGNAME="$CHECK_USER" \
        LANG=C.UTF-8 PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 TMPDIR=/tmp \
        /usr/bin/sh -c 'cd -- "$1" 2>/dev/null || cd /; exec /usr/bin/sh -c "$2"' checker "$cwd" "$cmd"
}
if [ -z "$CHECK_IDMAP" ]; then
    checker exec
fi
# the workspace's files carry shifted owners: run in a user namespace with its id map, so that
# owners read as inside (stat -c %U) and the read capabilities cover exactly them. A holder
# makes the namespace; the checker enters it as its root (uid 0 inside), which keeps the
# capabilities chroot and setpriv need across exec
unshare --user sleep 600 &
holder=$!
outer=$(readlink /proc/self/ns/user)
while [ "$(readlink "/proc/$holder/ns/user")" = "$outer" ]; do sleep 0.001; done  # not unshared yet
printf '%s\n' "$CHECK_IDMAP" > "/proc/$holder/uid_map"
printf '%s\n' "$CHECK_IDMAP" > "/proc/$holder/gid_map"
set +e
checker nsenter --user="/proc/$holder/ns/user" --setuid=0 --setgid=0 --
status=$?
kill "$holder"
exit "$status"
"""


def _pin(dst: Path, image: Path) -> None:
    """The top overlay layer that fixes where code comes from (see the module docstring)."""
    for entry in sorted(image.iterdir()):
        if entry.is_symlink():  # bin -> usr/bin, lib64 -> usr/lib64, ... as in the image
            os.symlink(os.readlink(entry), dst / entry.name)
    for name in ("usr", "dev", "tmp"):
        (dst / name).mkdir()
        os.setxattr(dst / name, "trusted.overlay.opaque", b"y")  # hides the workspace's
    (dst / "etc").mkdir()
    cache = image / "etc" / "ld.so.cache"
    if cache.is_file():
        shutil.copyfile(cache, dst / "etc" / "ld.so.cache")
    # an overlay whiteout: /etc/ld.so.preload does not exist, whatever the workspace put there
    os.mknod(dst / "etc" / "ld.so.preload", stat.S_IFCHR | 0o600, os.makedev(0, 0))


def id_map(pid1: int) -> str | None:
    """The workspace's uid map (``inside outside count`` lines) when it is not the identity."""
    try:
        text = Path(f"/proc/{pid1}/uid_map").read_text().strip()
    except OSError:
        return None
    if text.split() == ["0", "0", "4294967295"]:
        return None
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def run(ws: Any, command: str, *, cwd: str = "/", home: str = "/nonexistent", user: str = "root",
        timeout: float = 60.0, workspace_net: bool = False, freeze: bool = True,
        idmap: str | None = None) -> ExecResult:
    """Run a checker shell line over a live workspace's files with its image's binaries.

    Args:
        ws: the :class:`~bunshin_gym.workspace.Workspace`.
        command: a ``/bin/sh`` command line (the image's dash).
        cwd: working directory inside the workspace's tree.
        home: ``$HOME`` (default none: no dotfile of the policy configures the checker's tools).
        user: ``$USER`` (the checker runs as ``nobody`` with read access to every file).
        timeout: seconds before the checker is killed (``timed_out``).
        workspace_net: join the workspace's network namespace (to query a service it runs,
            e.g. chromium's DevTools on its loopback) instead of an empty one.
        freeze: freeze the workspace while the checker reads its files.
        idmap: run in a user namespace with this id map (``inside outside count`` lines; ""
            for none); default: the workspace's own, when it has one (its files' owners are
            shifted on disk, and read as inside the workspace only through that map).
    """
    rec = ws._rec
    # the image layer the workspace mounts: its shifted copy in a user-namespaced workspace
    image = lower_image(rec.image_path, getattr(rec, "userns_base", None))
    lower = f"{Path(rec.subvolume) / 'upper'}:{rec.layer}:{image}"
    if any(":" in part or "," in part for part in (rec.subvolume, rec.layer, rec.image_path)):
        raise WorkspaceError(f"workspace {rec.id}: a layer path holds ':' or ',', which overlayfs cannot take")
    p = paths()
    p.run.mkdir(parents=True, exist_ok=True)
    # --mount-proc: the setup script finds its own children under /proc (their pid namespace)
    ns = ["--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private", "--mount-proc"]
    if workspace_net:
        net = [f"--net=/proc/{rec.pid1}/ns/net"]
        runner = ["nsenter", *net, "--", "unshare", *ns]
    else:
        runner = ["unshare", "--net", *ns]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="check-", dir=p.run) as tmp:
        os.chmod(tmp, 0o755)  # searchable from a user namespace whose ids do not map host root
        pin, root = Path(tmp) / "pin", Path(tmp) / "root"
        pin.mkdir()
        root.mkdir()
        _pin(pin, image)
        argv = [*runner, "/bin/sh", "-c", _SETUP, "setup", str(pin), str(root), lower, str(image), cwd, command]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CHECK_HOME": home, "CHECK_USER": user,
               "CHECK_IDMAP": (id_map(rec.pid1) if rec.pid1 else None) or "" if idmap is None else idmap}
        frozen = False
        if freeze:
            ws.freeze()
            frozen = True
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, start_new_session=True)
            out, err, timed_out = _collect(proc, timeout)
        finally:
            if frozen:
                ws.thaw()
    code = proc.returncode
    return ExecResult(code if code is not None else -9, out, err, timed_out, time.monotonic() - t0)


def _collect(proc: subprocess.Popen, timeout: float) -> tuple[bytes, bytes, bool]:
    """Read both pipes up to MAX_OUTPUT each (the rest is dropped), kill the checker at the
    timeout; a checker that prints without end cannot grow this process."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    open_fds = set(bufs)
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                elif len(bufs[fd]) < MAX_OUTPUT:
                    bufs[fd] += chunk[: MAX_OUTPUT - len(bufs[fd])]
    finally:
        if timed_out or open_fds:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), timed_out
