"""``bunshin explore`` from the command line: it serves the page and the API of a run on
loopback, and refuses a run directory that does not exist."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx

from bunshin_gym.rollout import StepLog


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bunshin(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bunshin_gym.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_explore_serves_a_run(tmp_path):
    log = StepLog(tmp_path / "my-run")
    gid = log.group(task="shell/t", members=1, obs={"output": ""})
    log.step(gid, 0, 0, action="ls", obs={"output": "a"}, reward=1.0, terminated=True, truncated=False, info={},
             duration=0.1)
    port = free_port()
    proc = bunshin("explore", "--run", str(tmp_path / "my-run"), "--port", str(port))
    try:
        assert proc.stdout.readline().startswith(f"bunshin explore: http://127.0.0.1:{port}/")
        deadline = time.monotonic() + 60
        while True:
            try:
                runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=5).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        assert [r["name"] for r in runs] == ["my-run"]
        page = httpx.get(f"http://127.0.0.1:{port}/api/runs/my-run/groups").json()
        assert page["total"] == 1 and page["items"][0]["rewards"] == [1.0]
        assert "<title>bunshin explore</title>" in httpx.get(f"http://127.0.0.1:{port}/").text
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs/other").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs/my-run/media/..%2Fsteps.jsonl").status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def test_explore_refuses_a_missing_run(tmp_path):
    proc = bunshin("explore", "--run", str(tmp_path / "nope"), "--port", str(free_port()))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"{tmp_path / 'nope'}: not a directory" in err and "http://" not in out
