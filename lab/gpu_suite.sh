#!/usr/bin/env bash
# The GPU checks and benchmarks , run on the device machine from the repo root:
#   lab/gpu_suite.sh tests|api|draft|engine|overlap|serve|budget|hold|prefix|trace|kvdecode|kvmeasure|pdl|ab|tp   (several stages may be given)
# Per-step host/device timing of eager steps: python3 -m lab.steps (see its docstring).
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
# gpu_tests NAME DEFAULT_TIMEOUT_S FILE...: the GPU-marked tests of FILEs, cut at TESTS_TIMEOUT (dumping
# every thread's stack), failures written as they happen (tests/conftest.py); log in $OUT/pytest-NAME.log
gpu_tests() {
  local name=$1 limit=$2
  shift 2
  PAGEDSERVE_FAILURES=$OUT/pytest-failures.txt timeout -s ABRT ${TESTS_TIMEOUT:-$limit} \
    python3 -X faulthandler -m pytest -m gpu -p no:cacheprovider --durations=10 "$@" 2>&1 \
    | tee "$OUT/pytest-$name.log" | tail -15
  echo "pytest exit ${PIPESTATUS[0]}"
}

for stage in "$@"; do
  case $stage in
    tests)
      log "GPU tests"
      # pyproject adds -q (a second -q would drop the summary line); a time limit (the device's calls
      # have one) that dumps every thread's stack if it is reached
      # failures are also written as they happen (tests/conftest.py), in case the time limit cuts the run
      PAGEDSERVE_CHECK_LAUNCH=1 PAGEDSERVE_GPU_REPORT=$OUT/gpu-equality.jsonl PAGEDSERVE_FAILURES=$OUT/pytest-failures.txt \
        timeout -s ABRT ${TESTS_TIMEOUT:-540} \
        python3 -X faulthandler -m pytest -m gpu -p no:cacheprovider --durations=15 \
        tests/engine/test_gpu.py tests/kernels ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
      echo "pytest exit ${PIPESTATUS[0]}"
      ;;
    api)
      log "GPU tests of the API features: pooled embeddings (eager, whole-step and piecewise graphs), each MoE on one GPU"
      gpu_tests api 540 tests/engine/test_embeddings.py tests/engine/test_moe.py
      log "embeddings against their prefill, llama3-8b"
      python3 -m lab.embed_cost --model .models/llama3-8b --prompts 256 --length 512 \
        --result-json "$OUT/embed-cost.json" 2>&1 | tail -1
      ;;
    draft)
      log "GPU tests of speculative decoding (n-gram and draft model)"
      gpu_tests draft 300 tests/engine/test_draft_model.py tests/engine/test_speculative.py
      log "a draft model's round against a decode step, llama3-8b with a qwen2.5-0.5b-shaped draft"
      python3 -m lab.spec_draft --model .models/llama3-8b --draft .models/qwen2.5-0.5b --batch ${BATCHES:-1 8 32} \
        --drafts ${DRAFTS:-4} --result-json "$OUT/spec-draft.json" 2>&1 | grep -v "^{" | tail -12
      ;;
    engine)
      for m in llama3-8b qwen2.5-0.5b; do
        log "offline $m"
        python3 -m lab.offline --model $m --num-prompts 64 --input-len 512 --output-len 128 \
          --result-json "$OUT/offline-$m.json" --profile "$OUT/profile-$m.txt" 2>&1 | tail -2
      done
      log "offline llama3-8b eager"
      python3 -m lab.offline --model llama3-8b --num-prompts 64 --input-len 512 --output-len 128 \
        --enforce-eager --result-json "$OUT/offline-llama3-8b-eager.json" 2>&1 | tail -1
      ;;
    overlap)
      # issue 5: offline, async scheduling (step N+1 scheduled while N runs) against waiting for each step
      for m in ${MODELS:-llama3-8b qwen2.5-0.5b}; do
        for mode in sync async; do
          args=""; [ $mode = sync ] && args="--no-async-scheduling"
          log "offline $m $mode"
          python3 -m lab.offline --model $m --num-prompts 64 --input-len 512 --output-len 128 $args \
            --result-json "$OUT/offline-$m-$mode.json" 2>&1 | tail -1 | cut -c1-400
        done
        python3 -m lab.compare --key output_throughput --baseline "$OUT/offline-$m-sync.json" \
          --out "$OUT/overlap-$m.json" "$OUT/offline-$m-async.json" >/dev/null
      done
      ;;
    serve)
      # issues 4 and 5: 64 streaming clients against serve run, engine loop in a thread vs a process
      for m in ${MODELS:-llama3-8b qwen2.5-0.5b}; do
        for loop in ${LOOPS:-thread process}; do
          log "serve bench $m, engine loop $loop"
          python3 -m serve.cli bench --model $m --load-format dummy --server-command "python3 -m serve.cli run" \
            --server-args="--engine-loop $loop" --concurrency 64 --num-prompts 192 --input-len 512 --output-len 128 \
            --ignore-eos --num-warmups 64 --result-json "$OUT/serve-$m-$loop.json" 2>&1 \
            | grep -E "Output token|Median TPOT|Median TTFT|Roofline|error" | head -6
        done
        [ -f "$OUT/serve-$m-thread.json" ] && [ -f "$OUT/serve-$m-process.json" ] || continue
        python3 -m lab.compare --key output_throughput --baseline "$OUT/serve-$m-thread.json" \
          --out "$OUT/engine-loop-$m.json" "$OUT/serve-$m-process.json"
      done
      ;;
    budget)
      # issues 5 and 8: the serve bench at each step token budget (--max-num-batched-tokens)
      for m in ${MODELS:-llama3-8b qwen2.5-0.5b}; do
        for b in ${BUDGETS:-8192 2048}; do
          log "serve bench $m, max-num-batched-tokens $b"
          python3 -m serve.cli bench --model $m --load-format dummy --server-command "python3 -m serve.cli run" \
            --server-args="--max-num-batched-tokens $b" --concurrency 64 --num-prompts 192 --input-len 512 \
            --output-len 128 --ignore-eos --num-warmups 64 --result-json "$OUT/budget-$m-$b.json" 2>&1 \
            | grep -E "Output token|Median TPOT|Median TTFT|Median ITL|Roofline|error" | head -8
        done
      done
      ;;
    hold)
      # issue 5: Llama-3-8B TPOT at a 32,768-token step budget (a whole burst fits one step), new
      # prompts started at once or held for the rest of their burst (--prefill-hold-ms), same call.
      # The TPOT moved 8.28 -> 10.20 ms between two calls without the hold (2026-11-23), so
      # REPS > 1 repeats the pairs (files hold-MODEL-MS-REP.json; the comparison is against rep 1's 0 ms)
      for m in ${MODELS:-llama3-8b}; do
        for r in $(seq 1 ${REPS:-1}); do
          for h in ${HOLDS:-0 25}; do
            f=$m-$h; [ ${REPS:-1} = 1 ] || f=$m-$h-$r
            log "serve bench $m, max-num-batched-tokens 32768, prefill hold $h ms (rep $r)"
            rm -f "$OUT/trace-hold-$f.jsonl"
            PAGEDSERVE_STEP_TRACE="$OUT/trace-hold-$f.jsonl" python3 -m serve.cli bench --model $m --load-format dummy \
              --server-command "python3 -m serve.cli run" --server-args="--max-num-batched-tokens 32768 --prefill-hold-ms $h" \
              --concurrency 64 --num-prompts 192 --input-len 512 --output-len 128 --ignore-eos --num-warmups 64 \
              --result-json "$OUT/hold-$f.json" 2>&1 | grep -E "Output token|Median TPOT|Median TTFT|Median ITL|Roofline|error" | head -8
            python3 -m bench.trace_summary "$OUT/trace-hold-$f.jsonl" --json "$OUT/trace-summary-hold-$f.json" > /dev/null
            rm -f "$OUT/trace-hold-$f.jsonl"
          done
        done
        base=$m-0; [ ${REPS:-1} = 1 ] || base=$m-0-1
        [ -f "$OUT/hold-$base.json" ] || continue  # no 0 ms run to compare with
        python3 -m lab.compare --key median_tpot_ms --lower-is-better --baseline "$OUT/hold-$base.json" \
          --out "$OUT/prefill-hold-$m.json" $(ls "$OUT"/hold-$m-*.json | grep -v "hold-$base.json")
      done
      ;;
    prefix)
      # issue 8: 64 concurrent requests, a shared 1024-token prefix + 128 unique tokens each
      for pc in on off; do
        args="${BUDGET:+--max-num-batched-tokens $BUDGET}"; [ $pc = off ] && args="$args --no-prefix-caching"
        log "serve bench, shared prefix, prefix caching $pc"
        ${TRACE:+env PAGEDSERVE_STEP_TRACE=$OUT/trace-prefix-$pc.jsonl} python3 -m serve.cli bench --model llama3-8b --load-format dummy --server-command "python3 -m serve.cli run" \
          --server-args="$args" --concurrency 64 --num-prompts 64 --input-len 1152 --shared-prefix-len 1024 \
          --output-len 128 --ignore-eos --num-warmups 64 --result-json "$OUT/prefix-$pc.json" 2>&1 | grep -E "TTFT|throughput|error" | head -8
      done
      python3 -m lab.compare --key median_ttft_ms --lower-is-better --baseline "$OUT/prefix-off.json" \
        --out "$OUT/prefix-caching-ttft.json" "$OUT/prefix-on.json"
      ;;
    trace)
      # issue 5: the engine loop's per-step timeline under serve bench (scheduler/trace.py)
      for m in ${MODELS:-qwen2.5-0.5b llama3-8b}; do
        f=$m${TAG:+-$TAG}
        log "serve bench $m with a step trace ${SERVER_ARGS:-}"
        rm -f "$OUT/trace-$f.jsonl"
        PAGEDSERVE_STEP_TRACE="$OUT/trace-$f.jsonl" python3 -m serve.cli bench --model $m --load-format dummy \
          --server-command "python3 -m serve.cli run" --server-args="${SERVER_ARGS:-}" --concurrency 64 --num-prompts 192 \
          --input-len 512 --output-len 128 --ignore-eos --num-warmups 64 --result-json "$OUT/trace-serve-$f.json" 2>&1 \
          | grep -E "Output token|Median TPOT|Median TTFT|Roofline|error" | head -6
        python3 -m bench.trace_summary "$OUT/trace-$f.jsonl" --json "$OUT/trace-summary-$f.json" > /dev/null
      done
      ;;
    kvdecode)
      # issue 6: decode throughput at batch 64 and 4096-token context, per KV dtype
      for kv in ${KV_DTYPES:-auto fp8 int8}; do
        log "decode-only llama3-8b kv $kv"
        python3 -m lab.offline --model llama3-8b --num-prompts 64 --input-len 4096 --output-len 128 \
          --max-model-len 8192 --kv-cache-dtype $kv --decode-only --repeat 3 ${DECODE_PROFILE:+--profile "$OUT/profile-decode-$kv.txt"} \
          --result-json "$OUT/kvdecode-$kv.json" 2>&1 | tail -1
      done
      python3 -m lab.compare --key output_throughput --baseline "$OUT/kvdecode-auto.json" \
        --out "$OUT/kv-decode-long-context.json" "$OUT/kvdecode-fp8.json" "$OUT/kvdecode-int8.json"
      ;;
    tp)
      # tensor parallelism on GPUS (default 2) GPUs: the one-shot all-reduce against NCCL in graphs,
      # the TP/PP GPU tests, the 8B decode step per layout (LAYOUTS; an "n" layout keeps NCCL), the
      # start-up memory against the budget (lab/tp_memory.py) and kv-calc --measure of the 70B at
      # TP=GPUS; each under a time limit that dumps stacks
      log "all-reduce, ${GPUS:-2} GPUs"
      timeout 150 python3 -m lab.allreduce --gpus ${GPUS:-2} --out "$OUT/allreduce-${GPUS:-2}.json" 2>&1 | tail -13
      log "TP/PP and KV transfer GPU tests"
      timeout -s ABRT 420 python3 -X faulthandler -m pytest -m gpu -p no:cacheprovider \
        tests/engine/test_peer_allreduce.py tests/engine/test_pipeline_parallel.py tests/engine/test_kv_transfer.py 2>&1 | tail -12
      log "decode step ${LAYOUTS:-1x1,2x1,2x1n}"
      timeout -s ABRT 420 python3 -X faulthandler -m lab.pp_check --model llama3-8b --layouts ${LAYOUTS:-1x1,2x1,2x1n} \
        --prompts 8 --output-len 32 --steps 40 --out "$OUT/tp-decode.json" 2>&1 | grep -v '^{' | cut -c1-400
      log "start-up memory, llama3-8b -tp ${GPUS:-2}, one-shot and NCCL only"
      for flag in "" --nccl-only; do
        timeout -s ABRT 150 python3 -X faulthandler -m lab.tp_memory --model llama3-8b --tp ${GPUS:-2} $flag 2>&1 | grep -E '^\{|WARN'
      done
      log "kv-calc --measure llama3-70b -tp ${GPUS:-2}"
      timeout -s ABRT 300 python3 -X faulthandler -m serve.cli kv-calc --model llama3-70b -tp ${GPUS:-2} --measure --json \
        > "$OUT/kvcalc-70b-tp${GPUS:-2}.json" 2> "$OUT/kvcalc-70b-tp${GPUS:-2}.err"; tail -3 "$OUT/kvcalc-70b-tp${GPUS:-2}.err"
      ;;
    kvmeasure)
      log "kv-calc --measure llama3-8b"
      python3 -m serve.cli kv-calc --model llama3-8b --measure --json > "$OUT/kvcalc-measure.json" 2>"$OUT/kvcalc-measure.err"
      tail -c 600 "$OUT/kvcalc-measure.json"; tail -3 "$OUT/kvcalc-measure.err"
      ;;
    pdl)
      # programmatic dependent launch (kernels/pdl.py, the default on Hopper) against plain launches
      # (--no-pdl), decode only; serve: MODELS=qwen2.5-0.5b TAG=plain SERVER_ARGS=--no-pdl lab/gpu_suite.sh trace
      for m in ${MODELS:-qwen2.5-0.5b llama3-8b}; do
        for side in plain pdl plain2; do
          args="--no-pdl"; [ $side = pdl ] && args="--pdl"
          log "decode only $m ($side)"
          python3 -m lab.offline --model $m --num-prompts 64 --input-len 512 --output-len 128 --decode-only \
            --repeat 3 $args --result-json "$OUT/pdl-decode-$m-$side.json" 2>&1 | tail -1 | cut -c1-200
        done
        python3 -m lab.compare --key output_throughput --baseline "$OUT/pdl-decode-$m-plain.json" \
          --out "$OUT/pdl-decode-$m.json" "$OUT/pdl-decode-$m-pdl.json" "$OUT/pdl-decode-$m-plain2.json" > /dev/null
      done
      ;;
    ab)
      # this tree against an older one in the same call (host noise moves serve figures by 10%+
      # between calls): prepare it on the CPU with `mkdir ab-old && git archive REV | tar -x -C ab-old`
      # (untracked, so it travels with the tree). Decode only, then serve with a step trace, new/old/new.
      [ -d "${OLD:-ab-old}" ] || { echo "no old tree at ${OLD:-ab-old}"; exit 2; }
      ln -sfn "$PWD/.whl" "${OLD:-ab-old}/.whl"
      for m in ${MODELS:-qwen2.5-0.5b}; do
        for side in new old; do
          dir=.; [ $side = old ] && dir=${OLD:-ab-old}
          log "decode only $m ($side)"
          (cd $dir && PYTHONPATH=$PWD python3 -m lab.offline --model $m --num-prompts 64 --input-len 512 \
            --output-len 128 --decode-only --repeat 3 --result-json "$OUT/ab-decode-$m-$side.json" 2>&1 | tail -1 | cut -c1-160)
        done
        for side in new old new2; do
          dir=.; [ $side = old ] && dir=${OLD:-ab-old}
          (cd $dir && OUT=$OUT MODELS=$m TAG=ab-$side lab/gpu_suite.sh trace 2>&1 | grep -E "Output|TPOT")
          rm -f "$OUT/trace-$m-ab-$side.jsonl"
        done
      done
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
ls "$OUT"
