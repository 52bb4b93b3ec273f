#!/usr/bin/env bash
# Stall-free batching on the GPU: `serve bench` with `serve run` defaults at the workloads of the
# overlap issue, for this tree and, with BASE=DIR, for a baseline tree in the same call.
#   lab/overlap.sh [STAGE...]   stages: 8b-64 8b-256 70b-64 70b-256 qwen-64 8b-fp8 8b-int4 8b-int4-long 8b-int4-8 qwen-int4 8b-sampled
#                               qwen-sampled 8b-text qwen-text 8b-ragged
# MODELS_DIR holds llama3-8b/, llama3-70b/ and qwen2.5-0.5b/ (a config.json with the shapes, tokenizer files), and
# for the int4 stages llama3-8b-awq/ and qwen2.5-0.5b-awq/ (the same with an AWQ quantization_config);
# results go to $OUT/overlap/*.json and, packed, $OUT/overlap.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/pagedserve-out}
R=$OUT/overlap
mkdir -p "$R"
MODELS_DIR=$(cd "${MODELS_DIR:-.models}" && pwd)
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache
log() { echo "== $* ($(date +%T))"; }

# bench TREE LABEL MODEL CONCURRENCY PROMPTS [serve bench flags...]; SERVER_ARGS: `serve run` flags;
# WARMUPS: warm-up requests (default: the concurrency); TRACE=1: a step trace, summarized into $R/LABEL-trace.json (bench/trace_summary.py); KEEP_TRACE=1 also
# keeps the trace itself as $R/LABEL.jsonl.gz
bench() {
  local tree=$1 label=$2 model=$3 c=$4 n=$5
  shift 5
  log "$label ${SERVER_ARGS:-}"
  rm -f "$R/$label.jsonl"
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD ${TRACE:+env PAGEDSERVE_STEP_TRACE=$R/$label.jsonl} python3 -m serve.cli bench \
    --model "$MODELS_DIR/$model" --load-format dummy --server-command "python3 -m serve.cli run" \
    --server-args="${SERVER_ARGS:-}" --concurrency "$c" --num-prompts "$n" \
    --input-len 512 --output-len 128 --ignore-eos --num-warmups "${WARMUPS:-$c}" --result-json "$R/$label.json" "$@" 2>&1 \
    | grep -E "Output token|Median TPOT|Median TTFT|P99 ITL|chunk gap|bound|Fraction|Matmul|SM clock|power cap|error|Error" | head -20)
  if [ -f "$R/$label.jsonl" ]; then
    PYTHONPATH=$PWD python3 -m bench.trace_summary "$R/$label.jsonl" --after-idle 200 --json "$R/$label-trace.json" \
      --model "$MODELS_DIR/$model" --bench-json "$R/$label.json" \
      > "$R/$label-trace.txt" && head -${TRACE_LINES:-30} "$R/$label-trace.txt"
    if [ -n "${KEEP_TRACE:-}" ]; then gzip -f "$R/$label.jsonl"; else rm -f "$R/$label.jsonl"; fi
  fi
}

both() {  # the stage on this tree, then on BASE
  local label=$1
  shift
  bench . "$label" "$@"
  [ -n "${BASE:-}" ] && bench "$BASE" "$label-base" "$@"
}

for stage in "$@"; do
  case $stage in
    8b-64) both 8b-64 llama3-8b 64 192 ;;
    8b-256) both 8b-256 llama3-8b 256 768 ;;
    70b-64) both 70b-64 llama3-70b 64 192 ;;
    70b-256) both 70b-256 llama3-70b 256 768 ;;
    qwen-64) both qwen-64 qwen2.5-0.5b 64 640 ;;
    8b-fp8)  # --quantization fp8 against the 16-bit weights, same call
      bench . 8b-bf16 llama3-8b 64 192
      SERVER_ARGS="--quantization fp8" bench . 8b-fp8 llama3-8b 64 192 ;;
    8b-int4)  # a 4-bit (AWQ) checkpoint's config against the 16-bit weights, same call
      bench . 8b-bf16 llama3-8b 64 192
      bench . 8b-int4 llama3-8b-awq 64 192 ;;
    8b-int4-long)  # the 4-bit 8B with longer prompt steps (the dequantization amortized over ~1,024
      # rows; bench/NOTES.md 2026-11-29 simulated +24% tok/s at a stall factor of 6) against defaults
      bench . 8b-int4 llama3-8b-awq 64 192
      SERVER_ARGS="--max-step-ms ${STEP_MS:-30}" bench . 8b-int4-long llama3-8b-awq 64 192 ;;
    8b-int4-8)  # the same with 8 clients: decode steps of at most 8 rows
      bench . 8b-bf16-8 llama3-8b 8 32
      bench . 8b-int4-8 llama3-8b-awq 8 32 ;;
    qwen-int4)
      bench . qwen-bf16 qwen2.5-0.5b 64 640
      bench . qwen-int4 qwen2.5-0.5b-awq 64 640 ;;
    8b-sampled)
      bench . 8b-greedy llama3-8b 64 192
      bench . 8b-sampled llama3-8b 64 192 --temperature 0.8 --top-p 0.95 ;;
    qwen-sampled)
      bench . qwen-greedy qwen2.5-0.5b 64 640
      bench . qwen-sampled qwen2.5-0.5b 64 640 --temperature 0.8 --top-p 0.95 ;;
    8b-text)
      bench . 8b-ids llama3-8b 64 192
      bench . 8b-text llama3-8b 64 192 --prompt-format text ;;
    qwen-text)
      bench . qwen-ids qwen2.5-0.5b 64 640
      bench . qwen-text qwen2.5-0.5b 64 640 --prompt-format text ;;
    8b-ragged) both 8b-ragged llama3-8b 64 256 --range-ratio 0.5 --request-rate "${RATE:-40}" ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
tar -czf "$OUT/overlap.tar.gz" -C "$OUT" overlap
