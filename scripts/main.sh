#!/bin/bash
# Set up (idempotent) and run the main job.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
"$REPO/scripts/setup.sh"
# GRPO with TRL on the shipped shell tasks, tiny offline policy; report in $BUNSHIN_HOME/train/
exec "${BUNSHIN_VENV:-$REPO/.venv}/bin/bunshin" train "$@"
