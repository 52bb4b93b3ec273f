#!/usr/bin/env bash
# Mixtures of experts served (issue 38), dummy weights, bf16, 64 clients x (512, 128), greedy, ignore_eos:
#   lab/moe_serve.sh [STAGE...]   stages:
#     qwen     Qwen3-30B-A3B on one GPU: serve bench (its fraction of the MoE-aware roofline) and the same
#              workload through transformers (bench.baseline_hf, static batch), same call
#     mixtral  Mixtral-8x7B on two GPUs: --tensor-parallel-size 2 with and without --enable-expert-parallel
# Results: $OUT/moe/*.json, packed $OUT/moe.tar.gz. NUM (requests, 192) overrides the run length.
set -uo pipefail
OUT=${OUT:-/tmp/pagedserve-out}
R=$OUT/moe
mkdir -p "$R"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v llguidance)
fi
export PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=${PAGEDSERVE_CACHE:-/tmp/pagedserve-cache} PYTHONPATH=/tmp/site:$PWD
N=${NUM:-192}
log() { echo "== $* ($(date +%T))"; }

# bench LABEL MODEL [serve run flags...]
bench() {
  local label=$1 model=$2
  shift 2
  log "$label: serve run $*"
  python3 -m serve.cli bench --model "$model" --load-format dummy --server-command "python3 -m serve.cli run" \
    --server-args="$*" --concurrency 64 --num-prompts "$N" --input-len 512 --output-len 128 --ignore-eos \
    --num-warmups 64 --result-json "$R/$label.json" 2>&1 \
    | grep -E "Output token|Median TPOT|Median TTFT|P99 chunk gap|bound|Fraction|error|Error" | head -12
}

for stage in "$@"; do
  case $stage in
    qwen)
      bench qwen3-30b-a3b Qwen3-30B-A3B
      log "qwen3-30b-a3b through transformers"
      python3 -m bench.baseline_hf --model Qwen3-30B-A3B --num-prompts "$N" --input-len 512 --output-len 128 \
        --batch-size 64 --modes static --result-json "$R/qwen3-30b-a3b-hf.json" 2>&1 | tail -4
      ;;
    mixtral)
      bench mixtral-tp2 Mixtral-8x7B --tensor-parallel-size 2
      bench mixtral-tp2-ep Mixtral-8x7B --tensor-parallel-size 2 --enable-expert-parallel
      python3 -m lab.compare --key output_throughput --baseline "$R/mixtral-tp2.json" \
        --out "$R/mixtral-ep-vs-tp.json" "$R/mixtral-tp2-ep.json"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
tar -czf "$OUT/moe.tar.gz" -C "$OUT" moe
