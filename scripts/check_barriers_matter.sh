#!/usr/bin/env bash
# Proof that the emulation suite bites on barriers: for every __syncthreads() in csrc/kernels, the
# emulation's tests run with that one barrier removed must fail. A barrier whose removal goes
# unnoticed is either not needed or not tested; both are reported.
#   bash scripts/check_barriers_matter.sh [BUILD [--tested]]
# BUILD: a CMake build of this tree that holds the emulation's tests (CI's build/cmake); without
# it the files git tracks are built in a temporary folder. The emulation removes the barrier at
# run time (DPCUDA_EMU_REMOVE_BARRIER=FILE:LINE, csrc/emu/block.cpp), as if the line were deleted,
# and says so on stderr. Each test runs in turn until one fails having said so, stopping at its
# first failed check (DPCUDA_TEST_FAIL_FAST, tests/cpp/check.h); a run that fails without saying
# so has not reached that barrier and fails this check. The unchanged tests must pass first
# (--tested: they just passed in BUILD's ctest, as in CI, and are not run again). (This script used to rebuild a copy per deleted line and run test_emulation_kernels
# alone; it reported all_reduce.cu's block_tree barriers as noticed, but a clean build of that
# test with either one deleted passes: it never reaches them. test_emulation_reduce_update does.)
set -euo pipefail
build=""
tested=0
if [ $# -ge 1 ]; then
  build=$(cd "$1" 2>/dev/null && pwd) || { echo "check_barriers_matter: no folder $1"; exit 1; }
fi
if [ $# -ge 2 ]; then
  [ "$2" = "--tested" ] || { echo "check_barriers_matter: unknown option $2"; exit 1; }
  tested=1
fi
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tests=(test_emulation_kernels test_emulation_reduce_update test_emulation_schedules
       test_emulation_capture test_emulation_optim)
if [ -z "$build" ]; then
  git ls-files -z | xargs -0 cp --parents -t "$work"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$work" -B "$work/build" "${generator[@]}" -DDPCUDA_BUILD_CUDA=OFF >/dev/null
  cmake --build "$work/build" -j "${MAX_JOBS:-2}" --target "${tests[@]}" \
    >"$work/build.log" 2>&1 || { cat "$work/build.log"; echo "check_barriers_matter: build failed"; exit 1; }
  build=$work/build
fi
for t in "${tests[@]}"; do
  [ -x "$build/$t" ] || { echo "check_barriers_matter: no $build/$t (build the tree first)"; exit 1; }
  [ "$tested" -eq 1 ] && continue
  if ! timeout 600 "$build/$t" >"$work/out.txt" 2>&1; then
    tail -20 "$work/out.txt"
    echo "check_barriers_matter: $t fails with every barrier in place"
    exit 1
  fi
done

mapfile -t sites < <(grep -rn --include='*.cu' --include='*.cuh' --include='*.h' -F '__syncthreads();' csrc/kernels |
                     cut -d: -f1,2)
[ "${#sites[@]}" -gt 0 ] || { echo "no __syncthreads() found in csrc/kernels"; exit 1; }
unnoticed=0
for site in "${sites[@]}"; do
  verdict=""
  for t in "${tests[@]}"; do
    # (bounded: a run that hangs without the barrier fails, as one that gives wrong numbers)
    if DPCUDA_EMU_REMOVE_BARRIER="$site" DPCUDA_TEST_FAIL_FAST=1 timeout 600 "$build/$t" \
        >"$work/out.txt" 2>&1; then
      continue  # (passed: this test did not notice, or never reached the barrier)
    fi
    if grep -qF "$site is removed" "$work/out.txt"; then
      verdict="removing this __syncthreads() fails $t ($(grep -c . "$work/out.txt") lines of output)"
    else
      verdict="FAILED: $t failed without reaching this __syncthreads():"$'\n'"$(tail -5 "$work/out.txt")"
    fi
    break
  done
  case $verdict in
    removing*) echo "$site: $verdict" ;;
    "") echo "$site: removing this __syncthreads() was NOT noticed by ${tests[*]}"
        unnoticed=$((unnoticed + 1)) ;;
    *) echo "$site: $verdict"
       unnoticed=$((unnoticed + 1)) ;;
  esac
done
echo "${#sites[@]} barriers, $unnoticed unnoticed"
[ "$unnoticed" -eq 0 ]
