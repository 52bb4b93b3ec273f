#!/usr/bin/env bash
# The GPU checks and benchmarks of one session, run on the device machine from the repo root:
#   bench/gpu_suite.sh tests|engine|serve|kv   (several stages may be given)
# Results go to $OUT (default /tmp/pagedserve-out). Needs the wheels of ../shared/gpu-wheelhouse.sh
# in .whl for the HTTP stages.
set -uo pipefail
OUT=${OUT:-/tmp/pagedserve-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
log() { echo "== $* ($(date +%T))"; }

for stage in "$@"; do
  case $stage in
    tests)
      log "GPU tests"
      PAGEDSERVE_GPU_REPORT=$OUT/gpu-equality.jsonl python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/test_gpu.py tests/kernels 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15
      ;;
    engine)
      for m in llama3-8b qwen2.5-0.5b; do
        log "offline $m"
        python3 -m bench.offline --model $m --num-prompts 64 --input-len 512 --output-len 128 \
          --result-json "$OUT/offline-$m.json" --profile "$OUT/profile-$m.txt" 2>&1 | tail -2
      done
      log "offline llama3-8b eager"
      python3 -m bench.offline --model llama3-8b --num-prompts 64 --input-len 512 --output-len 128 \
        --enforce-eager --result-json "$OUT/offline-llama3-8b-eager.json" 2>&1 | tail -1
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
ls "$OUT"
