"""The bunshin_share wrapper (bunshin_gym.kmod_share) on a host without the module,
and (slow, vm) the module's own suite in a qemu VM via `make -C kmod test`."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fork_programs import host

from bunshin_gym import kmod_share
from bunshin_gym.kmod_share import DEVICE, KmodShare, PidFD, anonymous_ranges

REPO = Path(__file__).resolve().parents[2]


def test_available_matches_device_node(tmp_path):
    assert KmodShare().available() == (os.path.exists(DEVICE) and kmod_share.available())
    assert not KmodShare(tmp_path / "absent").available()
    regular = tmp_path / "regular"
    regular.write_text("")
    assert not KmodShare(regular).available(), "a regular file is not the device"
    assert KmodShare("/dev/null").available(), "a character device node counts as present"


@pytest.mark.skipif(os.path.exists(DEVICE), reason="module loaded on this host")
def test_share_without_module_names_the_device():
    ks = KmodShare()
    assert not ks.available()
    with pytest.raises(OSError) as ei:
        ks.share(os.getpid(), None, 0x10000, 0x1000)
    assert ei.value.errno == errno.ENOENT
    assert DEVICE in str(ei.value)
    assert "not loaded" in str(ei.value)
    with pytest.raises(OSError) as ei:
        ks.version()
    assert ei.value.errno == errno.ENOENT and DEVICE in str(ei.value)


def test_missing_custom_device_is_named(tmp_path):
    dev = tmp_path / "bunshin_share"
    with pytest.raises(OSError) as ei:
        KmodShare(dev).share(os.getpid(), None, 0, 4096)
    assert ei.value.errno == errno.ENOENT
    assert str(dev) in str(ei.value)


def test_ioctl_goes_through_and_errno_is_explained():
    """/dev/null answers every ioctl with ENOTTY: the real cffi ioctl path, errno and message."""
    ks = KmodShare("/dev/null")
    with pytest.raises(OSError) as ei:
        ks.share(os.getpid(), None, 0x10000, 0x1000)
    assert ei.value.errno == errno.ENOTTY
    msg = str(ei.value)
    assert "0x10000+0x1000" in msg and f"pid {os.getpid()}" in msg and "the calling process" in msg
    assert "bunshin_share API" in msg
    with pytest.raises(OSError) as ei:
        ks.version()
    assert ei.value.errno == errno.ENOTTY
    ks.close()


def test_dead_source_pid_is_reported_before_the_ioctl():
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(OSError) as ei:
        KmodShare("/dev/null").share(p.pid, None, 0x10000, 0x1000)
    assert ei.value.errno == errno.ESRCH
    assert f"source process {p.pid}" in str(ei.value)


def test_argument_validation():
    ks = KmodShare("/dev/null")
    with pytest.raises(ValueError):
        ks.share(os.getpid(), None, -4096, 4096)
    with pytest.raises(ValueError):
        ks.share(os.getpid(), None, 0, 1 << 64)
    with pytest.raises(TypeError):
        ks.share("1", None, 0, 4096)
    with pytest.raises(ValueError):
        PidFD(0)


def test_pidfd_refers_to_the_process():
    with PidFD(os.getpid()) as p:
        assert p.fd >= 0
        assert f"Pid:\t{os.getpid()}" in Path(f"/proc/self/fdinfo/{p.fd}").read_text()
    assert p.fd == -1


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to read the C header")
def test_abi_matches_the_uapi_header(tmp_path):
    """The Python struct and ioctl numbers must equal what kmod/bunshin_share.h defines."""
    src = tmp_path / "abi.c"
    src.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "bunshin_share.h"\n'
        'int main(void){printf("%zu %lu %lu %zu %zu %zu %d\\n", sizeof(struct bunshin_share_req),'
        "(unsigned long)BUNSHIN_SHARE_IOC_SHARE,(unsigned long)BUNSHIN_SHARE_IOC_VERSION,"
        "offsetof(struct bunshin_share_req,start),offsetof(struct bunshin_share_req,pages_mapped),"
        "offsetof(struct bunshin_share_req,swap_shared),BUNSHIN_SHARE_API);return 0;}\n"
    )
    exe = tmp_path / "abi"
    subprocess.run(["gcc", "-I", str(REPO / "kmod"), "-o", str(exe), str(src)], check=True)
    size, share, version, off_start, off_pages, off_swap, api = map(
        int, subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    )
    ffi = kmod_share._ffi
    assert size == kmod_share.REQ_SIZE == 64
    assert share == kmod_share.IOC_SHARE
    assert version == kmod_share.IOC_VERSION
    assert off_start == ffi.offsetof("struct bunshin_share_req", "start")
    assert off_pages == ffi.offsetof("struct bunshin_share_req", "pages_mapped")
    assert off_swap == ffi.offsetof("struct bunshin_share_req", "swap_shared")
    assert api == kmod_share.API_VERSION


def test_anonymous_ranges_from_maps():
    maps = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000200000 rw-p 00000000 00:00 0
7f0000200000-7f0000201000 ---p 00000000 00:00 0
7f0000300000-7f0000400000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)
7f1000000000-7f1000028000 r--p 00000000 08:01 393                        /usr/lib/x86_64-linux-gnu/libc.so.6
7f1000228000-7f100022c000 rw-p 00227000 08:01 393                        /usr/lib/x86_64-linux-gnu/libc.so.6
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
7ffc00100000-7ffc00104000 r--p 00000000 00:00 0                          [vvar]
7ffc00104000-7ffc00106000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""
    assert anonymous_ranges(maps) == [
        (0x55D0C0A00000, 0x55D0C0A21000, "rw-p"),
        (0x7F0000000000, 0x7F0000200000, "rw-p"),
        (0x7F0000200000, 0x7F0000201000, "---p"),
        (0x7FFC00000000, 0x7FFC00021000, "rw-p"),
    ]
    own = anonymous_ranges(Path("/proc/self/maps").read_text())
    assert own and all(s < e and s % 4096 == 0 and e % 4096 == 0 for s, e, _ in own)


@pytest.mark.slow
@pytest.mark.vm
def test_kmod_suite_in_vm():
    """Builds the module against Debian's 6.1 headers and runs its tests in a qemu VM."""
    out, _ = host.kmod_vm("test", timeout=1800)
    assert "summary:" in out and " 0 failed" in out
