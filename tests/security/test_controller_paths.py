"""The controller (host root) never resolves a path that a workspace controls.

Attack: inside workspace A, root replaces the name of a socket the controller connects to
(the agent's, the desktop input server's) by a symlink into workspace B's root, reached
through the host's ``/proc/<B pid1>/root``. Followed from the host, the next request on A
would run in B. It must run in A or fail, never in B.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bunshin_gym.envs.osworld import desktop
from bunshin_gym.workspace import Workspace, WorkspaceError
from bunshin_gym.workspace.protocol import AGENT_SOCKET

HOSTILE = Path(__file__).with_name("hostile_servers.py")


@pytest.fixture
def victim():
    """Workspace B, whose root the attacker points at."""
    w = Workspace.create("base")
    yield w
    w.close()


def _ran_in(ws, marker: str) -> bool:
    return ws.exec(["test", "-e", marker]).exit_code == 0


@pytest.mark.parametrize("how", ["socket-name", "parent-directory"])
def test_agent_socket_symlink_into_another_workspace(fresh_ws, victim, how):
    a, b = fresh_ws, victim
    target = f"/proc/{b.pid}/root{AGENT_SOCKET}"
    if how == "socket-name":
        plant = f"rm -f {AGENT_SOCKET} && ln -s {target} {AGENT_SOCKET}"
    else:  # the socket's directory becomes a link into B; the agent keeps listening where it was
        plant = f"mv /run/bunshin /run/bunshin.moved && ln -s {Path(target).parent} /run/bunshin"
    a.exec(plant, check=True)
    a.disconnect()  # the next request connects afresh (as after every snapshot)
    marker = f"/root/ran-{how}"
    try:
        res = a.exec(f"touch {marker}; hostname")
    except WorkspaceError as e:  # refusing is fine: the workspace broke its own agent
        assert "not a socket" in str(e) or "No such file" in str(e), e
    else:
        assert res.text.strip() == a.id, f"the exec ran in {res.text.strip()}, not in {a.id}"
    assert not _ran_in(b, marker), "a command sent to workspace A ran in workspace B"


def test_desktop_socket_symlink_into_another_workspace(fresh_ws, victim):
    a, b = fresh_ws, victim
    b.write_file("/opt/hostile_servers.py", HOSTILE.read_bytes())
    b.exec(f"mkdir -p {desktop.STATE}", check=True)
    b.spawn(["python3", "/opt/hostile_servers.py", "silent-desktop"])
    deadline = time.monotonic() + 20
    while not desktop.DesktopClient(b).ping():  # B's server answers pings
        assert time.monotonic() < deadline, "the stand-in desktop server in B did not come up"
        time.sleep(0.05)
    a.exec(f"mkdir -p {desktop.STATE} && ln -s /proc/{b.pid}/root{desktop.DESKTOP_SOCKET} {desktop.DESKTOP_SOCKET}",
           check=True)
    assert not desktop.DesktopClient(a).ping(), "the controller reached B's desktop server through A's symlink"
