"""Run a command in the desktop session: as user ``user``, without inotify.

Usage (as root, from the workspace agent): ``python3 session_exec.py CMD [ARGS...]``.

Why: CRIU records an inotify watch by the watched inode's file handle, and the workspace
root is an overlay mount whose handles cannot be opened back, so a desktop with
inotify watches (dbus-daemon on its service directories, GTK apps on the files they
open, chromium on its policy directory) cannot be snapshotted. This wrapper installs a
seccomp filter making ``inotify_init``/``inotify_init1`` fail with ENOSYS (GLib then polls,
chromium and dbus-daemon go without), drops to ``user`` and execs the command. The filter
is inherited by every descendant (the terminal's shell, apps it starts) and carried by
CRIU across dumps. It is installed while still root, so ``no_new_privs`` is not needed and
``sudo`` keeps working in the session.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import struct
import sys

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
ENOSYS = 38
NR_INOTIFY_INIT, NR_INOTIFY_INIT1 = 253, 294
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def no_inotify() -> None:
    prog = b"".join([
        _insn(BPF_LD_W_ABS, 0, 0, 4),                      # A = arch
        _insn(BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        _insn(BPF_LD_W_ABS, 0, 0, 0),                      # A = syscall number
        _insn(BPF_JEQ_K, 0, 1, NR_INOTIFY_INIT),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        _insn(BPF_JEQ_K, 0, 1, NR_INOTIFY_INIT1),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
        _insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ])
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main() -> None:
    argv = sys.argv[1:]
    user = "user"
    if argv[:1] == ["--user"]:
        user, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: session_exec.py [--user NAME] [--] CMD [ARGS...]")
    no_inotify()
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
