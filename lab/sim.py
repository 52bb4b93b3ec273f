"""The scheduler (scheduler/policy.py, the real one) against a model of step time, on the CPU: a
closed loop of clients, each sending its next request when the last one finished, as `serve bench`
does. Predicts throughput, TPOT, TTFT and chunk gaps of a scheduling policy before GPU time is spent.

    python -m lab.sim --forward 16:5.9,256:6.0,512:10.6,1024:20.9,2048:41.4 --kv-ns 43.7 \
        --concurrency 64 --num-prompts 192 [--max-step-ms 12] [--steps 4] [--request-rate 40 --range-ratio 0.5] \
        [--timeline]

--request-rate: an open loop, Poisson arrivals capped at --concurrency unfinished requests, as `serve
bench --request-rate` sends them; --range-ratio: ragged lengths, drawn as `serve bench` draws them;
--timeline: every batch the scheduler made (decode rows + prompt tokens) and the batches by kind.

--forward: the forward's device time (ms) at row counts, as the engine's cost model measures it
(`serve run` logs it; --forward-from reads it from a serve bench result whose server it started);
--kv-ns: ns per context token of decode attention. A step takes forward(decodes + prompt tokens) +
kv * context + --overhead-ms. A model, not the GPU: on an H200
(2026-11-25) real mixed steps of 64 decodes and ~270 prompt tokens took ~30% longer than it says,
and decode steps ~10% less; a curve timed on a cold GPU is short by what the power limit takes
(bench/NOTES.md, 2026-11-27). With the engine's curve timed at the power limit and --overhead-ms 0
it came within 5% of a served Llama-3-8B run's throughput and median TPOT (H100, 2026-11-27).

--stages N: a pipeline of N stages, --forward giving one stage's times, N micro-batches in flight
as the engine's batch queue keeps them; --num-blocks: a KV cache of that many 16-token blocks, so
that it can bind. With a stage curve shaped like the served steps it came within 2.4-3.5% of the
Llama-3-70B's PP=2 runs at 256 clients (H100s, 2026-11-27).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from bench.workload import length_range
from engine.cost_model import STALL_FACTOR, StepCostModel
from kvcache.block_manager import BlockManager
from scheduler.policy import Scheduler, SchedulerConfig
from scheduler.request import Batch, SampleOutput, SamplingParams, Sequence


@dataclass
class SimResult:
    output_throughput: float
    median_tpot_ms: float
    median_ttft_ms: float
    p99_gap_ms: float
    mean_step_ms: float
    steps: int
    # every scheduled batch in order: (decode rows, prompt tokens, ms for its steps)
    timeline: list[tuple[int, int, float]] = field(default_factory=list, repr=False)


def timeline_summary(timeline: list[tuple[int, int, float]]) -> dict[str, dict[str, float]]:
    """Batches by kind (mixed, decode-only, prompt-only): how many, their ms, their mean decode rows
    and prompt tokens. Where a closed loop loses against `ceiling`: decode-only steps that could
    have carried prompts, and mixed steps short of their decodes (ramp, drain, waiting prompts)."""
    kinds = {"mixed": lambda d, p: d and p, "decode_only": lambda d, p: d and not p,
             "prompt_only": lambda d, p: not d}
    out = {}
    for kind, match in kinds.items():
        rows = [(d, p, ms) for d, p, ms in timeline if match(d, p)]
        n = len(rows)
        out[kind] = {"batches": n, "ms": sum(ms for *_, ms in rows),
                     "mean_decodes": sum(d for d, _, _ in rows) / n if n else 0.0,
                     "mean_prompt_tokens": sum(p for _, p, _ in rows) / n if n else 0.0}
    return out


def simulate(model: StepCostModel, concurrency: int, num_prompts: int, input_len: int, output_len: int,
             num_scheduler_steps: int = 1, overhead_ms: float = 0.3, use_budget: bool = True,
             stages: int = 1, num_blocks: int = 1 << 20, admission_ms: float = 0.0,
             request_rate: float | None = None, range_ratio: float = 0.0, seed: int = 0) -> SimResult:
    """stages > 1: a pipeline of that many stages, each taking `model`'s time for a micro-batch (the
    model is one stage's, pipelined for the stage's budget), with as many micro-batches in flight
    (scheduler/core.py's batch queue). admission_ms: how long a request takes from its client to
    the scheduler (HTTP, the API process, the pipe to the engine, the engine's next read); the
    first wave's too. TTFT counts from the client's send. request_rate: requests a second in a
    Poisson process (None: all at once), sent while fewer than `concurrency` are unfinished;
    range_ratio: lengths drawn as `serve bench --range-ratio` draws them."""
    rng = random.Random(seed)
    (in_lo, in_hi), (out_lo, out_hi) = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    lengths = [(rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)) for _ in range(num_prompts)]
    due = list(itertools.accumulate(rng.expovariate(request_rate) for _ in range(num_prompts))) if request_rate \
        else [0.0] * num_prompts
    bm = BlockManager(num_blocks, 16, False)
    cfg = SchedulerConfig(256, model.max_tokens, in_hi + out_hi + 1, False, 0.0, num_scheduler_steps,
                          model.prompt_budget if use_budget else None, use_budget and model.pipelined)
    s = Scheduler(cfg, bm)
    now = 0.0
    freed = 0.0  # when a client last got room to send (the last finish while all were busy)
    sent = 0
    arrival: dict[int, float] = {}
    chunks: dict[int, list[float]] = {}
    done: list[int] = []

    coming: deque[tuple[float, Sequence]] = deque()  # sent, not yet at the scheduler (in send order)

    def release() -> None:
        """Every request due by now that a client has room for."""
        nonlocal sent
        while sent < num_prompts and due[sent] <= now and sent - len(done) < concurrency:
            n_in, n_out = lengths[sent]
            t = max(due[sent], freed)
            seq = Sequence(sent, [1] * n_in, SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0),
                           max_model_len=cfg.max_model_len, arrival_time=t + admission_ms / 1e3)
            coming.append((t + admission_ms / 1e3, seq))
            arrival[sent], chunks[sent] = t, []
            sent += 1

    def arrive() -> None:
        while coming and coming[0][0] <= now:
            s.add(coming.popleft()[1])

    release()
    step_ms = []
    timeline: list[tuple[int, int, float]] = []
    stage_free = [0.0] * stages  # when each stage is done with the micro-batches given to it
    queue: deque[tuple[Batch, float]] = deque()  # launched micro-batches and when the last stage ends them
    while s.num_unfinished or queue or coming or sent < num_prompts:
        if not s.num_unfinished and not queue:
            # idle until the next request gets here
            now = max(now, coming[0][0] if coming else due[sent] + admission_ms / 1e3)
            release()
        arrive()
        b = None
        if len(queue) < stages:
            if stages == 1:
                b = s.schedule(now)
            else:
                b = s.schedule_micro_batch({it.seq.seq_id for q, _ in queue for it in q.items}, stages)
            if b is not None:
                decodes = b.num_decode
                context = sum(it.end for it in b.items[:decodes])
                ms = (model.step_ms(decodes, context, b.num_tokens - decodes) + overhead_ms) * b.num_steps
                step_ms.append(ms / b.num_steps)
                timeline.append((decodes, b.num_tokens - decodes, ms))
                t = now
                for k in range(stages):
                    t = stage_free[k] = max(t, stage_free[k]) + ms / 1e3
                queue.append((b, t))
        if not queue:
            break
        if b is not None and len(queue) < stages:
            continue  # room for another micro-batch
        b, t = queue.popleft()
        now = max(now, t)
        outs = s.update(b, [SampleOutput(7, None, [7] * (b.num_steps - 1) if b.num_steps > 1 else None)
                            if it.samples else None for it in b.items])
        for o in outs:
            if o.new_token_ids:
                chunks[o.seq_id].append(now)
            if o.finished:
                if sent - len(done) == concurrency:
                    freed = now
                done.append(o.seq_id)
        release()
    tpots = [(c[-1] - c[0]) / (lengths[i][1] - 1) * 1e3 for i, c in chunks.items() if len(c) > 1]
    ttfts = [(chunks[i][0] - arrival[i]) * 1e3 for i in chunks if chunks[i]]
    gaps = sorted((b - a) * 1e3 for c in chunks.values() for a, b in zip(c, c[1:]))
    return SimResult(sum(n_out for _, n_out in lengths) / now, statistics.median(tpots), statistics.median(ttfts),
                     gaps[int(0.99 * (len(gaps) - 1))], statistics.mean(step_ms), len(step_ms), timeline)


def ceiling(model: StepCostModel, concurrency: int, num_prompts: int, input_len: int, output_len: int) -> tuple[float, int]:
    """The most output tokens a second that any schedule of this cost model could serve, and the
    bucket it fills: every step decodes `concurrency` rows (the fewest steps the outputs need),
    the prompts' tokens ride in as few of them as fill one bucket each, the rest decode only. No
    ramp, no drain, no waiting prompt: a closed loop of waves stays below it (bench/NOTES.md)."""
    steps = -(-num_prompts * output_len // concurrency)
    prompt = num_prompts * input_len
    kv = model.kv_ms_per_token * concurrency * (input_len + output_len / 2)  # a step's mean context
    best = (float("inf"), 0)
    for b in model.buckets:
        if b <= concurrency:
            continue
        mixed = -(-prompt // (b - concurrency))
        ms = mixed * model.forward(b) + max(steps - mixed, 0) * model.forward(concurrency) + max(steps, mixed) * kv
        best = min(best, (ms, b))
    return num_prompts * output_len / best[0] * 1e3, best[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.sim", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--forward", help="ROWS:MS,... the measured forward times")
    src.add_argument("--forward-from", metavar="RESULT_JSON",
                     help="a serve bench result's engine_cost_model (the forward times its server logged)")
    p.add_argument("--kv-ns", type=float, default=43.7)
    p.add_argument("--overhead-ms", type=float, default=0.3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-step-ms", type=float, default=None)
    p.add_argument("--steps", type=int, default=1, help="num_scheduler_steps")
    p.add_argument("--no-budget", action="store_true", help="max_num_batched_tokens for every step")
    p.add_argument("--stall-factor", type=float, default=STALL_FACTOR)
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (--forward: one stage's times)")
    p.add_argument("--num-blocks", type=int, default=1 << 20, help="KV blocks of 16 tokens")
    p.add_argument("--admission-ms", type=float, default=0.0,
                   help="a request's way from its client to the scheduler (lab/chunk_delay.py measures it)")
    p.add_argument("--request-rate", type=float, default=None, help="requests a second, Poisson (default: all at once)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len x [1 - R, 1 + R]")
    p.add_argument("--timeline", action="store_true",
                   help="print every batch as DECODES+PROMPT_TOKENS, and the batches by kind (timeline_summary)")
    p.add_argument("--stall-rule", action="store_true",
                   help="pipeline stages budget as one GPU does (no pacing while the cache binds)")
    a = p.parse_args(argv)
    if a.forward_from:
        try:
            cm = json.loads(Path(a.forward_from).read_text())["engine_cost_model"]
            rows, ms = tuple(cm["rows"]), tuple(cm["forward_ms"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"no engine_cost_model in {a.forward_from} ({type(e).__name__}: {e})")
    else:
        rows, ms = zip(*[(int(r), float(m)) for r, m in (x.split(":") for x in a.forward.split(","))])
    model = StepCostModel(rows, ms, a.kv_ns / 1e6, a.max_num_batched_tokens, a.max_step_ms, a.stall_factor,
                          pipelined=a.stages > 1 and not a.stall_rule)
    r = simulate(model, a.concurrency, a.num_prompts, a.input_len, a.output_len, a.steps, a.overhead_ms,
                 not a.no_budget, a.stages, a.num_blocks, a.admission_ms, a.request_rate, a.range_ratio)
    print(f"{r.output_throughput:,.0f} tok/s, median TPOT {r.median_tpot_ms:.2f} ms, median TTFT "
          f"{r.median_ttft_ms:.0f} ms, p99 gap {r.p99_gap_ms:.1f} ms, mean step {r.mean_step_ms:.2f} ms, {r.steps} steps")
    if a.timeline:
        for i in range(0, len(r.timeline), 12):
            print(f"{i:6d}  " + " ".join(f"{d}+{p}" for d, p, _ in r.timeline[i:i + 12]))
        for kind, v in timeline_summary(r.timeline).items():
            print(f"{kind}: {v['batches']} batches, {v['ms']:,.0f} ms, {v['mean_decodes']:.1f} decodes and "
                  f"{v['mean_prompt_tokens']:.0f} prompt tokens on average")
    top, rows = ceiling(model, a.concurrency, a.num_prompts, a.input_len, a.output_len)
    print(f"ceiling of any schedule with these step times: {top:,.0f} tok/s (mixed steps of {rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
