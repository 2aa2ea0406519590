#!/usr/bin/env bash
# The README's test command. On a fresh machine it creates the virtual environment, installs
# torch 2.11.0 (CUDA 13.0 build, matching nvcc 13.0 and the GPU machines) and the rest of
# requirements.txt, builds dpcuda (the CUDA extension where nvcc is found, else CPU-only) and
# runs the test suite. Extra arguments go to pytest.
#   DPCUDA_VENV    the environment folder (default .venv)
#   DPCUDA_TORCH   the torch requirement (default torch==2.11.0; CI's CPU-only build passes
#                  torch==2.13.0, the CPU wheel on these machines)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DPCUDA_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${DPCUDA_TORCH:-torch==2.11.0}" \
  -r requirements.txt
MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps -e .
"$venv/bin/python" -m pytest -q "$@"
