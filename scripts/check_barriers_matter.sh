#!/usr/bin/env bash
# Proof that the emulation suite bites on barriers: for every __syncthreads() in csrc/kernels,
# a copy of the tree with that one barrier deleted must make test_emulation_kernels fail. A
# barrier whose removal goes unnoticed is either not needed or not tested; both are reported.
#   bash scripts/check_barriers_matter.sh      (works on the files git tracks)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
build() {
  cmake --build "$work/build" -j "${MAX_JOBS:-2}" --target test_emulation_kernels \
    >"$work/build.log" 2>&1 || { cat "$work/build.log"; echo "check_barriers_matter: build failed"; exit 1; }
}
cmake -S "$work" -B "$work/build" "${generator[@]}" -DDPCUDA_BUILD_CUDA=OFF >/dev/null
build

mapfile -t sites < <(grep -rn --include='*.cu' --include='*.cuh' -F '__syncthreads();' csrc/kernels |
                     cut -d: -f1,2)
[ "${#sites[@]}" -gt 0 ] || { echo "no __syncthreads() found in csrc/kernels"; exit 1; }
unnoticed=0
for site in "${sites[@]}"; do
  file=${site%%:*}
  line=${site##*:}
  cp "$file" "$work/$file.orig"
  sed -i "${line}s/__syncthreads();/\/* barrier removed *\//" "$work/$file"
  build
  if "$work/build/test_emulation_kernels" >"$work/out.txt" 2>&1; then
    echo "$file:$line: deleting this __syncthreads() was NOT noticed by test_emulation_kernels"
    unnoticed=$((unnoticed + 1))
  else
    echo "$file:$line: deleting this __syncthreads() fails test_emulation_kernels ($(grep -c . "$work/out.txt") lines of failures)"
  fi
  mv "$work/$file.orig" "$work/$file"
done
echo "${#sites[@]} barriers, $unnoticed unnoticed"
[ "$unnoticed" -eq 0 ]
