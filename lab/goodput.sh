#!/usr/bin/env bash
# Goodput against request rate (issue 36): one GPU against --data-parallel-size 2, the Llama-3-8B
# shape on dummy weights, ragged lengths (512 +- 50% in, 256 +- 50% out), sampled (temperature 0.8,
# top-p 0.95), Poisson arrivals from light load to past saturation.
#   lab/goodput.sh [STAGE...]   stages: 1gpu dp2 tp2 disagg-check disagg disagg-kv 1gpu-saturated dp2-saturated
#   report (disagg: --disaggregate 1:1; X-saturated: closed loop, SAT_CLIENTS (128) clients a GPU;
#   disagg-check: its greedy output against one GPU's; disagg-kv: one rate against it, and the KV
#   transfer's bandwidth and share of TTFT from /metrics)
# One stage per device call fits its 10 minutes (a server start, 64 warm-ups, 10 rates x $N requests).
# MODELS_DIR holds llama3-8b/ (a config.json; tokenizer files optional). Results: $OUT/goodput/*.json,
# report: goodput.md and goodput.png (loose: TTFT <= 2 s, TPOT <= 50 ms; tight: TTFT <= 500 ms,
# TPOT <= 1.25x the roofline decode step), packed: $OUT/goodput.tar.gz.
# RATES (default below), N (requests per rate, 240), MODEL (llama3-8b), IN (512) and OUT_LEN (256)
# override the sweep (a CPU smoke run: MODELS_DIR=/tmp/m MODEL=tiny RATES=20,200 N=8 IN=32 OUT_LEN=8).
set -uo pipefail
OUT=${OUT:-/tmp/pagedserve-out}
R=$OUT/goodput
mkdir -p "$R"
MODELS_DIR=$(cd "${MODELS_DIR:-.models}" && pwd)
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache PYTHONPATH=/tmp/site:$PWD
RATES=${RATES:-4,8,12,16,20,24,32,40,48,64}
N=${N:-240}
MODEL=${MODEL:-llama3-8b}
log() { echo "== $* ($(date +%T))"; }

# sweep LABEL [serve run flags...]
sweep() {
  local label=$1
  shift
  log "$label: serve run $* ; rates $RATES"
  python3 -m serve.cli bench --model "$MODELS_DIR/$MODEL" --load-format dummy \
    --server-command "python3 -m serve.cli run" --server-args="$*" \
    --request-rate "$RATES" --num-prompts "$N" --input-len "${IN:-512}" --output-len "${OUT_LEN:-256}" --range-ratio 0.5 \
    --ignore-eos --temperature 0.8 --top-p 0.95 --num-warmups 64 --goodput ttft:2000 tpot:50 \
    --result-json "$R/$label.json" --plot "$R/$label.png" 2>&1 | tail -30
}

# saturated LABEL CONCURRENCY [serve run flags...]: the throughput at saturation, closed loop, 8 requests
# a client (the tail of a rate sweep's last streams would dilute it: a Poisson run of N requests at a
# rate past saturation is mostly that tail)
saturated() {
  local label=$1 c=$2
  shift 2
  log "$label: saturated, $c clients, serve run $*"
  python3 -m serve.cli bench --model "$MODELS_DIR/$MODEL" --load-format dummy \
    --server-command "python3 -m serve.cli run" --server-args="$*" \
    --concurrency "$c" --num-prompts $((8 * c)) --input-len "${IN:-512}" --output-len "${OUT_LEN:-256}" --range-ratio 0.5 \
    --ignore-eos --temperature 0.8 --top-p 0.95 --num-warmups "$c" \
    --result-json "$R/$label-saturated.json" 2>&1 | grep -E "Output token|Request throughput|Median TPOT|Median TTFT|error|Error"
}

for stage in "$@"; do
  case $stage in
    1gpu) CUDA_VISIBLE_DEVICES=${GPU0:-0} sweep 1gpu ;;
    dp2) sweep dp2 --data-parallel-size 2 ;;
    1gpu-saturated) CUDA_VISIBLE_DEVICES=${GPU0:-0} saturated 1gpu ${SAT_CLIENTS:-128} ;;
    dp2-saturated) saturated dp2 $((2 * ${SAT_CLIENTS:-128})) --data-parallel-size 2 ;;
    tp2) sweep tp2 --tensor-parallel-size 2 ;;
    disagg-check) python3 -m lab.disagg_check --model "$MODELS_DIR/$MODEL" --out "$R/disagg-check.json" ;;
    disagg) sweep disagg --disaggregate 1:1 ;;
    disagg-kv)
      # the KV the server moved at one rate (KV_RATE, default 16 req/s), from its /metrics: bytes and
      # receive time (-> GB/s against the link's 354-386 GB/s), beside the TTFT
      port=${KV_PORT:-8019}
      python3 -m serve.cli run --model "$MODELS_DIR/$MODEL" --load-format dummy --port "$port" --disaggregate 1:1 \
        > "$R/disagg-kv-server.log" 2>&1 &
      pid=$!
      for _ in $(seq 900); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
      python3 -m serve.cli bench --url "http://127.0.0.1:$port" --model "$MODELS_DIR/$MODEL" \
        --request-rate "${KV_RATE:-16}" --num-prompts "$N" --input-len "${IN:-512}" --output-len "${OUT_LEN:-256}" \
        --range-ratio 0.5 --ignore-eos --temperature 0.8 --top-p 0.95 --num-warmups 16 --result-json "$R/disagg-kv.json" 2>&1 \
        | grep -E "Output token|Median TTFT|Median TPOT|Median ITL|P99 ITL|error|Error"
      curl -s "127.0.0.1:$port/metrics" > "$R/disagg-metrics.txt"
      kill -TERM "$pid"; wait "$pid"
      python3 - "$R/disagg-metrics.txt" <<'PY' | tee "$R/disagg-kv.txt"
import sys
from prometheus_client.parser import text_string_to_metric_families
v = {s.name: s.value for f in text_string_to_metric_families(open(sys.argv[1]).read()) for s in f.samples
     if not s.labels.get("role") and "le" not in s.labels}
n, b = v["pagedserve:kv_transfers_total"], v["pagedserve:kv_transfer_bytes_total"]
# the receives timed so far (a GPU's are timed by events once their bytes arrived)
k, tb, t = v["pagedserve:kv_transfer_seconds_count"], v["pagedserve:kv_transfer_timed_bytes_total"], v["pagedserve:kv_transfer_seconds_sum"]
ttft = v["pagedserve:time_to_first_token_seconds_sum"] / max(v["pagedserve:time_to_first_token_seconds_count"], 1)
print(f"KV moved: {n:.0f} prompts, {b / 1e9:.3f} GB; {k:.0f} timed: {tb / 1e9:.3f} GB in {t:.3f} s "
      f"({tb / 1e9 / max(t, 1e-9):.1f} GB/s), {1e3 * t / max(k, 1):.2f} ms per prompt = "
      f"{100 * t / max(k, 1) / max(ttft, 1e-9):.1f}% of the mean TTFT ({1e3 * ttft:.0f} ms)")
PY
      ;;
    report)
      files=()
      for label in 1gpu dp2 tp2 disagg; do
        [ -f "$R/$label.json" ] && files+=("$R/$label.json=$label")
        [ -f "$R/$label-saturated.json" ] && files+=(--saturated "$R/$label-saturated.json=$label")
      done
      python3 -m lab.goodput "${files[@]}" --slo loose=ttft:2000,tpot:50 --slo tight=ttft:500,tpot:1.25x \
        --markdown "$R/goodput.md" --plot "$R/goodput.png"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$R/gpu.txt" 2>/dev/null
      ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
tar -czf "$OUT/goodput.tar.gz" -C "$OUT" goodput
