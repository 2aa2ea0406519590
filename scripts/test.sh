#!/usr/bin/env bash
# The README's test command: the set-up (scripts/setup.sh: virtual environment, torch, the build;
# each skipped when already done), then the test suite. Extra arguments go to pytest.
# DPCUDA_VENV and DPCUDA_TORCH as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${DPCUDA_VENV:-.venv}/bin/python" -m pytest -q "$@"
