#!/usr/bin/env bash
# Compile-check every torch-free CUDA source for sm_80 and sm_90 with nvcc alone, as many at once as the machine has
# cores. Used by .ci/run; prints what it did, and says so when nvcc is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "nvcc-check: nvcc not on PATH: CUDA sources NOT compile-checked"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
check() {  # one source, one architecture: its own log; the line says ok or FAILED
  local f=$1 arch=$2 log="$out/$(basename "$1").sm$2"
  if nvcc -std=c++17 -O3 --expt-relaxed-constexpr -Werror all-warnings -Icsrc \
      -gencode "arch=compute_${arch},code=sm_${arch}" -c "$f" -o "$log.o" >"$log.log" 2>&1; then
    echo "nvcc-check: $f sm_${arch} ok"
  else
    cat "$log.log"; echo "nvcc-check: $f sm_${arch} FAILED"; return 1
  fi
}
export -f check
export out
ls csrc/cuda/*.cu | sed 's/$/ 80/; p; s/ 80$/ 90/' | xargs -P "$(nproc)" -L 1 bash -c 'check "$0" "$1"'
