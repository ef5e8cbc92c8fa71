"""Running commands in a workspace: results, failures, timeouts, large and binary output,
stdin, environment, working directory, user; and the binary-safe file operations."""

from __future__ import annotations

import errno
import hashlib
import os
import time

import pytest

from bunshin_gym.workspace import AgentError, WorkspaceError

MB10 = 10 * 2**20


# results and failures ------------------------------------------------------------------
def test_stdout_stderr_and_exit_code(ws):
    res = ws.exec("echo out; echo err >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, b"out\n", b"err\n", False)
    assert not res.ok and res.duration >= 0
    ok = ws.exec("true")
    assert ok.ok and ok.exit_code == 0 and ok.stdout == b"" and ok.stderr == b""


def test_argv_is_not_reparsed_by_a_shell(ws):
    res = ws.exec(["printf", "%s|", "a b", "$HOME", "'q'", "*"], check=True)
    assert res.stdout == b"a b|$HOME|'q'|*|"


def test_shell_string_uses_sh(ws):
    assert ws.exec("echo $((6 * 7)) | tr 4 X", check=True).text == "X2\n"


def test_unknown_command_in_shell_is_127(ws):
    res = ws.exec("no-such-command-xyz")
    assert res.exit_code == 127 and b"no-such-command-xyz" in res.stderr


def test_unknown_program_in_argv_names_it(ws):
    with pytest.raises(AgentError) as ei:
        ws.exec(["/usr/bin/no-such-program-xyz", "arg"])
    assert "no-such-program-xyz" in str(ei.value) and ws.id in str(ei.value)
    assert ei.value.errno == errno.ENOENT
    assert ws.exec("echo still fine", check=True).text == "still fine\n"


def test_killed_by_a_signal_is_a_failure(ws):
    res = ws.exec("kill -9 $$")
    assert not res.ok and res.exit_code != 0 and not res.timed_out


def test_check_raises_naming_the_workspace_command_and_stderr(ws):
    with pytest.raises(WorkspaceError) as ei:
        ws.exec("echo boom-detail >&2; exit 5", check=True)
    msg = str(ei.value)
    assert ws.id in msg and "exited 5" in msg and "boom-detail" in msg


@pytest.mark.parametrize("cmd", ["", "   ", [], [""]])
def test_empty_command_is_refused(ws, cmd):
    with pytest.raises(ValueError, match="empty command"):
        ws.exec(cmd)
    with pytest.raises(ValueError, match="empty command"):
        ws.spawn(cmd)


# timeouts ------------------------------------------------------------------------------
def test_timeout_kills_only_that_command(fresh_ws):
    ws = fresh_ws
    bg = ws.spawn(["sleep", "1000"])
    t0 = time.monotonic()
    res = ws.exec("echo started; sleep 1001 & sleep 1002", timeout=0.5)
    elapsed = time.monotonic() - t0
    assert res.timed_out and not res.ok and 0.4 < elapsed < 5
    assert res.stdout == b"started\n"  # output up to the kill is kept
    # the command's whole process group is gone, including its background child ...
    ps = ws.exec("ps -e -o pid=,args=", check=True).text
    assert "sleep 1001" not in ps and "sleep 1002" not in ps
    # ... while the workspace and a process spawned earlier keep running
    assert f"{bg} sleep 1000" in " ".join(ps.split()), ps
    assert ws.exec(["kill", "-0", str(bg)]).ok
    with pytest.raises(WorkspaceError, match="timed out"):
        ws.exec("sleep 10", timeout=0.2, check=True)


def test_timeout_with_a_process_that_left_the_group(fresh_ws):
    # setsid puts a grandchild out of reach of the group kill while it holds the pipes
    ws = fresh_ws
    t0 = time.monotonic()
    res = ws.exec("setsid sleep 1003 & sleep 1004", timeout=0.3)
    assert res.timed_out and time.monotonic() - t0 < 10
    assert ws.exec("echo alive", check=True).text == "alive\n"


def test_no_timeout_waits(ws):
    res = ws.exec("sleep 0.3; echo done", timeout=None)
    assert res.ok and res.text == "done\n" and res.duration >= 0.3


# output --------------------------------------------------------------------------------
def test_ten_megabytes_of_output_on_both_streams(ws):
    digest = ws.exec(f"head -c {MB10} /dev/urandom > /tmp/big && sha256sum /tmp/big", check=True).text.split()[0]
    res = ws.exec("cat /tmp/big; cat /tmp/big >&2; rm /tmp/big", check=True, max_output=MB10)  # default: 1 MiB
    assert len(res.stdout) == MB10 and len(res.stderr) == MB10
    assert hashlib.sha256(res.stdout).hexdigest() == digest
    assert hashlib.sha256(res.stderr).hexdigest() == digest


def test_binary_output_is_byte_exact(ws):
    expect = bytes(range(256)) * 64 + b"\x00\xff\r\n\x00"
    res = ws.exec(["python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)) * 64 + "
                   "b'\\x00\\xff\\r\\n\\x00'); sys.stderr.buffer.write(b'\\xc3\\x28\\x00')"], check=True)
    assert res.stdout == expect and res.stderr == b"\xc3\x28\x00"
    assert "\ufffd" in ws.exec(["printf", "\\303\\050"]).text  # .text replaces undecodable bytes


# stdin ---------------------------------------------------------------------------------
def test_stdin_is_fed_byte_exact(ws):
    data = bytes(range(256)) * 4096 + b"\x00tail"
    res = ws.exec("cat", stdin=data, check=True, max_output=len(data))  # over the default cap of 1 MiB
    assert res.stdout == data
    assert ws.exec("wc -c", stdin=os.urandom(MB10), check=True).text.strip() == str(MB10)


def test_no_stdin_reads_eof(ws):
    res = ws.exec("cat; echo eof", timeout=10)
    assert res.ok and res.stdout == b"eof\n"
    assert ws.exec("cat", stdin=b"").stdout == b""


# environment, cwd, user ----------------------------------------------------------------
def test_default_environment_is_root_in_its_home(ws):
    out = ws.exec('echo "$(id -un) $(id -u) $HOME $USER $(pwd) $PATH $LANG"', check=True).text.split()
    assert out[:5] == ["root", "0", "/root", "root", "/root"]
    assert "/usr/bin" in out[5].split(":") and out[6] == "C.UTF-8"
    # the controller's environment does not leak in
    os.environ["BUNSHIN_TEST_HOST_ONLY"] = "1"
    try:
        assert "BUNSHIN_TEST_HOST_ONLY" not in ws.exec("env", check=True).text
    finally:
        del os.environ["BUNSHIN_TEST_HOST_ONLY"]


def test_env_adds_and_overrides(ws):
    res = ws.exec('echo "$FOO|$HOME|$EMPTY|"', env={"FOO": "bar baz", "HOME": "/elsewhere", "EMPTY": ""},
                  check=True)
    assert res.text == "bar baz|/elsewhere||\n"
    assert ws.exec('echo "${FOO-unset}"', check=True).text == "unset\n"  # not sticky


def test_cwd(ws):
    assert ws.exec("pwd", cwd="/tmp", check=True).text == "/tmp\n"
    assert ws.exec("pwd", cwd="/usr/share", user="user", check=True).text == "/usr/share\n"


def test_bad_cwd_names_the_path(ws):
    with pytest.raises(AgentError) as ei:
        ws.exec("pwd", cwd="/no/such/dir-xyz")
    assert "/no/such/dir-xyz" in str(ei.value) and ei.value.errno == errno.ENOENT


def test_runs_as_user(ws):
    out = ws.exec('echo "$(id -un) $(id -u) $(id -gn) $HOME $USER $LOGNAME $(pwd)"', user="user",
                  check=True).text.split()
    assert out == ["user", "1000", "user", "/home/user", "user", "user", "/home/user"]
    # really unprivileged: root's files are closed to it
    res = ws.exec("cat /etc/shadow", user="user")
    assert res.exit_code != 0 and b"Permission denied" in res.stderr
    # and files it creates are its own
    ws.exec("touch /tmp/owned-by-user", user="user", check=True)
    assert ws.exec("stat -c %U /tmp/owned-by-user; rm /tmp/owned-by-user", check=True).text == "user\n"


# what a command started as a user observes: the same as from Popen(user=, group=), which the
# agent used before it started user commands through ``/.bunshin/init runas`` (to vfork)
_OBSERVE = ("grep -E '^(Uid|Gid|Groups|Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp|SigBlk|SigIgn|SigCgt):' "
            "/proc/self/status; echo pid-is-sid $(( $$ == $(ps -o sid= -p $$) )) $(( $$ == $(ps -o pgid= -p $$) )); "
            "ls /proc/self/fd | wc -l; umask; ulimit -n; cat /proc/$PPID/comm")
_REFERENCE = """
import pwd, subprocess, sys
pw = pwd.getpwnam("user")
cmd = sys.argv[1]
env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
       "TERM": "xterm", "HOME": pw.pw_dir, "USER": "user", "LOGNAME": "user"}
try:
    p = subprocess.run(["/bin/sh", "-c", cmd] if cmd != "-" else sys.argv[2:], user="user", group=pw.pw_gid,
                       start_new_session=True, capture_output=True, cwd="/tmp", env=env)
    sys.stdout.buffer.write(p.stdout + p.stderr)
except OSError as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_a_users_command_observes_what_popen_user_gives(ws):
    ws.write_file("/tmp/reference.py", _REFERENCE)
    ref = ws.exec(["python3", "/tmp/reference.py", _OBSERVE], check=True).text
    got = ws.exec(_OBSERVE, user="user", cwd="/tmp", check=True).text
    assert got == ref  # the parent's comm too: the agent is python3 as the reference is
    assert "Uid:\t1000\t1000\t1000\t1000" in got and "CapEff:\t0000000000000000" in got
    assert "pid-is-sid 1 1" in got and got.splitlines()[-4] == "4"  # fds 0-2 and ls's own: no report pipe


@pytest.mark.parametrize("argv, error", [
    (["no-such-program-xyz"], "FileNotFoundError: [Errno 2] No such file or directory: 'no-such-program-xyz'"),
    (["/tmp/not-executable"], "PermissionError: [Errno 13] Permission denied: '/tmp/not-executable'"),
    (["/tmp/no-shebang"], "OSError: [Errno 8] Exec format error: '/tmp/no-shebang'"),
])
def test_a_users_program_that_cannot_start_fails_as_popen_user_does(ws, argv, error):
    ws.write_file("/tmp/reference.py", _REFERENCE)
    ws.write_file("/tmp/not-executable", "#!/bin/sh\necho ran\n", mode=0o644)
    ws.write_file("/tmp/no-shebang", "echo ran\n", mode=0o755)  # a shell would run it; exec does not
    assert ws.exec(["python3", "/tmp/reference.py", "-", *argv], check=True).text.strip() == error
    with pytest.raises(AgentError) as ei:
        ws.exec(argv, user="user", cwd="/tmp")
    assert error in str(ei.value)
    assert ws.exec("echo still fine", user="user", check=True).text == "still fine\n"


def test_a_users_program_is_found_on_its_path(ws):
    ws.write_file("/tmp/bin-a/tool", "#!/bin/sh\necho from-a\n", mode=0o644, mkdirs=True)  # not executable
    ws.write_file("/tmp/bin-b/tool", "#!/bin/sh\necho from-b \"$0\"\n", mode=0o755, mkdirs=True)
    res = ws.exec(["tool"], user="user", env={"PATH": "/tmp/no-dir:/tmp/bin-a:/tmp/bin-b/"}, check=True)
    assert res.text == "from-b /tmp/bin-b/tool\n"  # past ENOENT and EACCES; one slash, as os.path.join


def test_unknown_user_names_the_user(ws):
    with pytest.raises(AgentError, match="nosuchuser"):
        ws.exec("true", user="nosuchuser")


# files ---------------------------------------------------------------------------------
def test_write_and_read_binary_file(fresh_ws):
    ws = fresh_ws
    data = bytes(range(256)) * 1000 + b"\x00"
    ws.write_file("/root/blob.bin", data)
    assert ws.read_file("/root/blob.bin") == data
    assert ws.exec("sha256sum /root/blob.bin", check=True).text.split()[0] == hashlib.sha256(data).hexdigest()
    assert (ws.upper / "root" / "blob.bin").read_bytes() == data  # it landed in the upper layer
    big = os.urandom(MB10)
    ws.write_file("/tmp/big.bin", big)
    assert ws.read_file("/tmp/big.bin") == big
    ws.write_file("/root/empty", b"")
    assert ws.read_file("/root/empty") == b""


def test_write_text_overwrites_and_reads_back(fresh_ws):
    ws = fresh_ws
    ws.write_file("/root/t.txt", "long first version\n")
    ws.write_file("/root/t.txt", "héllo\n")
    assert ws.read_file("/root/t.txt") == "héllo\n".encode()
    assert ws.exec("cat /root/t.txt", check=True).text == "héllo\n"


def test_write_file_mode_owner_and_mkdirs(fresh_ws):
    ws = fresh_ws
    ws.write_file("/home/user/a/b/c/run.sh", "#!/bin/sh\necho ran $(id -un)\n", mode=0o755, owner="user")
    st = ws.exec("stat -c '%a %U' /home/user/a/b/c/run.sh", check=True).text.split()
    assert st == ["755", "user"]
    assert ws.exec("/home/user/a/b/c/run.sh", user="user", check=True).text == "ran user\n"
    ws.write_file("/root/secret", b"s", mode=0o600)
    assert ws.exec("stat -c '%a %U' /root/secret", check=True).text.split() == ["600", "root"]


def test_write_without_mkdirs_into_a_missing_dir_fails(ws):
    with pytest.raises(AgentError) as ei:
        ws.write_file("/no-such-dir-xyz/f", b"x", mkdirs=False)
    assert "/no-such-dir-xyz/f" in str(ei.value) and ei.value.errno == errno.ENOENT


def test_read_missing_file_names_the_path(ws):
    with pytest.raises(AgentError) as ei:
        ws.read_file("/root/does-not-exist-xyz")
    msg = str(ei.value)
    assert "/root/does-not-exist-xyz" in msg and ws.id in msg and "read_file" in msg
    assert ei.value.errno == errno.ENOENT


def test_read_a_directory_fails_clearly(ws):
    with pytest.raises(AgentError) as ei:
        ws.read_file("/etc")
    assert "/etc" in str(ei.value) and ei.value.errno == errno.EISDIR


def test_read_file_sees_the_workspace_not_the_host(ws):
    assert ws.read_file("/proc/sys/kernel/hostname") == ws.id.encode() + b"\n"
