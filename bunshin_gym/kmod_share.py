"""Userspace wrapper of the bunshin_share kernel module (kmod/).

The module shares the anonymous pages of a range of a source process S into the
same range of a destination process D copy-on-write, the way fork() shares them
with a child (see kmod/README.md).  This wrapper speaks its ioctl through cffi in
ABI mode (libc's ``ioctl``/``syscall``, no compiler needed) and turns the
module's errnos into ``OSError`` with a message that says what was wrong.

    ks = KmodShare()
    if ks.available():
        res = ks.share(src_pid, dst_pid, start, length)   # -> ShareResult
        # or, for a whole restored process: share_anonymous(src_pid, dst_pid)

``src``/``dst`` are pids (int) or :class:`PidFD` objects; ``dst=None`` means the
calling process.  Pids are turned into pidfds at once (``pidfd_open``) so the
kernel acts on exactly those processes.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import cffi

DEVICE = "/dev/bunshin_share"
API_VERSION = 1

_ffi = cffi.FFI()
_ffi.cdef(
    """
    struct bunshin_share_req {
        int32_t  src_pidfd;
        int32_t  dst_pidfd;
        uint64_t start;
        uint64_t length;
        uint64_t flags;
        uint64_t pages_mapped;
        uint64_t swap_shared;
        uint64_t reserved[2];
    };
    int ioctl(int fd, unsigned long request, ...);
    long syscall(long number, ...);
    """
)
_libc = _ffi.dlopen(None)

_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2
_MAGIC = 0xB5


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_MAGIC << 8) | nr


REQ_SIZE = _ffi.sizeof("struct bunshin_share_req")
IOC_VERSION = _ioc(_IOC_NONE, 0, 0)
IOC_SHARE = _ioc(_IOC_READ | _IOC_WRITE, 1, REQ_SIZE)
SYS_pidfd_open = 434  # same number on x86_64 and aarch64

# What each errno of BUNSHIN_SHARE_IOC_SHARE means (kmod/README.md, "Errors").
ERRNO_MEANING = {
    errno.EBADF: "a pidfd is not an open pidfd",
    errno.ESRCH: "the process has exited (or is a kernel thread)",
    errno.EACCES: "the caller may not ptrace-attach to S or D",
    errno.EINVAL: (
        "bad request: start/length not page aligned, zero or wrapping, unknown flags, the range spans "
        "more than one mapping, S and D protections differ, or S and D are the same process"
    ),
    errno.ENOMEM: "the range is not fully mapped in S or in D (or the kernel ran out of memory)",
    errno.EOPNOTSUPP: "refused mapping kind: file-backed, shared, mlocked or special (PFN/IO/hugetlb)",
    errno.EBUSY: "D's range already holds anonymous memory of its own that is not linked to S's",
    errno.ENOTTY: "the device does not speak the bunshin_share API (wrong device or module version)",
    errno.EFAULT: "bad request buffer",
    errno.EINTR: "interrupted while waiting for the mm locks",
}


@dataclass(frozen=True)
class ShareResult:
    start: int
    length: int
    pages_mapped: int  # growth of D's resident anonymous pages (4 KiB units)
    swap_shared: int  # swap entries of S duplicated into D


class PidFD:
    """A pidfd owned by the caller (closed on ``close()`` / context exit)."""

    def __init__(self, pid: int):
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"pid must be a positive int, got {pid!r}")
        self.pid = pid
        self.fd = _pidfd_open(pid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PidFD:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _pidfd_open(pid: int) -> int:
    if hasattr(os, "pidfd_open"):
        try:
            return os.pidfd_open(pid)
        except OSError as e:
            raise OSError(e.errno, f"pidfd_open({pid}): {os.strerror(e.errno)}") from None
    _ffi.errno = 0
    fd = _libc.syscall(SYS_pidfd_open, _ffi.cast("int", pid), _ffi.cast("unsigned int", 0))
    if fd < 0:
        e = _ffi.errno
        raise OSError(e, f"pidfd_open({pid}): {os.strerror(e)}")
    return int(fd)


def available(device: str = DEVICE) -> bool:
    """True when the module's device node exists (the module is loaded)."""
    try:
        return stat.S_ISCHR(os.stat(device).st_mode)
    except OSError:
        return False


class KmodShare:
    """Handle on /dev/bunshin_share.  Opening is lazy; errors name the device."""

    def __init__(self, device: str = DEVICE):
        self.device = str(device)
        self._fd = -1

    # -- device -------------------------------------------------------
    def available(self) -> bool:
        return available(self.device)

    def _open(self) -> int:
        if self._fd >= 0:
            return self._fd
        if not os.path.exists(self.device):
            raise OSError(
                errno.ENOENT,
                f"bunshin_share kernel module not loaded: {self.device} does not exist (build and "
                "insmod kmod/bunshin_share.ko on a host that can load modules; see kmod/README.md)",
                self.device,
            )
        try:
            self._fd = os.open(self.device, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            msg = f"cannot open {self.device}: {os.strerror(e.errno)}"
            raise OSError(e.errno, msg, self.device) from None
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> KmodShare:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def version(self) -> int:
        fd = self._open()
        _ffi.errno = 0
        rc = _libc.ioctl(fd, _ffi.cast("unsigned long", IOC_VERSION))
        if rc < 0:
            e = _ffi.errno
            meaning = ERRNO_MEANING.get(e, os.strerror(e))
            raise OSError(e, f"{self.device}: version ioctl failed: {meaning}")
        return int(rc)

    # -- sharing ------------------------------------------------------
    def share(self, src: int | PidFD, dst: int | PidFD | None, start: int, length: int) -> ShareResult:
        """Share S's anonymous pages of [start, start+length) into the same range of D.

        ``src``/``dst``: a pid or a :class:`PidFD`; ``dst=None`` is the calling process.
        D's range must already be mapped private anonymous with S's protections.
        """
        for name, v in (("start", start), ("length", length)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 64:
                raise ValueError(f"{name} must be an unsigned 64-bit int, got {v!r}")
        fd = self._open()
        owned: list[PidFD] = []
        try:
            src_fd = self._pidfd(src, owned, "source")
            dst_fd = -1 if dst is None else self._pidfd(dst, owned, "destination")
            req = _ffi.new("struct bunshin_share_req *")
            req.src_pidfd = src_fd
            req.dst_pidfd = dst_fd
            req.start = start
            req.length = length
            _ffi.errno = 0
            rc = _libc.ioctl(fd, _ffi.cast("unsigned long", IOC_SHARE), _ffi.cast("void *", req))
            if rc < 0:
                e = _ffi.errno
                raise OSError(
                    e,
                    f"bunshin_share: sharing {start:#x}+{length:#x} from {_who(src)} into {_who(dst)} "
                    f"failed: {os.strerror(e)}: {ERRNO_MEANING.get(e, 'unexpected error')}",
                )
            return ShareResult(start, length, int(req.pages_mapped), int(req.swap_shared))
        finally:
            for p in owned:
                p.close()

    @staticmethod
    def _pidfd(x: int | PidFD, owned: list[PidFD], role: str) -> int:
        if isinstance(x, PidFD):
            return x.fd
        if isinstance(x, int) and not isinstance(x, bool):
            try:
                p = PidFD(x)
            except ValueError:
                raise
            except OSError as e:
                raise OSError(e.errno, f"bunshin_share: {role} process {x}: {e.strerror}") from None
            owned.append(p)
            return p.fd
        raise TypeError(f"{role} must be a pid (int) or a PidFD, got {type(x).__name__}")

    def share_anonymous(self, src_pid: int, dst_pid: int | None) -> list[ShareResult]:
        """Share every private anonymous mapping of ``src_pid`` that ``dst_pid`` maps identically.

        This is the restore-side step of the "kmod" memory mode: D (restored by CRIU without
        filling anonymous memory) has the same VMAs as S; each one is shared in turn.
        """
        src_maps = anonymous_ranges(Path(f"/proc/{src_pid}/maps").read_text())
        dst_text = Path(f"/proc/{dst_pid if dst_pid is not None else 'self'}/maps").read_text()
        dst_maps = {(s, e): perms for s, e, perms in anonymous_ranges(dst_text)}
        out = []
        with PidFD(src_pid) as sfd:
            dfd = PidFD(dst_pid) if dst_pid is not None else None
            try:
                for s, e, perms in src_maps:
                    if dst_maps.get((s, e)) != perms:
                        continue
                    out.append(self.share(sfd, dfd, s, e - s))
            finally:
                if dfd is not None:
                    dfd.close()
        return out


def anonymous_ranges(maps_text: str) -> list[tuple[int, int, str]]:
    """(start, end, perms) of the private anonymous mappings in a /proc/PID/maps text.

    Private anonymous = perms end in 'p', inode 0 and no path, or [heap] / [stack].
    Kernel-provided mappings ([vdso], [vvar], [vsyscall], ...) and file or shared
    mappings are left out: the module refuses them.
    """
    out = []
    for line in maps_text.splitlines():
        f = line.split(maxsplit=5)
        if len(f) < 5:
            continue
        rng, perms, _off, _dev, inode = f[:5]
        path = f[5].strip() if len(f) > 5 else ""
        if not perms.endswith("p") or inode != "0":
            continue
        if path and path not in ("[heap]", "[stack]"):
            continue
        s, e = (int(x, 16) for x in rng.split("-"))
        out.append((s, e, perms))
    return out


def _who(x: int | PidFD | None) -> str:
    if x is None:
        return "the calling process"
    if isinstance(x, PidFD):
        return f"pid {x.pid}"
    return f"pid {x}"
