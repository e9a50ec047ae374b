#!/usr/bin/env bash
# Compile-check every torch-free CUDA source for sm_80 and sm_90 with nvcc alone.
# Used by .ci/run; prints what it did, and says so when nvcc is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "nvcc-check: nvcc not on PATH: CUDA sources NOT compile-checked"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in csrc/cuda/*.cu; do
  for arch in 80 90; do
    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -Werror all-warnings -Icsrc \
      -gencode "arch=compute_${arch},code=sm_${arch}" -c "$f" -o "$out/$(basename "$f").sm${arch}.o"
    echo "nvcc-check: $f sm_${arch} ok"
  done
done
