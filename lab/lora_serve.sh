#!/usr/bin/env bash
# LoRA served: `serve bench` (64 clients x 512/128, greedy) against a server without adapters and
# one with 4 random adapters of rank 16 on every projection (lab/lora_cost.py's), whose requests
# name the base model, then one adapter, in the same call. Results: $OUT/lora-serve/*.json.
#   MODEL=.models/llama3-8b lab/lora_serve.sh
set -uo pipefail
OUT=${OUT:-/tmp/pagedserve-out}
R=$OUT/lora-serve
mkdir -p "$R"
MODEL=${MODEL:-.models/llama3-8b}
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache
python3 -c "
from pathlib import Path
from lab.lora_cost import random_adapter
for i in range(4):
    random_adapter(Path(f'/tmp/lora-serve/a{i}'), '$MODEL', 16, i)"
PORT=8317

serve_and_bench() {  # LABEL "REQUEST MODEL NAMES" [serve run flags...]
  local label=$1 names=$2
  shift 2
  python3 -m serve.cli run --model "$MODEL" --load-format dummy --port $PORT --log-level warning "$@" \
    > "$R/$label-server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
      2>/dev/null && break
    sleep 1
  done
  for name in $names; do
    echo "== $label, requests name $name ($(date +%T))"
    python3 -m serve.cli bench --url "http://127.0.0.1:$PORT" --model "$MODEL" --served-model-name "$name" \
      --concurrency 64 --num-prompts 192 --input-len 512 --output-len 128 --ignore-eos --num-warmups 64 \
      --result-json "$R/$label-$name.json" 2>&1 | grep -E "Output token|Median TPOT|Median TTFT|Fraction|error|Error" | head -8
  done
  kill -INT $pid
  wait $pid
}

base=$(basename "$MODEL")
serve_and_bench plain "$base"
serve_and_bench lora "$base a0" --lora-modules a0=/tmp/lora-serve/a0 a1=/tmp/lora-serve/a1 a2=/tmp/lora-serve/a2 \
  a3=/tmp/lora-serve/a3
