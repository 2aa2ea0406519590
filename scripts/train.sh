#!/usr/bin/env bash
# The README's main job: the set-up (scripts/setup.sh: virtual environment, torch, the build; each
# skipped when already done), then `python -m dpcuda train` with this script's arguments.
# DPCUDA_VENV and DPCUDA_TORCH as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${DPCUDA_VENV:-.venv}/bin/python" -m dpcuda train "$@"
