"""Replies from inside a workspace are bounded in size and time.

Attacks, each as a policy would run it: a command printing 800 MB (the controller must not
grow by it), reading a FIFO, a device or a 50 GB sparse file through the agent's read_file
and through an OSWorld getter (an error in bounded time, never a hang or a 50 GB buffer),
and an X server announcing a reply of 16 GiB (refused before anything is allocated).
"""

from __future__ import annotations

import concurrent.futures
import errno
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bunshin_gym.envs.osworld import tasks
from bunshin_gym.envs.osworld.xclient import XError, XScreen
from bunshin_gym.workspace import AgentError, Workspace

HOSTILE = Path(__file__).with_name("hostile_servers.py")
MiB = 1 << 20


def peak_rss_reset() -> None:
    """Reset this process's peak RSS (VmHWM), so that the next reading is the peak since now."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def bounded(fn, seconds: float, unblock=None):
    """fn() in a thread; fails the test (instead of hanging it) when it takes longer, after
    ``unblock()`` released the blocked request (so that the workspace can still be closed)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn)
    try:
        return future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        if unblock is not None:
            unblock()
        pytest.fail(f"still blocked after {seconds} s (the controller hangs on the workspace)")
    finally:
        pool.shutdown(wait=False)


def open_fifo_writer(ws, path: str):
    """An unblocker: opens the FIFO for writing through another connection (the blocked
    reader then sees end of file)."""
    return lambda: Workspace.attach(ws.id).exec(f"exec 3>{path}", timeout=10)


def test_a_command_printing_800_mb_is_cut_and_the_controller_stays_small(ws):
    size = 800_000_000
    peak_rss_reset()
    base = peak_rss()
    res = bounded(lambda: ws.exec(f"head -c {size} /dev/zero; echo END", timeout=120), 120)
    grown = peak_rss() - base
    assert res.ok
    kept = 1 << 20  # the default cap per stream
    marker = f"\n[... output cut: {size + 4 - kept} bytes not shown ...]\n".encode()
    assert marker in res.stdout
    assert res.stdout.endswith(b"\x00END\n") and len(res.stdout) == kept + len(marker)
    assert grown < 100 * MiB, f"the controller's peak RSS grew by {grown / MiB:.0f} MiB for an 800 MB output"


def test_the_output_cap_is_configurable(ws):
    res = ws.exec("seq 1 100000", max_output=1000)
    assert res.stdout.startswith(b"1\n2\n3\n") and res.stdout.endswith(b"99999\n100000\n")
    assert b"[... output cut: " in res.stdout and len(res.stdout) < 1100


@pytest.mark.parametrize("kind", ["fifo", "device", "sparse-50G"])
def test_read_file_refuses_what_has_no_end(fresh_ws, kind):
    ws = fresh_ws
    path = {"fifo": "/tmp/fifo", "device": "/dev/null", "sparse-50G": "/root/sparse"}[kind]
    if kind == "fifo":
        ws.exec(f"mkfifo {path}", check=True)
    elif kind == "sparse-50G":
        ws.exec(f"truncate -s 50G {path}", check=True)
    t0 = time.monotonic()

    def read():
        with pytest.raises(AgentError) as ei:
            ws.read_file(path)
        return ei.value

    err = bounded(read, 20, open_fifo_writer(ws, path) if kind == "fifo" else None)
    assert time.monotonic() - t0 < 10
    assert "refused" in str(err) and path in str(err)
    assert err.errno == (errno.EFBIG if kind == "sparse-50G" else errno.EINVAL)


def test_a_fifo_planted_as_a_spawn_log_is_refused_not_waited_on(fresh_ws):
    """Services log to fixed paths the policy can replace; the agent opening one must not block."""
    ws = fresh_ws
    ws.exec("mkfifo /tmp/service.log", check=True)
    release = lambda: Workspace.attach(ws.id).exec("exec 3</tmp/service.log", timeout=10)  # noqa: E731
    with pytest.raises(AgentError):
        bounded(lambda: ws.spawn("true", log="/tmp/service.log"), 20, release)
    assert ws.exec("true").ok


def test_osworld_getter_on_a_fifo_scores_nothing_and_does_not_hang(fresh_ws):
    ws = fresh_ws
    ws.exec("mkdir -p /home/user && mkfifo /home/user/answer.txt && truncate -s 50G /home/user/big.txt", check=True)
    with tempfile.TemporaryDirectory() as d:
        env = SimpleNamespace(workspace=ws, eval_dir=d)
        for name in ("answer.txt", "big.txt"):
            got = bounded(lambda n=name: tasks.get_vm_file(env, {"path": f"~/{n}", "dest": n}), 20,
                          open_fifo_writer(ws, f"/home/user/{name}"))
            assert got is None  # a file that cannot be read scores as a missing one
            assert not (Path(d) / name).exists()
    assert ws.exec("true").ok  # the agent still answers


# X -------------------------------------------------------------------------------------
_X_CHILD = textwrap.dedent("""
    import resource, sys, time
    # a controller that allocated what the server announced would die here, not the host
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    sys.path.insert(0, sys.argv[2])
    from bunshin_gym.envs.osworld.xclient import XScreen
    scr = XScreen(sys.argv[1], timeout=10)
    assert scr.capture().shape == (48, 64, 3)  # a sane reply first
    if sys.argv[4] == "damage":  # the server offers DAMAGE: then the attack is in the region reply
        assert scr.last_read_pixels == 64 * 48  # first: whole
        assert scr.capture().shape == (48, 64, 3) and scr.last_read_pixels == 0  # tracked: nothing drawn
    open(sys.argv[3], "w").write(str(0xFFFFFFFF))  # 16 GiB announced next
    t0 = time.monotonic()
    try:
        scr.capture()
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        print(f"after {time.monotonic() - t0:.1f} s")
    else:
        print("no error")
""")


def _run_x_child(damage: bool) -> str:
    """Run ``_X_CHILD`` against a hostile X server on a host unix socket (offering DAMAGE or
    not); its output."""
    sys.path.insert(0, str(HOSTILE.parent))
    try:
        import hostile_servers
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory() as d:
        sock, flag = f"{d}/X0", f"{d}/huge"
        if damage:
            Path(flag + "-damage").touch()
        ready = threading.Event()
        threading.Thread(target=hostile_servers.serve_x, args=(sock, flag, ready), daemon=True).start()
        assert ready.wait(5)
        repo = str(Path(__file__).resolve().parents[2])
        out = subprocess.run([sys.executable, "-c", _X_CHILD, sock, repo, flag, "damage" if damage else "plain"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr[-2000:]


def test_x_reply_with_a_huge_length_is_refused():
    """A fake X server on a host unix socket (the XScreen path without a workspace)."""
    out = _run_x_child(damage=False)
    assert out.startswith("XError: X reply refused"), out
    assert float(out.split("after ")[1].split()[0]) < 5


def test_x_damage_region_with_a_huge_length_is_refused():
    """The same attack on the damage-tracking path: the region reply announces 16 GiB."""
    out = _run_x_child(damage=True)
    assert out.startswith("XError: X reply refused: a damage region"), out
    assert float(out.split("after ")[1].split()[0]) < 5


def test_x_reply_with_a_huge_length_is_refused_through_the_workspace_path(fresh_ws):
    """The same attack from inside a workspace, reached at the real X socket path."""
    from bunshin_gym.envs.osworld import desktop

    ws = fresh_ws
    ws.write_file("/opt/hostile_servers.py", HOSTILE.read_bytes())
    ws.spawn(["python3", "/opt/hostile_servers.py", "x", desktop.X_SOCKET])
    scr = XScreen(desktop.sock_path(ws, desktop.X_SOCKET), timeout=10)
    deadline = time.monotonic() + 20
    while True:
        try:
            assert scr.capture().shape == (48, 64, 3)
            break
        except OSError:
            assert time.monotonic() < deadline, "the stand-in X server did not come up"
            time.sleep(0.05)
    ws.write_file("/tmp/x-huge", str(512 * MiB // 4))  # 512 MiB announced: safe to test on any code
    peak_rss_reset()
    base = peak_rss()
    t0 = time.monotonic()
    with pytest.raises(XError, match="refused"):
        bounded(scr.capture, 30)
    assert time.monotonic() - t0 < 5
    assert peak_rss() - base < 64 * MiB
    assert not scr.connected  # the stream is out of step: dropped, the next capture reconnects
