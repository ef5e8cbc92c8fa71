"""CI runs the README's test command: `.ci/run` executes, as one of its lines, the command of
the README's "The tests" block, and both scripts are executable in git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_command(label: str) -> str:
    readme = (REPO / "README.md").read_text()
    m = re.search(rf"^{label}.*?\n```sh\n(.*?)\n```", readme, re.S | re.M)
    assert m, f"README has no ```sh block after a paragraph starting {label!r}"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command_word_for_word():
    command = _readme_command("The tests")
    assert command == "scripts/test.sh"
    lines = [ln.strip() for ln in (REPO / ".ci/run").read_text().splitlines()]
    assert command in lines, f".ci/run does not run the README's test command {command!r}: {lines}"


def test_ci_and_readme_scripts_are_executable_in_git():
    out = subprocess.run(["git", "ls-files", "-s", ".ci/run", "scripts/test.sh", "scripts/main.sh"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\n")
    modes = {ln.split()[-1]: ln.split()[0] for ln in out if ln}
    assert modes == {".ci/run": "100755", "scripts/test.sh": "100755", "scripts/main.sh": "100755"}, modes
