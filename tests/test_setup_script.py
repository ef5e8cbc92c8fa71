"""Set-up's shell helpers (scripts/lib/host.sh, scripts/setup.sh) under the shell options
set-up runs with, without needing a fresh machine: the package detection runs against an
empty dpkg database (a fresh machine's view: nothing installed), the ERR trap against a
failing command, the archive lookup with and without ``BUNSHIN_MIRROR``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_SH = REPO / "scripts" / "lib" / "host.sh"
SETUP_SH = REPO / "scripts" / "setup.sh"
#: the detection line set-up used before it moved into missing_packages (issue 14)
OLD_DETECTION = ("missing=$(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n' $PKGS 2>/dev/null "
                 "| awk '$1!=\"ii\"{print $2}')")
NOT_A_PACKAGE = "bunshin-no-such-package"


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env})


@pytest.fixture
def empty_dpkg_db(tmp_path: Path) -> Path:
    """A dpkg database in which nothing is installed (an empty ``status`` file)."""
    (tmp_path / "status").write_text("")
    (tmp_path / "updates").mkdir()
    return tmp_path


def test_missing_packages_lists_everything_on_an_empty_db_under_set_e_and_pipefail(empty_dpkg_db):
    res = bash(f"set -Eeuo pipefail\nsource {HOST_SH}\n"
               f"missing=$(missing_packages --admindir {empty_dpkg_db} gcc tar)\necho \"missing:$missing\"")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("missing:", 1)[1].split() == ["gcc", "tar"]


def test_missing_packages_lists_only_the_missing_ones_of_the_real_db():
    installed = ["dpkg", "bash", "coreutils"]  # every Debian system has them
    for p in installed:
        assert subprocess.run(["dpkg-query", "-W", p], capture_output=True).returncode == 0
    res = bash(f"set -Eeuo pipefail\nsource {HOST_SH}\n"
               f"missing=$(missing_packages dpkg {NOT_A_PACKAGE} bash coreutils {NOT_A_PACKAGE}-2)\n"
               "echo \"missing:$missing\"")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("missing:", 1)[1].split() == [NOT_A_PACKAGE, f"{NOT_A_PACKAGE}-2"]


def test_the_old_detection_line_ended_set_up_on_an_empty_db(empty_dpkg_db):
    """The bug the test above guards against: the old line exits 1 where the fix exits 0
    (so the test would have caught it)."""
    old = OLD_DETECTION.replace("dpkg-query -W", f"dpkg-query --admindir={empty_dpkg_db} -W")
    res = bash(f"set -euo pipefail\nPKGS='gcc tar'\n{old}\necho reached")
    assert res.returncode == 1 and "reached" not in res.stdout


def _trap_lines() -> str:
    """setup.sh's own step bookkeeping and ERR trap, copied out of the script."""
    keep = [ln for ln in SETUP_SH.read_text().splitlines()
            if ln.startswith(("STEP=", "step()", "trap "))]
    assert len(keep) == 3, keep
    return "\n".join(keep)


def test_a_failing_set_up_step_names_the_step_the_command_and_its_status(tmp_path):
    res = bash(f"set -Eeuo pipefail\n{_trap_lines()}\n"
               "step \"7. demo step\"\ntrue\n"
               f"ls {tmp_path}/not-there\necho reached")
    assert res.returncode != 0 and "reached" not in res.stdout
    msg = re.sub(r"\x1b\[[0-9;]*m", "", res.stderr)
    assert 'FAILED in step "7. demo step"' in msg, msg
    assert f'"ls {tmp_path}/not-there" exited 2' in msg, msg


def test_a_step_failing_inside_a_function_is_named_too():
    """-E (errtrace): a command failing in a function reports the step that called it."""
    res = bash(f"set -Eeuo pipefail\n{_trap_lines()}\n"
               "build() { false; }\nstep \"2. CRIU build\"\nbuild\necho reached")
    msg = re.sub(r"\x1b\[[0-9;]*m", "", res.stderr)
    assert res.returncode == 1 and 'FAILED in step "2. CRIU build": "false" exited 1' in msg, msg


def _doctor_step() -> str:
    """Set-up's last step (``step "6. bunshin doctor"`` to the end of scripts/setup.sh)."""
    text = SETUP_SH.read_text()
    return text[text.index('step "6. bunshin doctor"'):]


@pytest.mark.parametrize("healthy", [True, False])
def test_the_doctor_step_shows_every_failed_check_and_its_fix(tmp_path, healthy):
    """Set-up printed only doctor's last line ("10 of 11 checks pass; see the fixes above"), the
    fixes above cut off, and a failing doctor was reported as step 5's "tail -1" exiting 1 (seen
    on a fresh Debian 12 chroot). Now: the summary when all pass; every line, under the doctor's
    own step name, when one fails."""
    doctor = tmp_path / "bunshin"
    lines = ["[ok  ] root         running as root", "[FAIL] images       not built",
             "                    fix: bunshin image build base", "1 of 2 checks pass; see the fixes above"]
    if healthy:
        lines = [lines[0], "1 of 1 checks pass"]
    doctor.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + f"\nEOF\nexit {0 if healthy else 1}\n")
    doctor.chmod(0o755)
    res = bash(f"set -Eeuo pipefail\nsay() {{ echo \"[setup] $*\"; }}\n{_trap_lines()}\nBUNSHIN={doctor}\n"
               f"{_doctor_step()}\necho reached")
    msg = re.sub(r"\x1b\[[0-9;]*m", "", res.stderr)
    if healthy:
        assert res.returncode == 0 and "reached" in res.stdout, msg
        assert "checks everything: 1 of 1 checks pass" in res.stdout
        assert "[ok  ] root" not in res.stdout
    else:
        assert res.returncode != 0 and "reached" not in res.stdout
        assert all(line in res.stdout for line in lines), res.stdout
        assert 'FAILED in step "6. bunshin doctor"' in msg, msg


def test_debian_archive_prints_bunshin_mirror_when_set():
    res = bash(f"source {HOST_SH}\ndebian_archive", BUNSHIN_MIRROR="http://mirror.internal.example/debian")
    assert res.returncode == 0 and res.stdout.strip() == "http://mirror.internal.example/debian"


def test_debian_archive_without_override_is_the_host_apt_archive():
    """Without BUNSHIN_MIRROR the URI is the one apt-cache policy lists for bookworm/main."""
    policy = subprocess.run(["apt-cache", "policy"], capture_output=True, text=True).stdout
    uris = [f[1] for ln in policy.splitlines() if len(f := ln.split()) >= 5
            and f[2] == "bookworm/main" and f[4] == "Packages"]
    res = bash(f"source {HOST_SH}\ndebian_archive")
    assert res.returncode == 0
    assert uris, "this host's apt has no bookworm/main archive"
    assert res.stdout.strip() == uris[0]


def test_setup_installs_every_extra_and_every_dependency_is_pinned():
    """A fresh machine gets exactly what the package needs, at the pinned versions: setup.sh
    installs every optional extra of pyproject.toml (one left out would be missing only on new
    machines: CI's venv already has it), and each direct dependency has a pin in constraints.txt."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    line = re.search(r'-e "\$REPO\[([^\]]*)\]"', (repo / "scripts/setup.sh").read_text())
    assert line, "setup.sh installs the package with no extras list"
    assert set(line.group(1).split(",")) == extras
    pins = {re.split(r"[=@ ]", p, maxsplit=1)[0].strip().lower().replace("_", "-")
            for p in (repo / "constraints.txt").read_text().splitlines() if p and not p.startswith("#")}
    deps = project["dependencies"] + [d for ds in project["optional-dependencies"].values() for d in ds]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert names - pins == set()
    # the one pin installed without its dependencies (its own pins exclude ours): setup installs it
    setup = (repo / "scripts/setup.sh").read_text()
    assert re.search(r'pip" install -q --no-deps -c "\$REPO/constraints.txt" verl ', setup)
    assert "verl==" in (repo / "constraints.txt").read_text()


def test_the_verl_step_installs_the_pin_into_a_venv_that_lacks_it(tmp_path):
    """Set-up's verl line, run as set-up runs it, against a new empty venv (a fresh machine's
    view): it installs the pinned verl and nothing else (--no-deps: verl's own pins would
    fight ours)."""
    import sys

    text = SETUP_SH.read_text()
    line = re.search(r'^\t("\$VENV/bin/pip" install -q --no-deps [^\n]*verl[^\n]*) \|\|$', text, re.M)
    assert line, "set-up has no verl install line"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q", "pip"],
                   check=True, timeout=300, capture_output=True)
    done = bash(f"set -Eeuo pipefail; {line.group(1)}", VENV=str(venv), REPO=str(REPO))
    assert done.returncode == 0, done.stderr[-2000:]
    listed = subprocess.run([str(venv / "bin/pip"), "list", "--format=freeze"], capture_output=True, text=True,
                            check=True, timeout=120).stdout.split()
    pin = next(p for p in (REPO / "constraints.txt").read_text().split() if p.startswith("verl=="))
    assert pin in listed
    assert not any(p.startswith(("torch==", "transformers==", "ray==")) for p in listed), listed


#: the Python of Debian 12's python3 package, which set-up's venv is made from on a fresh machine
DEBIAN_12_PYTHON = "3.11.2"


def test_every_pin_installs_on_debian_12s_python():
    """A pin whose release needs a newer Python than Debian 12's stops set-up on a fresh machine
    with pip's "ResolutionImpossible" (soupsieve 4.1.3 needs >= 3.11.5: set-up stopped there in a
    fresh Debian 12 chroot, while this host's venv, made from a newer 3.11, had it). The check
    reads each pinned distribution's Requires-Python from this venv (set-up installs exactly the
    pins), so it needs no network."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    pins = {canonicalize_name(n): v for n, v in (p.split("==") for p in
            (REPO / "constraints.txt").read_text().split() if "==" in p)}
    checked, refused = 0, []
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if pins.get(name) != dist.version:
            continue  # not a pin, or not the pinned release (then the pin itself is not checked here)
        checked += 1
        needs = dist.metadata.get("Requires-Python")
        if needs and not SpecifierSet(needs).contains(DEBIAN_12_PYTHON):
            refused.append(f"{name}=={dist.version} (Requires-Python {needs})")
    assert checked > len(pins) // 2, f"only {checked} of {len(pins)} pins are installed here"
    assert refused == [], refused
