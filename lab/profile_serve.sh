#!/usr/bin/env bash
# py-spy samples of the serving processes under load (on the GPU host, from the repo root):
#   lab/profile_serve.sh [MODEL]     (default qwen2.5-0.5b, dummy weights)
# Starts `serve run` on port 8123, runs `serve bench` (64 clients, 640 x 512/128), and records 5 s of
# the engine process, the server process and the bench client as collapsed stacks (py-spy --format
# raw) plus a `top` snapshot into $OUT. Needs py-spy on PATH (a wheel carried in .whl works).
set -u
OUT=${OUT:-/tmp/pagedserve-out}
M=${1:-qwen2.5-0.5b}
mkdir -p "$OUT"
python3 -m serve.cli run --model "$M" --load-format dummy --port 8123 > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 180); do curl -s localhost:8123/health >/dev/null && break; sleep 1; done
engine=$(pgrep -P $server -f spawn_main | head -1)
bench=(python3 -m serve.cli bench --url http://127.0.0.1:8123 --model "$M" --concurrency 64 --input-len 512
       --output-len 128 --ignore-eos)
"${bench[@]}" --num-prompts 64 > /dev/null 2>&1  # warm-up
"${bench[@]}" --num-prompts 640 > "$OUT/bench.txt" 2>&1 &
client=$!
sleep 2
for p in engine:$engine server:$server client:$client; do
  py-spy record -r 200 -d 5 --format raw -o "$OUT/${p%%:*}.raw" -p "${p#*:}" --nonblocking > /dev/null 2>&1 &
done
sleep 4; top -b -n 1 | head -15 > "$OUT/top.txt"
wait $client
grep -E "Output token|TPOT|ITL|TTFT" "$OUT/bench.txt"
