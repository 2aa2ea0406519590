#!/usr/bin/env bash
# The set-up both README commands share (scripts/test.sh, scripts/train.sh): on a fresh machine it
# creates the virtual environment, installs torch and requirements.txt, and builds dpcuda (the
# CUDA extension where nvcc is found, else CPU-only). Each step is skipped when a stamp says it is
# already done for the same inputs, so a second call costs well under a second:
#   $venv/.dpcuda-deps     the torch requirement + requirements.txt it installed
#   $venv/.dpcuda-build    what the extension was built from, and the built library's checksum
# Knobs:
#   DPCUDA_VENV    the environment folder (default .venv)
#   DPCUDA_TORCH   the torch requirement (default torch==2.11.0, the CUDA 13.0 build matching nvcc
#                  13.0; CI's CPU-only build passes torch==2.13.0, the CPU wheel on these machines)
#   PYTHON         the interpreter that makes the venv (default python3)
#   MAX_JOBS       parallel compile jobs (default 2)
# Progress goes to stderr, so that a caller's stdout stays its own.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${DPCUDA_VENV:-.venv}
torch_req=${DPCUDA_TORCH:-torch==2.11.0}
say() { echo "setup: $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtual environment $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"

deps_key=$(printf '%s\n' "$torch_req" | cat - requirements.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.dpcuda-deps" 2>/dev/null)" != "$deps_key" ]; then
  say "installing $torch_req and requirements.txt into $venv"
  "$py" -m pip install -q --disable-pip-version-check "$torch_req" -r requirements.txt >&2
  echo "$deps_key" >"$venv/.dpcuda-deps"
fi

# What the extension is built from: every file setup.py compiles or reads, the interpreter, torch,
# and what setup.py looks at to choose a CUDA or a CPU-only build (find_cuda_home: CUDA_HOME,
# CUDA_PATH, /usr/local/cuda, nvcc on PATH). The stamp lives in the environment (a new or
# recreated one builds and installs afresh) and records the built library's checksum too: the
# library lies in the tree, which another environment's build may have replaced.
torch_version=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')
nvcc_on_path=$(command -v nvcc || true)
build_key=$({
  find csrc setup.py -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \
    -o -name '*.py' \) -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  echo "$(cd "$venv" && pwd -P) $("$py" -c 'import sys; print(sys.version)') torch $torch_version"
  echo "${DPCUDA_FORCE_CPU:-} ${DPCUDA_DEBUG_INFO:-} ${TORCH_CUDA_ARCH_LIST:-}"
  echo "${CUDA_HOME:-} ${CUDA_PATH:-}"
  echo "${nvcc_on_path:+$(readlink -f "$nvcc_on_path")}"
  ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda/include/cuda_runtime.h 2>/dev/null || true
} | sha256sum | cut -d' ' -f1)
stamp="$venv/.dpcuda-build"
built_lib() { sha256sum dpcuda/_C*.so 2>/dev/null | cut -d' ' -f1 | LC_ALL=C sort | tr '\n' ' '; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$build_key $(built_lib)" ] || [ -z "$(built_lib)" ]; then
  say "building dpcuda (torch $torch_version) into $venv; this takes a few minutes"
  rm -f "$stamp"
  MAX_JOBS=${MAX_JOBS:-2} "$py" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e . >&2
  echo "$build_key $(built_lib)" >"$stamp"
fi
