#!/bin/bash
# Set up (idempotent) and run the main job.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
"$REPO/scripts/setup.sh"
exec "${BUNSHIN_VENV:-$REPO/.venv}/bin/bunshin" demo "$@"
