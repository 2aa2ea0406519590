#!/usr/bin/env bash
# The set-up both README commands share (scripts/test.sh, scripts/train.sh): on a fresh machine it
# creates the virtual environment, installs torch and requirements.txt, and builds dpcuda (the
# CUDA extension where nvcc is found, else CPU-only). Each step is skipped when a stamp says it is
# already done for the same inputs, so a second call costs well under a second:
#   $venv/.dpcuda-deps     the torch requirement + requirements.txt it installed
#   dpcuda/.build-stamp    the sources, the venv and the torch version the extension was built from
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

# What the extension is built from: every file setup.py compiles or reads, the interpreter and torch.
torch_version=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')
build_key=$({
  find csrc setup.py -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \
    -o -name '*.py' \) -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  echo "$(cd "$venv" && pwd -P) $torch_version ${DPCUDA_FORCE_CPU:-} ${TORCH_CUDA_ARCH_LIST:-}"
} | sha256sum | cut -d' ' -f1)
if [ "$(cat dpcuda/.build-stamp 2>/dev/null)" != "$build_key" ] || ! compgen -G 'dpcuda/_C*.so' >/dev/null; then
  say "building dpcuda (torch $torch_version) into $venv; this takes a few minutes"
  rm -f dpcuda/.build-stamp
  MAX_JOBS=${MAX_JOBS:-2} "$py" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e . >&2
  echo "$build_key" >dpcuda/.build-stamp
fi
