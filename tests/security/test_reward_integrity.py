"""Reward integrity, written as the attack: with sudo inside the workspace the policy replaces
the binaries (and the loader configuration) its checker relies on with ones that print the
expected answer, then answers wrongly. The reward must stay 0, and the right answer must
still score 1 (the checker runs with the image's binaries, outside the workspace)."""

from __future__ import annotations

import subprocess

import gymnasium as gym
import pytest

import bunshin_gym  # noqa: F401

SUDO = "echo password | sudo -S -p '' "


def fake(binary: str, prints: str) -> str:
    """A shell action that replaces ``binary`` inside the workspace with a script printing ``prints``."""
    return (f"printf '#!/bin/sh\\necho {prints}\\n' > /tmp/fake && chmod 755 /tmp/fake && "
            f"{SUDO}cp /tmp/fake {binary} 2>/dev/null && {binary} --help")


@pytest.fixture
def env():
    e = gym.make("Bunshin-Shell-v0")
    yield e
    e.close()


def test_replaced_tr_does_not_fake_count_files(env):
    env.reset(options={"task": "shell/count-files"})
    obs, *_ = env.step(fake("/usr/bin/tr", "7"))
    assert obs["output"].strip() == "7"  # the attack worked inside: tr now prints the answer
    env.step("echo 3 > /home/user/answer.txt")
    _, reward, terminated, _, _ = env.step("DONE")
    assert terminated and reward == 0.0
    env.rollback()
    env.step(fake("/usr/bin/tr", "7"))
    env.step("ls /data | wc -l > /home/user/answer.txt")  # the right answer still scores
    _, reward, *_ = env.step("DONE")
    assert reward == 1.0


def test_replaced_sqlite3_does_not_fake_the_query(env):
    env.reset(options={"task": "shell/sqlite-insert"})
    obs, *_ = env.step(fake("/usr/bin/sqlite3", "41"))
    assert obs["output"].strip() == "41"
    _, reward, terminated, _, _ = env.step("DONE")  # carol was never inserted
    assert terminated and reward == 0.0


def test_shrunk_reference_file_does_not_fake_line_count(env):
    env.reset(options={"task": "shell/line-count"})
    # the checker compares with `wc -l < /usr/share/common-licenses/GPL-3`: shrink that reference
    # inside to 1 line and answer 1
    obs, *_ = env.step(f"echo one > /tmp/one && {SUDO}cp /tmp/one /usr/share/common-licenses/GPL-3 2>/dev/null && "
                       "wc -l < /usr/share/common-licenses/GPL-3 | tee /home/user/lines.txt")
    assert obs["output"].strip() == "1"
    _, reward, terminated, _, _ = env.step("DONE")
    assert terminated and reward == 0.0


#: a library that ends every process running as root at once, with status 0: preloaded
#: through /etc/ld.so.preload, it makes any root-run checker "succeed" without running
EXIT_ZERO = "#include <unistd.h>\n__attribute__((constructor)) static void f(void) { if (!geteuid()) _exit(0); }\n"


def test_preloaded_library_does_not_fake_the_checker(env, tmp_path):
    src, lib = tmp_path / "x.c", tmp_path / "x.so"
    src.write_text(EXIT_ZERO)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    env.reset(options={"task": "shell/count-files"})
    env.workspace.write_file("/home/user/x.so", lib.read_bytes(), mode=0o755)
    env.step(f"echo 3 > answer.txt; {SUDO}sh -c 'echo /home/user/x.so > /etc/ld.so.preload' 2>/dev/null")
    assert env.workspace.exec("exit 3").exit_code == 0  # the attack works inside: root commands "succeed"
    _, reward, terminated, _, _ = env.step("DONE")
    assert terminated and reward == 0.0


def test_checker_runs_outside_the_workspace_as_nobody(env):
    """The checker's view: the workspace's files, the image's /usr, none of the workspace's
    processes, no capability beyond reading files."""
    from bunshin_gym.workspace import pristine

    env.reset(options={"task": "shell/hello-file"})
    env.step("echo secret > /home/user/mine.txt && chmod 600 /home/user/mine.txt")
    res = pristine.run(env.workspace, "id -u; cat /home/user/mine.txt; ls /proc | wc -l; "
                                      "touch /home/user/x 2>&1 | grep -c 'Read-only'; "
                                      "setpriv --dump | grep -c 'bounding set: dac_override,dac_read_search'")
    uid, secret, procs, readonly, bounding = res.text.split()
    assert (uid, secret, procs, readonly, bounding) == ("65534", "secret", "0", "1", "1")
    assert not env.workspace.cgroup.is_frozen()  # thawed again after the check
    assert env.workspace.exec("echo alive").text.strip() == "alive"


def test_checker_reads_shifted_owners_through_the_workspaces_id_map(env):
    """In a user-namespaced workspace the owners are shifted on disk (inside uid 1000 is host
    uid BASE+1000): the checker runs with the workspace's id map and the image's shifted
    copy, so owners read as they do inside (``stat -c %U`` is ``user``, not ``UNKNOWN``)."""
    import os

    from bunshin_gym.workspace import pristine

    env.reset(options={"task": "shell/hello-file"})
    ws = env.workspace
    base = ws._rec.userns_base
    assert base, "workspaces run in a user namespace"
    ws.exec("mkdir -p /srv/t && echo x > /srv/t/f && chown user:user /srv/t/f", check=True)
    assert os.stat(ws.upper / "srv/t/f").st_uid == base + 1000  # shifted on disk
    res = pristine.run(ws, "stat -c '%u %U' /srv/t/f /usr/bin/tr /etc/hostname; id -u; cat /srv/t/f")
    assert res.text.split() == ["1000", "user", "0", "root", "0", "root", "65534", "x"], res.stderr
    plain = pristine.run(ws, "stat -c '%u %U' /srv/t/f", idmap="")  # without the map: the host's view
    assert plain.text.split() == [str(base + 1000), "UNKNOWN"]


def test_osworld_getter_ignores_a_replaced_cat():
    """The desktop env: the policy (here through the user's shell, as typing into the
    terminal would) replaces /usr/bin/cat, which the task's vm_command_line getter runs, with
    a script printing the expected text; the file stays empty and the reward stays 0."""
    env = gym.make("Bunshin-OSWorld-v0", action_space="pyautogui", require_a11y_tree=False)
    try:
        env.reset(options={"task": "osworld/editor-write-greeting"})
        ws = env.unwrapped.workspace
        ws.exec(f"printf '#!/bin/sh\\necho \"Hello, world!\"\\n' > /tmp/fake && chmod 755 /tmp/fake && "
                f"{SUDO}cp /tmp/fake /usr/bin/cat 2>/dev/null", user="user", check=True)
        assert ws.exec("cat /home/user/greeting.txt", user="user").text.strip() == "Hello, world!"
        _, reward, terminated, _, _ = env.step("DONE")
        assert terminated and reward == 0.0
    finally:
        env.close()
