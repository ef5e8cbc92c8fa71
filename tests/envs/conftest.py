"""Fixtures shared by the env tests."""

from __future__ import annotations

import time

import pytest

#: what chromium's flags leave out in the desktop and web workspaces (envs/osworld/image/chromium.sh,
#: envs/webarena/driver.py): zygotes, a GPU process and a network-service utility, each one more
#: task that every snapshot dumps and every clone restores
CHROMIUM_LEFT_OUT = ("--type=zygote", "--type=gpu-process", "network.mojom.NetworkService")
_COMMAND_LINES = ("for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = chromium ] && "
                  "tr '\\0' ' ' < $p/cmdline && echo; done; true")


@pytest.fixture
def check_chromium_processes():
    """A check of a workspace's chromium: once a renderer has drawn a page, one browser process
    and none of :data:`CHROMIUM_LEFT_OUT`."""

    def check(ws) -> list[str]:
        deadline = time.monotonic() + 20
        while True:
            lines = [line for line in ws.exec(_COMMAND_LINES, user="root").text.splitlines() if line.strip()]
            if any("--type=renderer" in line for line in lines):
                break
            assert time.monotonic() < deadline, f"chromium drew no page (no renderer): {lines}"
            time.sleep(0.3)
        assert sum("--type=" not in line for line in lines) == 1, lines  # one browser process
        for kind in CHROMIUM_LEFT_OUT:
            assert not [line for line in lines if kind in line], f"chromium runs a {kind} process"
        return lines

    return check
