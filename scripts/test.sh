#!/bin/bash
# Set up (idempotent) and run the tests.
#   scripts/test.sh            the default suite (CI)
#   scripts/test.sh --slow     the slow suites (full task sets, long soaks, the kernel-module VM)
#   scripts/test.sh ARGS...    anything else is passed to pytest
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
"$REPO/scripts/setup.sh"
VENV=${BUNSHIN_VENV:-$REPO/.venv}
cd "$REPO"
if [ "${1:-}" = "--slow" ]; then
	shift
	set -- -m slow "$@"
fi
"$VENV/bin/ruff" check bunshin_gym envs tests bench
exec "$VENV/bin/python" -m pytest "$@"
