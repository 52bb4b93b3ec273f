"""The fused MoE layer (kernels/moe.py) on a GPU at Qwen3-30B-A3B's shape: `python -m lab.moe_gpu --out F`.

Hidden 2048, 128 experts, top 8, expert width 768, bf16, random weights and uniform random routing.
- decode, batch 64: the layer (align + both grouped matmuls + the sum) and the two matmuls alone,
  replayed in a CUDA graph over several layers' experts in turn (each layer's 1.2 GB of experts
  is far beyond L2, as in a decode step); bytes = the experts the batch really touches (distinct
  ids) plus x and the output; the fraction of the measured copy bandwidth (target >= 70%).
- prefill, 4,096 tokens: FLOPs of the active experts (2 x T x k x 3 x hidden x width); the
  fraction of the measured bf16 matmul rate (a torch.matmul probe, bench/hardware.py; target >= 60%);
  also 16,384 tokens with plan()'s tiles (4,096 sits at the ridge point: 256 rows per expert).
- a few tile plans at each size beside plan()'s pick, to tune it.
- the Triton output against the torch reference (kernels/moe_reference.py) at both sizes, and a
  CUDA graph's replay on new inputs against an eager call (the layer captures: no host syncs).
- --engine: also `LLM(model="qwen3-30b-a3b", load_format="dummy")` on this GPU (start-up, KV blocks,
  64 prompts x 512 tokens -> 32 tokens each, tok/s); a few minutes more.
Writes one JSON with the GPU's name and the date to --out.

--sweep instead times the prefill variants of kernels/moe.py's Plan (tiles, program order, gate and
up as one dot, TMA weights, the down kernel's own tiles) at --tokens (512 to 16,384: 32 to 1,024
rows an expert), kernel by kernel: every candidate compiled first on threads,
each timed (CUDA events, median) in program order FIRST_GROUP and its layer output (the other
kernel as the base Plan's, the k rows summed) checked once against the torch reference; then
other program orders of each kernel's fastest at each size; then, per size and row tile, the two
fastest gate/ups with the two fastest downs, each pair timed as a whole layer (CUDA graph, checked
against the reference) beside plan()'s pick, and the best layer's parts alone (align, gate/up,
down, the sum). Decode at 64 tokens is the control (plan()'s pick in each mode). Also a dense
matmul pair with each size's FLOPs. The JSON (rewritten after each phase) has every candidate's
ms, TFLOP/s and fraction of the matmul rate measured in the same run, the best Plan per token
count, and the lines of kernels/moe.py's PLAN_TABLE with the winners (also printed last). The
six default sizes: 22 + 45 compiles (on --threads threads), 378 kernel timings and 78 graph
timings, 44 s on an H100 after the hardware probe (2026-11-26):

    python -m lab.moe_gpu --sweep --out moe_sweep.json

--sm90 (no GPU needed) compiles every --sweep candidate for an H100 with Triton's own ptxas and
prints one JSON line each: shared memory, registers, spills, whether the loop runs on wgmma and
TMA; how the candidate lists were pruned.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the kernels load inside the functions: --help and --sm90 need no GPU
    import torch

    from kernels.moe import Plan

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
DECODE_T, PREFILL_T = 64, 4096
LAYERS = 4  # the decode graph cycles over this many layers' experts (4.8 GB)
# (block_m, block_n, block_k, num_warps, num_stages)
DECODE_PLANS = [(16, 32, 128, 4, 4), (16, 128, 64, 4, 4), (16, 64, 256, 4, 3), (16, 64, 128, 8, 5)]
PREFILL_PLANS = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 8, 3), (64, 64, 64, 4, 3)]
# at 4,096 tokens an expert gets 256 rows: 256 FLOP per weight byte, about the H100's ridge point,
# so the experts' weights must stream at the copy bandwidth too; 16,384 tokens is compute bound
PREFILL_LONG_T = 16384


def _inputs(t: int, seed: int):
    import torch

    from kernels.moe_reference import route
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(t, HIDDEN, device="cuda", generator=g)).bfloat16()
    weights, ids = route(torch.randn(t, EXPERTS, device="cuda", generator=g), TOP_K, renormalize=True)
    return x, weights, ids


def _layer_weights(seed: int):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", generator=g) * WIDTH ** -0.5).bfloat16()
    return w13, w2


def _graph_us(fn, per: int) -> float:
    import torch
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / per


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def decode(layers, copy_bw: float) -> dict:
    import torch

    from kernels import moe
    x, weights, ids = _inputs(DECODE_T, 1)
    touched = int(torch.unique(ids).numel())
    expert_bytes = 3 * HIDDEN * WIDTH * 2
    nbytes = touched * expert_bytes + 2 * DECODE_T * HIDDEN * 2
    out = {"tokens": DECODE_T, "experts_touched": touched, "bytes_per_layer": nbytes, "plan": str(moe.plan(DECODE_T, TOP_K, EXPERTS))}
    plans = []
    for cfg in [None, *DECODE_PLANS]:
        p = moe.Plan(*cfg) if cfg else moe.plan(DECODE_T, TOP_K, EXPERTS)
        sorted_ids, block_expert = moe.align(ids, EXPERTS, 0, p.block_m)
        us_layer = _graph_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids, p=p) for w13, w2 in layers], LAYERS)
        us_kernels = _graph_us(lambda: [moe.experts(x, w13, w2, weights, sorted_ids, block_expert, p)
                                        for w13, w2 in layers], LAYERS)
        row = {"plan": str(p), "picked": cfg is None, "layer_us": us_layer, "kernels_us": us_kernels,
               "layer_fraction_of_copy_bw": nbytes / (us_layer * 1e-6) / copy_bw,
               "kernels_fraction_of_copy_bw": nbytes / (us_kernels * 1e-6) / copy_bw}
        plans.append(row)
        print(f"decode T={DECODE_T} {row['plan']}: layer {us_layer:7.1f} us ({row['layer_fraction_of_copy_bw']:.0%} of copy bw), "
              f"matmuls {us_kernels:7.1f} us ({row['kernels_fraction_of_copy_bw']:.0%})", flush=True)
    align_us = _graph_us(lambda: [moe.align(ids, EXPERTS, 0, 16) for _ in range(LAYERS)], LAYERS)
    print(f"decode align alone: {align_us:.1f} us", flush=True)
    best = max(plans, key=lambda r: r["layer_fraction_of_copy_bw"])
    return {**out, "align_us": align_us, "plans": plans, "picked": plans[0], "best": best,
            "target_fraction": 0.70, "meets_target": plans[0]["layer_fraction_of_copy_bw"] >= 0.70}


def prefill(w13, w2, matmul_flops: float) -> dict:
    from kernels import moe
    x, weights, ids = _inputs(PREFILL_T, 2)
    flops = 2.0 * PREFILL_T * TOP_K * 3 * HIDDEN * WIDTH
    plans = []
    for cfg in [None, *PREFILL_PLANS]:
        p = moe.Plan(*cfg) if cfg else moe.plan(PREFILL_T, TOP_K, EXPERTS)
        sorted_ids, block_expert = moe.align(ids, EXPERTS, 0, p.block_m)
        us_layer = _graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids, p=p), 1)
        us_kernels = _graph_us(lambda: moe.experts(x, w13, w2, weights, sorted_ids, block_expert, p), 1)
        row = {"plan": str(p), "picked": cfg is None, "layer_us": us_layer, "kernels_us": us_kernels,
               "layer_fraction_of_matmul": flops / (us_layer * 1e-6) / matmul_flops,
               "kernels_fraction_of_matmul": flops / (us_kernels * 1e-6) / matmul_flops}
        plans.append(row)
        print(f"prefill T={PREFILL_T} {row['plan']}: layer {us_layer:7.1f} us ({row['layer_fraction_of_matmul']:.0%} of matmul), "
              f"matmuls {us_kernels:7.1f} us ({row['kernels_fraction_of_matmul']:.0%})", flush=True)
    best = max(plans, key=lambda r: r["layer_fraction_of_matmul"])
    x, weights, ids = _inputs(PREFILL_LONG_T, 3)
    long_flops = 2.0 * PREFILL_LONG_T * TOP_K * 3 * HIDDEN * WIDTH
    p = moe.plan(PREFILL_LONG_T, TOP_K, EXPERTS)
    us_long = _graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids, p=p), 1)
    long = {"tokens": PREFILL_LONG_T, "plan": str(p), "layer_us": us_long,
            "layer_fraction_of_matmul": long_flops / (us_long * 1e-6) / matmul_flops}
    print(f"prefill T={PREFILL_LONG_T} {p}: layer {us_long:7.1f} us ({long['layer_fraction_of_matmul']:.0%} of matmul)",
          flush=True)
    return {"tokens": PREFILL_T, "flops": flops, "plans": plans, "picked": plans[0], "best": best, "long": long,
            "target_fraction": 0.60, "meets_target": plans[0]["layer_fraction_of_matmul"] >= 0.60}


def correctness(w13, w2) -> dict:
    """Triton against the torch reference (bf16), eager and replayed from a CUDA graph on new inputs."""
    import torch

    from kernels import moe
    from kernels import moe_reference as ref
    res = {}
    for t in (DECODE_T, PREFILL_T, 3):
        x, weights, ids = _inputs(t, 10 + t)
        res[f"rel_err_T{t}"] = _rel_err(moe.fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids))
    # expert parallel: a rank with the second half of the experts
    x, weights, ids = _inputs(DECODE_T, 5)
    half = EXPERTS // 2
    part = moe.fused_moe(x, w13[half:], w2[half:], weights, ids, half, EXPERTS)
    res["rel_err_expert_parallel_half"] = _rel_err(part, ref.fused_moe(x, w13[half:], w2[half:], weights, ids, half))
    # capture, then replay on other tokens and routing
    x, weights, ids = _inputs(DECODE_T, 6)
    moe.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    x2, weights2, ids2 = _inputs(DECODE_T, 7)
    for static, new in ((x, x2), (weights, weights2), (ids, ids2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    res["rel_err_graph_replay"] = _rel_err(out, ref.fused_moe(x2, w13, w2, weights2, ids2))
    res["ok"] = all(v < 1.5e-2 for v in res.values())
    print("correctness:", res, flush=True)
    return res


def engine() -> dict:
    """The engine with the Qwen3-30B-A3B preset and dummy weights on this GPU."""
    from serve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM("qwen3-30b-a3b", load_format="dummy", max_model_len=4096)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    prompts = [[(i * 131 + j * 7) % 150000 + 10 for j in range(512)] for i in range(64)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    res = {"startup_s": start_s, "startup_phases_s": runner.startup_s, "num_kv_blocks": runner.num_blocks,
           "generate_s": gen_s, "output_tok_s": sum(len(o.token_ids) for o in outs) / gen_s}
    print("engine:", res, flush=True)
    llm.shutdown()
    return res


# --- --sweep -----------------------------------------------------------------------------------
# Candidates, by BLOCK_M. The sweep of 2026-11-26 (H100, bench/results/moe-sweep-2026-11-26.json)
# pruned them: the fastest 64-row layer ran 18% (4,096 tokens) and 21% (16,384) behind the fastest
# 128-row one; weights through TMA tied or beat pointer loads at every tile, and with TMA one
# gate/up dot beat two at every tile; 64 gate/up columns (x2 fused) lost by 8% (4,096) and 27%
# (16,384), 64 or 128 down columns (ungrouped) by >= 36%; group_m 4 was the best order of both
# kernels at 16,384 tokens (g1, g16 within 1-7%). Kept: those winners and neighbours that 256 to
# 1,024 rows an expert may favour (deeper pipelines, BLOCK_K 128 in two stages, 16 warps, 128 down
# columns in groups, where two programs fit an SM). Every one compiles for sm_90 with triton 3.9
# without register spills and within the 227 KB of shared memory (`--sm90`).
# Gate/up tiles (block_n, block_k, num_warps, num_stages), each in GATE_UP_MODES:
# 64-row tiles for 512 to 2,048 tokens (32 to 128 rows an expert), added 2026-11-26.
SWEEP_T = (512, 1024, 2048, 4096, 8192, 16384)
GATE_UP_TILES = {64: [(128, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 2), (64, 64, 4, 4)],
                 128: [(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 16, 4)]}
GATE_UP_MODES = ((True, True),)  # (fuse_gate_up, tma)
# down tiles, each with the loads of DOWN_TMA (act rows and w2 through TMA: True)
DOWN_TILES = {64: [(128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4)],
              128: [(256, 64, 8, 3), (256, 64, 8, 4), (256, 128, 8, 2), (256, 64, 16, 3), (128, 64, 8, 3),
                    (128, 64, 4, 3)]}
DOWN_TMA = (True,)
PERSISTENT = (False, True)  # each gate/up and down candidate one program a tile, and one an SM
FIRST_GROUP = 4  # every candidate's program order in the first phase
GROUPS = (1, 2, 8)  # then each kernel's fastest (TOP_FOR_GROUPS at each size) in these orders
TOP_FOR_GROUPS = 2
TOP_FOR_LAYERS = 2  # per size and row tile: the fastest gate/ups x the fastest downs, each as a layer
DECODE_MODES = ((False, False), (False, True), (True, False), (True, True))  # plan()'s decode tiles in each


@dataclass(frozen=True)
class Sweep:
    """What --sweep runs: shapes and candidates (a test runs a tiny one on the CPU)."""
    out: Path
    iters: int = 20
    threads: int = 8
    sizes: tuple[int, ...] = SWEEP_T
    decode_t: int = DECODE_T
    hidden: int = HIDDEN
    experts: int = EXPERTS
    top_k: int = TOP_K
    width: int = WIDTH
    dtype: str = "bfloat16"
    device: str = "cuda"
    decode_layers: int = LAYERS
    gate_up_tiles: dict = field(default_factory=lambda: GATE_UP_TILES)
    gate_up_modes: tuple[tuple[bool, bool], ...] = GATE_UP_MODES
    down_tiles: dict = field(default_factory=lambda: DOWN_TILES)
    down_tma: tuple[bool, ...] = DOWN_TMA
    persistent: tuple[bool, ...] = PERSISTENT
    first_group: int = FIRST_GROUP
    groups: tuple[int, ...] = GROUPS
    tol: float = 1.5e-2  # relative error against the reference (bf16: tests/kernels/util.py's REL_TOL)

    def __post_init__(self) -> None:
        # a down candidate runs on the first gate/up candidate's output at its row tile
        assert set(self.down_tiles) <= set(self.gate_up_tiles), "every down row tile needs gate/up tiles"


@dataclass
class _Case:
    """One token count and row tile: inputs, align()'s rows, the reference output, and the base
    Plan's gate/up output (the down candidates' input; the gate/up candidates' down)."""
    t: int
    block_m: int
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    expect: torch.Tensor
    base: Plan
    base_act: torch.Tensor


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median ms of back-to-back calls: CUDA events around each (a prefill kernel runs far longer
    than its launch takes on the host), or the host clock on the CPU."""
    import torch
    if device != "cuda":  # a smoke run: the interpreter's time means nothing
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in marks)


def _graph_ms(fn: Callable[[], object], device: str, per: int = 1) -> float:
    """ms per call of fn replayed from a CUDA graph (no host time between the kernels)."""
    if device != "cuda":
        return _time_ms(fn, 1, device) / per
    import triton
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") / per


def _label(kind: str, p: Plan) -> str:
    t = p.gate_up_tiles() if kind == "gate_up" else p.down_tiles()
    fused = " fused" if kind != "down" and p.fuse_gate_up else ""
    return (f"m{p.block_m} n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}{fused}"
            + (" tma" if t.tma else "") + (" persistent" if t.persistent else ""))


def _plan_json(p: Plan) -> dict:
    return {"repr": repr(p), **dataclasses.asdict(p)}


def gate_up_candidates(cfg: Sweep) -> list[Plan]:
    from kernels import moe
    # 16 warps persistent would take 256 KiB of shared memory (--sm90): not a candidate
    return [moe.Plan(bm, *tiles, group_m=cfg.first_group, tma=tma, fuse_gate_up=fused, persistent=pers)
            for bm, tile_list in cfg.gate_up_tiles.items() for tiles in tile_list for fused, tma in cfg.gate_up_modes
            for pers in cfg.persistent if not (pers and tiles[2] > 8)]


def down_candidates(cfg: Sweep) -> list[Plan]:
    """Each down tile as the Plan of the row tile's first gate/up candidate with that down."""
    from kernels import moe
    first = {p.block_m: p for p in reversed(gate_up_candidates(cfg))}
    return [dataclasses.replace(first[bm], down=moe.Tiles(*tiles, group_m=cfg.first_group, tma=tma, persistent=pers))
            for bm, tile_list in cfg.down_tiles.items() for tiles in tile_list for tma in cfg.down_tma
            for pers in cfg.persistent]


def _grouped(kind: str, p: Plan, group_m: int) -> Plan:
    """p with the group_m program order on the kernel `kind`."""
    if kind == "gate_up":
        return dataclasses.replace(p, group_m=group_m)
    return dataclasses.replace(p, down=dataclasses.replace(p.down_tiles(), group_m=group_m))


def _sweep_weights(cfg: Sweep, seed: int):
    import torch
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    e, h, i = cfg.experts, cfg.hidden, cfg.width
    w13 = (torch.randn(e, 2 * i, h, device=cfg.device, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=cfg.device, generator=g) * i ** -0.5).to(dtype)
    return w13, w2


def _sweep_inputs(cfg: Sweep, t: int, seed: int):
    import torch

    from kernels.moe_reference import route
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    x = torch.randn(t, cfg.hidden, device=cfg.device, generator=g).to(getattr(torch, cfg.dtype))
    weights, ids = route(torch.randn(t, cfg.experts, device=cfg.device, generator=g), cfg.top_k, renormalize=True)
    return x, weights, ids


def _rel_err_to(rows, case: _Case, top_k: int) -> float:
    """The layer's output from [T*k, H] rows (the k rows summed in float32, as the sum kernel)
    against the reference."""
    out = rows.view(case.t, top_k, -1).float().sum(dim=1).to(case.expect.dtype)
    return _rel_err(out, case.expect)


def _cases(cfg: Sweep, w13, w2, block_ms) -> dict:
    """(T, BLOCK_M) -> _Case for every sweep size and row tile; the base Plan: the row tile's first
    gate/up candidate with its first down candidate (compiled here, one after the other)."""
    from kernels import moe
    from kernels import moe_reference as ref
    bases = {p.block_m: p for p in reversed(gate_up_candidates(cfg))}
    bases |= {p.block_m: p for p in reversed(down_candidates(cfg))}
    cases = {}
    for t in cfg.sizes:
        x, weights, ids = _sweep_inputs(cfg, t, seed=t)
        expect = ref.fused_moe(x, w13, w2, weights, ids)
        for bm in block_ms:
            sorted_ids, block_expert = moe.align(ids, cfg.experts, 0, bm)
            act = moe.gate_up(x, w13, sorted_ids, block_expert, cfg.top_k, bases[bm])
            cases[t, bm] = _Case(t, bm, x, weights, ids, sorted_ids, block_expert, expect, bases[bm], act)
    return cases


def _compile_tasks(kind: str, plans: list[Plan], cases: dict, w13, w2, top_k: int) -> list[Callable[[], object]]:
    """One compile-only launch per candidate, on the first size's inputs (the token count is not
    specialized on: the other sizes reuse the compile)."""
    from kernels import moe
    first = min(t for t, _ in cases)
    tasks = []
    for p in plans:
        c = cases[first, p.block_m]
        if kind == "gate_up":
            tasks.append(lambda c=c, p=p: moe.gate_up(c.x, w13, c.sorted_ids, c.block_expert, top_k, p,
                                                      compile_only=True))
        else:
            tasks.append(lambda c=c, p=p: moe.down(c.base_act, w2, c.sorted_ids, c.block_expert, c.weights, p,
                                                   compile_only=True))
    return tasks


def _compile_all(tasks: list[Callable[[], object]], threads: int, device: str) -> dict:
    """Run the compile-only launches on threads; a failure shows again (and is recorded) when its
    candidate is timed."""
    import torch

    def run(task: Callable[[], object]) -> str | None:
        if device == "cuda":
            torch.cuda.set_device(0)  # a new thread starts on device 0; Triton caches per device
        try:
            task()
            return None
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            return _one_line(e)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads)) as pool:
        errors = [e for e in pool.map(run, tasks) if e]
    res = {"compiles": len(tasks), "seconds": time.perf_counter() - t0, "failed": len(errors),
           "first_error": errors[0] if errors else None}
    print(f"compiled {len(tasks)} launches in {res['seconds']:.1f} s on {threads} threads, {len(errors)} failed",
          flush=True)
    return res


def _measure(kind: str, p: Plan, case: _Case, w13, w2, cfg: Sweep, matmul_flops: float) -> dict:
    """One kernel candidate at one size: ms, TFLOP/s, fraction of the matmul rate, and the layer's
    error against the reference with this kernel in it."""
    import torch

    from kernels import moe
    t, k, h, i = case.t, cfg.top_k, cfg.hidden, cfg.width
    flops = 2.0 * t * k * h * i * (2 if kind == "gate_up" else 1)
    row = {"kernel": kind, "tokens": t, "label": _label(kind, p), "plan": _plan_json(p)}
    try:
        if kind == "gate_up":
            def fn():
                return moe.gate_up(case.x, w13, case.sorted_ids, case.block_expert, k, p)
            rows = moe.down(fn(), w2, case.sorted_ids, case.block_expert, case.weights, case.base)
        else:
            def fn():
                return moe.down(case.base_act, w2, case.sorted_ids, case.block_expert, case.weights, p)
            rows = fn()
        err = _rel_err_to(rows, case, k)
        ms = _time_ms(fn, cfg.iters, cfg.device)
    except Exception as e:  # noqa: BLE001 - a candidate that can't run (resources, compile) is recorded
        if cfg.device == "cuda":
            torch.cuda.synchronize()  # a fault of the context itself ends the sweep here
        return {**row, "error": _one_line(e), "ok": False}
    return {**row, "ms": ms, "tflops": flops / ms / 1e9, "fraction_of_matmul": flops / (ms * 1e-3) / matmul_flops,
            "rel_err": err, "ok": err < cfg.tol}


def _best(rows: list[dict], **where) -> dict | None:
    ok = [r for r in rows if r.get("ok") and all(r.get(k) == v for k, v in where.items())]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def _plan_from(row: dict) -> Plan:
    from kernels import moe
    d = dict(row["plan"])
    d.pop("repr")
    down = d.pop("down")
    return moe.Plan(**d, down=moe.Tiles(**down) if down else None)


def _composed(gate_up_row: dict, down_row: dict) -> Plan:
    """The gate/up candidate's Plan with the down candidate's tiles."""
    return dataclasses.replace(_plan_from(gate_up_row), down=_plan_from(down_row).down_tiles())


def _layer(p: Plan, case: _Case, w13, w2, cfg: Sweep, matmul_flops: float, what: str) -> dict:
    """The whole layer (align, both kernels, the sum) with Plan p, from a CUDA graph."""
    from kernels import moe
    t, k = case.t, cfg.top_k
    flops = 2.0 * t * k * 3 * cfg.hidden * cfg.width
    row = {"kernel": "layer", "what": what, "tokens": t, "plan": _plan_json(p)}
    try:
        err = _rel_err(moe.fused_moe(case.x, w13, w2, case.weights, case.ids, p=p), case.expect)
        ms = _graph_ms(lambda: moe.fused_moe(case.x, w13, w2, case.weights, case.ids, p=p), cfg.device)
    except Exception as e:  # noqa: BLE001
        return {**row, "error": _one_line(e), "ok": False}
    return {**row, "ms": ms, "tflops": flops / ms / 1e9, "fraction_of_matmul": flops / (ms * 1e-3) / matmul_flops,
            "rel_err": err, "ok": err < cfg.tol}


def _dense(cfg: Sweep, t: int, matmul_flops: float) -> dict:
    """The layer's FLOPs as two dense matmuls over its T*k rows ([T*k, H] @ [H, 2I], then
    [T*k, I] @ [I, H]): what torch.matmul reaches at these shapes."""
    import torch
    dtype = getattr(torch, cfg.dtype)
    m, h, i = t * cfg.top_k, cfg.hidden, cfg.width
    a, w1 = torch.randn(m, h, device=cfg.device, dtype=dtype), torch.randn(h, 2 * i, device=cfg.device, dtype=dtype)
    b, w2 = torch.randn(m, i, device=cfg.device, dtype=dtype), torch.randn(i, h, device=cfg.device, dtype=dtype)
    ms = _time_ms(lambda: (a @ w1, b @ w2), cfg.iters, cfg.device)
    flops = 2.0 * m * 3 * h * i
    return {"tokens": t, "ms": ms, "tflops": flops / ms / 1e9, "fraction_of_matmul": flops / (ms * 1e-3) / matmul_flops}


def _decode_control(cfg: Sweep, copy_bw: float) -> list[dict]:
    """plan()'s decode tiles in each mode, at cfg.decode_t tokens: the layer over
    cfg.decode_layers layers' experts in turn (beyond L2, as in a decode step), replayed from a
    graph, against the copy bandwidth over the experts the batch touches."""
    import torch

    from kernels import moe
    from kernels import moe_reference as ref
    layers = [_sweep_weights(cfg, 100 + j) for j in range(cfg.decode_layers)]
    x, weights, ids = _sweep_inputs(cfg, cfg.decode_t, seed=1)
    expect = ref.fused_moe(x, *layers[0], weights, ids)
    touched = int(torch.unique(ids).numel())
    nbytes = touched * 3 * cfg.hidden * cfg.width * x.element_size() + 2 * x.numel() * x.element_size()
    pick = moe.plan(cfg.decode_t, cfg.top_k, cfg.experts)
    rows = []
    for fused, tma in DECODE_MODES:
        p = dataclasses.replace(pick, fuse_gate_up=fused, tma=tma)
        row = {"kernel": "layer", "what": "decode", "tokens": cfg.decode_t, "label": _label("gate_up", p),
               "plan": _plan_json(p)}
        try:
            err = _rel_err(moe.fused_moe(x, *layers[0], weights, ids, p=p), expect)
            ms = _graph_ms(lambda: [moe.fused_moe(x, w13, w2, weights, ids, p=p) for w13, w2 in layers], cfg.device,
                           len(layers))
            row |= {"us": ms * 1e3, "fraction_of_copy_bw": nbytes / (ms * 1e-3) / copy_bw, "rel_err": err,
                    "ok": err < cfg.tol}
        except Exception as e:  # noqa: BLE001
            row |= {"error": _one_line(e), "ok": False}
        print(f"decode T={cfg.decode_t} {row['label']}: "
              + (f"{row['us']:.1f} us ({row['fraction_of_copy_bw']:.0%} of copy bw), err {row['rel_err']:.1e}"
                 if "us" in row else row["error"]), flush=True)
        rows.append(row)
    return rows


def _print_row(r: dict) -> None:
    if "ms" in r:
        print(f"  T={r['tokens']:>6} {r['kernel']:7} {r.get('label') or r.get('what', ''):38} {r['ms'] * 1e3:9.1f} us "
              f"{r['tflops']:6.0f} TFLOP/s {r['fraction_of_matmul']:5.0%}  err {r['rel_err']:.1e}"
              + ("" if r["ok"] else "  WRONG"), flush=True)
    else:
        print(f"  T={r['tokens']:>6} {r['kernel']:7} {r.get('label') or r.get('what', ''):38} {r['error']}", flush=True)


def sweep(cfg: Sweep, header: dict, matmul_flops: float, copy_bw: float) -> dict:
    """--sweep; writes cfg.out after each phase (and on a failure, what it has) and returns it."""
    t0 = time.perf_counter()
    shape = {"hidden": cfg.hidden, "experts": cfg.experts, "top_k": cfg.top_k, "width": cfg.width, "dtype": cfg.dtype}
    result: dict = {"mode": "sweep", **header, "shape": shape, "sizes": list(cfg.sizes), "iters": cfg.iters,
                    "compile": [], "kernels": [], "layers": [], "best": {}}

    def save() -> None:
        result["wall_s"] = time.perf_counter() - t0
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=1))

    try:
        w13, w2 = _sweep_weights(cfg, 0)
        block_ms = sorted(set(cfg.gate_up_tiles) | set(cfg.down_tiles))
        cases = _cases(cfg, w13, w2, block_ms)
        _candidates_phase(cfg, cases, w13, w2, matmul_flops, result, save)
        _groups_phase(cfg, cases, w13, w2, matmul_flops, block_ms, result, save)
        _layers_phase(cfg, cases, w13, w2, matmul_flops, block_ms, result, save)
        result["plan_table"] = plan_table_source(cfg, result, header)
        result["decode"] = _decode_control(cfg, copy_bw)
    finally:
        save()
    _summary(result)
    print(f"wrote {cfg.out} ({result['wall_s']:.0f} s)", flush=True)
    return result


def _summary(result: dict) -> None:
    """Per size: the best layer against plan()'s pick and the dense pair, and where its time went;
    then the plan table."""
    dense = {d["tokens"]: d for d in result.get("dense_equivalent", [])}
    for t, best in result["best"].items():
        b, pick, parts = best["layer"], best["plan_pick"], best.get("parts", {})
        if not b:
            print(f"T={t}: no layer ran correctly", flush=True)
            continue
        d = dense.get(int(t))
        print(f"T={t}: best {_plan_source(_plan_from(b))}: {b['ms'] * 1e3:.0f} us, {b['fraction_of_matmul']:.1%} of "
              f"the matmul rate, err {b['rel_err']:.1e}"
              + (f" (plan() pick {pick['ms'] * 1e3:.0f} us, {pick['fraction_of_matmul']:.1%})" if "ms" in pick else "")
              + (f"; dense pair {d['ms'] * 1e3:.0f} us ({d['fraction_of_matmul']:.0%}): the layer at "
                 f"{best['fraction_of_dense']:.0%} of its rate" if d else ""), flush=True)
        if "align_ms" in parts:
            print("  parts from graphs: " + ", ".join(f"{k[:-3]} {v * 1e3:.0f} us" for k, v in parts.items()),
                  flush=True)
    if result.get("plan_table"):
        print("\n".join(result["plan_table"]), flush=True)


def _decode_compiles(cfg: Sweep, w13, w2) -> list[Callable[[], object]]:
    """Compile-only launches of plan()'s decode tiles in each of DECODE_MODES."""
    import torch

    from kernels import moe
    pick = moe.plan(cfg.decode_t, cfg.top_k, cfg.experts)
    x, weights, ids = _sweep_inputs(cfg, cfg.decode_t, seed=1)
    sorted_ids, block_expert = moe.align(ids, cfg.experts, 0, pick.block_m)
    act = torch.zeros((block_expert.numel() * pick.block_m, cfg.width), dtype=x.dtype, device=x.device)
    plans = [dataclasses.replace(pick, fuse_gate_up=fused, tma=tma) for fused, tma in DECODE_MODES]
    return [lambda p=p: (moe.gate_up(x, w13, sorted_ids, block_expert, cfg.top_k, p, compile_only=True),
                         moe.down(act, w2, sorted_ids, block_expert, weights, p, compile_only=True)) for p in plans]


def _candidates_phase(cfg: Sweep, cases: dict, w13, w2, matmul_flops: float, result: dict, save) -> None:
    """Compile every candidate on threads, then time each at every size."""
    gate_ups, downs = gate_up_candidates(cfg), down_candidates(cfg)
    tasks = (_compile_tasks("gate_up", gate_ups, cases, w13, w2, cfg.top_k)
             + _compile_tasks("down", downs, cases, w13, w2, cfg.top_k) + _decode_compiles(cfg, w13, w2))
    result["compile"].append(_compile_all(tasks, cfg.threads, cfg.device))
    result["dense_equivalent"] = [_dense(cfg, t, matmul_flops) for t in cfg.sizes]
    for d in result["dense_equivalent"]:
        print(f"dense matmul pair, T={d['tokens']}: {d['ms'] * 1e3:.1f} us, {d['fraction_of_matmul']:.0%} of the "
              "matmul rate", flush=True)
    for t in cfg.sizes:
        for kind, plans in (("gate_up", gate_ups), ("down", downs)):
            for p in plans:
                result["kernels"].append(_measure(kind, p, cases[t, p.block_m], w13, w2, cfg, matmul_flops))
                _print_row(result["kernels"][-1])
        save()


def _groups_phase(cfg: Sweep, cases: dict, w13, w2, matmul_flops: float, block_ms: list[int], result: dict,
                  save) -> None:
    """cfg.groups' program orders on each kernel's TOP_FOR_GROUPS fastest candidates per row tile
    at each size (their union), timed at every size."""
    rows = result["kernels"]
    grouped = []
    for kind in ("gate_up", "down"):
        for bm in block_ms:
            top = [_plan_from(r) for t in cfg.sizes for r in _ranked(rows, kind, bm, t)[:TOP_FOR_GROUPS]]
            grouped += [(kind, _grouped(kind, p, g)) for p in dict.fromkeys(top) for g in cfg.groups
                        if g != _tiles(kind, p).group_m]
    tasks = [task for kind in ("gate_up", "down")
             for task in _compile_tasks(kind, [p for k, p in grouped if k == kind], cases, w13, w2, cfg.top_k)]
    result["compile"].append(_compile_all(tasks, cfg.threads, cfg.device))
    for t in cfg.sizes:
        for kind, p in grouped:
            rows.append(_measure(kind, p, cases[t, p.block_m], w13, w2, cfg, matmul_flops))
            _print_row(rows[-1])
    save()


def _ranked(rows: list[dict], kind: str, bm: int, t: int) -> list[dict]:
    """The kernel's correct candidates at row tile bm and size t, fastest first."""
    return sorted((r for r in rows if r["kernel"] == kind and r["tokens"] == t and r.get("ok")
                   and r["plan"]["block_m"] == bm), key=lambda r: r["ms"])


def _tiles(kind: str, p: Plan):
    return p.gate_up_tiles() if kind == "gate_up" else p.down_tiles()


def _layers_phase(cfg: Sweep, cases: dict, w13, w2, matmul_flops: float, block_ms: list[int], result: dict,
                  save) -> None:
    """Per size: plan()'s pick and, per row tile, each of the TOP_FOR_LAYERS fastest gate/ups with
    each of the TOP_FOR_LAYERS fastest downs, as whole layers from CUDA graphs; the best of them,
    and its parts timed alone."""
    from kernels import moe
    rows, layers = result["kernels"], result["layers"]
    for t in cfg.sizes:
        pick = moe.plan(t, cfg.top_k, cfg.experts)
        pick_row = _layer(pick, cases.get((t, pick.block_m)) or _case_for(cfg, cases, t, pick.block_m), w13, w2, cfg,
                          matmul_flops, "plan() pick")
        layers.append(pick_row)
        _print_row(pick_row)
        for bm in block_ms:
            for gu in _ranked(rows, "gate_up", bm, t)[:TOP_FOR_LAYERS]:
                for dn in _ranked(rows, "down", bm, t)[:TOP_FOR_LAYERS]:
                    p = _composed(gu, dn)
                    if p != pick:
                        layers.append(_layer(p, cases[t, bm], w13, w2, cfg, matmul_flops,
                                             f"gate/up {gu['label']} + down {dn['label']}"))
                        _print_row(layers[-1])

        best = _best(layers, tokens=t)
        dense = next((d for d in result.get("dense_equivalent", []) if d["tokens"] == t), None)
        result["best"][str(t)] = {"layer": best, "plan_pick": pick_row,
                                  "gate_up": _best(rows, kernel="gate_up", tokens=t),
                                  "down": _best(rows, kernel="down", tokens=t), "dense_equivalent": dense,
                                  "fraction_of_dense": dense["ms"] / best["ms"] if best and dense else None,
                                  "parts": _parts(_plan_from(best), cases[t, best["plan"]["block_m"]], w13, w2, cfg)
                                  if best and (t, best["plan"]["block_m"]) in cases else {}}
        save()


def _parts(p: Plan, case: _Case, w13, w2, cfg: Sweep) -> dict:
    """ms of each of the layer's parts alone, each from a CUDA graph: align, gate/up, down, the sum."""
    from kernels import moe
    k = cfg.top_k
    try:
        sorted_ids, block_expert = moe.align(case.ids, cfg.experts, 0, p.block_m)
        act = moe.gate_up(case.x, w13, sorted_ids, block_expert, k, p)
        rows = moe.down(act, w2, sorted_ids, block_expert, case.weights, p)
        return {"align_ms": _graph_ms(lambda: moe.align(case.ids, cfg.experts, 0, p.block_m), cfg.device),
                "gate_up_ms": _graph_ms(lambda: moe.gate_up(case.x, w13, sorted_ids, block_expert, k, p), cfg.device),
                "down_ms": _graph_ms(lambda: moe.down(act, w2, sorted_ids, block_expert, case.weights, p), cfg.device),
                "sum_ms": _graph_ms(lambda: moe.sum_rows(rows, k), cfg.device)}
    except Exception as e:  # noqa: BLE001 - a diagnosis only
        return {"error": _one_line(e)}


def _plan_source(p: Plan) -> str:
    """p as kernels/moe.py writes its plans: the tiles by position, other fields where not default."""
    from kernels import moe

    def src(obj, positional: int) -> str:
        fields = dataclasses.fields(obj)
        args = [repr(getattr(obj, f.name)) for f in fields[:positional]]
        for f in fields[positional:]:
            v = getattr(obj, f.name)
            if v != f.default:
                args.append(f"{f.name}={src(v, 4) if isinstance(v, moe.Tiles) else repr(v)}")
        return f"{type(obj).__name__}({', '.join(args)})"
    return src(p, 5)


def plan_table(cfg: Sweep, winners: dict[int, Plan]) -> list[tuple[float, Plan, list[int]]]:
    """kernels/moe.py's PLAN_TABLE with the sweep's winners: the entries below the smallest size's
    rows an expert kept, then each size's winner up to the rows halfway (geometric mean) to the
    next size's, the largest's to math.inf; neighbours with one Plan merged. (bound, Plan, sizes)."""
    from kernels import moe
    sizes = sorted(winners)
    rows = [t * cfg.top_k / cfg.experts for t in sizes]
    bounds = [round(math.sqrt(a * b)) for a, b in zip(rows, rows[1:])] + [math.inf]
    entries = [(b, p, []) for b, p in moe.PLAN_TABLE if b < rows[0]]
    for bound, t in zip(bounds, sizes):
        if entries and entries[-1][1] == winners[t]:
            entries[-1] = (bound, winners[t], entries[-1][2] + [t])
        else:
            entries.append((bound, winners[t], [t]))
    return entries


def plan_table_source(cfg: Sweep, result: dict, header: dict) -> list[str]:
    """plan_table() of the best layers as lines to paste into kernels/moe.py (none if no size ran)."""
    best = {int(t): b["layer"] for t, b in result["best"].items() if b["layer"]}
    if not best:
        return []
    lines = [f"# {header.get('gpu')}, {header.get('date')}, triton {header.get('triton')}: lab/moe_gpu.py --sweep",
             "PLAN_TABLE: tuple[tuple[float, Plan], ...] = ("]
    for bound, p, sizes in plan_table(cfg, {t: _plan_from(b) for t, b in best.items()}):
        note = "; ".join(f"{t:,} tokens {best[t]['ms'] * 1e3:.0f} us, {best[t]['fraction_of_matmul']:.0%} of the "
                         "matmul rate" for t in sizes)
        lines.append(f"    ({'math.inf' if bound == math.inf else bound}, {_plan_source(p)}),"
                     + (f"  # {note}" if note else ""))
    return lines + [")"]


def _case_for(cfg: Sweep, cases: dict, t: int, bm: int) -> _Case:
    """A case at a row tile the candidates don't cover (plan()'s pick outside them)."""
    from kernels import moe
    c = next(c for (tt, _), c in cases.items() if tt == t)
    sorted_ids, block_expert = moe.align(c.ids, cfg.experts, 0, bm)
    return dataclasses.replace(c, block_m=bm, sorted_ids=sorted_ids, block_expert=block_expert)


# --- --sm90 ------------------------------------------------------------------------------------
SM90_SHARED = 227 * 1024  # an H100 block's most shared memory


def _recorded_launch(kind: str, p: Plan, cfg: Sweep) -> tuple:
    """(kernel, args, kwargs) of the candidate's launch on small CPU tensors of the sweep's widths."""
    import torch

    from kernels import moe
    calls: list = []
    saved = moe.launch
    moe.launch = lambda fn, grid, *args, **kwargs: calls.append((fn, args, kwargs))
    try:
        dtype = getattr(torch, cfg.dtype)
        t, e, h, i, k = 64, 8, cfg.hidden, cfg.width, cfg.top_k
        blocks = moe.max_blocks(t * k, e, p.block_m)
        sorted_ids = torch.zeros(blocks * p.block_m, dtype=torch.int32)
        block_expert = torch.zeros(blocks, dtype=torch.int32)
        if kind == "gate_up":
            moe.gate_up(torch.zeros(t, h, dtype=dtype), torch.zeros(e, 2 * i, h, dtype=dtype), sorted_ids,
                        block_expert, k, p)
        else:
            moe.down(torch.zeros(blocks * p.block_m, i, dtype=dtype), torch.zeros(e, h, i, dtype=dtype), sorted_ids,
                     block_expert, torch.zeros(t, k), p)
    finally:
        moe.launch = saved
    return calls[-1]


def sm90_report(kind: str, p: Plan, cfg: Sweep) -> dict:
    """One candidate compiled for an H100 on this machine: shared bytes, registers and stack per
    thread (spills), and whether it uses wgmma and TMA loads."""
    import re
    import subprocess
    import tempfile

    import triton
    row = {"kernel": kind, "label": _label(kind, p), "triton": triton.__version__}
    try:
        from tests.kernels.sm90_compile import compile_sm90
        compiled = compile_sm90(*_recorded_launch(kind, p, cfg))
    except Exception as e:  # noqa: BLE001
        return {**row, "error": _one_line(e)}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    found = {k: int(m.group(1)) if (m := re.search(k + r":(\d+)", usage)) else None for k in ("REG", "STACK")}
    ptx = compiled.asm["ptx"]
    res = {**row, "shared": compiled.metadata.shared, "registers": found["REG"], "stack": found["STACK"],
           "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
    return res | {"fits": res["shared"] <= SM90_SHARED and not res["stack"]}


def sm90(cfg: Sweep) -> int:
    """--sm90: every sweep candidate (program orders aside: they change no resource)."""
    rows = [sm90_report(kind, p, cfg)
            for kind, plans in (("gate_up", gate_up_candidates(cfg)), ("down", down_candidates(cfg))) for p in plans]
    for r in rows:
        print(json.dumps(r), flush=True)
    bad = [r["label"] for r in rows if not r.get("fits")]
    print(f"{len(rows) - len(bad)} of {len(rows)} candidates fit an H100" + (f"; not: {bad}" if bad else ""),
          flush=True)
    return 1 if bad else 0


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts like 4096,8192,16384, got {text!r}")
    return tuple(sorted(set(sizes)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the JSON file to write (needed but with --sm90)")
    ap.add_argument("--engine", action="store_true", help="also serve the preset through LLM (a few minutes)")
    ap.add_argument("--sweep", action="store_true", help="time the prefill Plan variants instead (about 2 minutes)")
    ap.add_argument("--tokens", type=_token_counts, default=SWEEP_T,
                    help="--sweep: the prefill token counts, comma separated (default %(default)s)")
    ap.add_argument("--iters", type=int, default=20, help="--sweep: timed calls per candidate (median)")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1),
                    help="--sweep: threads that compile the candidates")
    ap.add_argument("--sm90", action="store_true",
                    help="compile the --sweep candidates for an H100 on this machine (no GPU needed) and report")
    args = ap.parse_args(argv)
    if args.sm90:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("--sm90 compiles kernels: run it without TRITON_INTERPRET=1")
        return sm90(Sweep(out=Path(os.devnull)))
    if args.out is None:
        ap.error("--out is required")

    import torch
    import triton

    from bench.hardware import measure
    from lab.kernels import gpu_and_date
    if not torch.cuda.is_available():
        raise SystemExit("lab.moe_gpu needs a CUDA GPU, and torch sees none")
    t0 = time.perf_counter()
    hw = measure()
    if hw.error or not hw.copy_bandwidth:
        raise SystemExit(f"measuring the GPU failed: {hw.error}")
    print(f"{hw.device}: copy {hw.copy_bandwidth / 1e12:.2f} TB/s, bf16 matmul {hw.matmul_flops / 1e12:.0f} TFLOP/s", flush=True)
    if args.sweep:
        header = gpu_and_date() | {"torch": torch.__version__, "triton": triton.__version__,
                                   "copy_bandwidth": hw.copy_bandwidth, "matmul_flops": hw.matmul_flops}
        sweep(Sweep(out=args.out, iters=args.iters, threads=args.threads, sizes=args.tokens), header,
              hw.matmul_flops, hw.copy_bandwidth)
        return 0
    layers = [_layer_weights(i) for i in range(LAYERS)]
    result = gpu_and_date() | {
        "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "width": WIDTH, "dtype": "bfloat16"},
        "copy_bandwidth": hw.copy_bandwidth, "matmul_flops": hw.matmul_flops}
    result["correctness"] = correctness(*layers[0])
    result["decode"] = decode(layers, hw.copy_bandwidth)
    result["prefill"] = prefill(*layers[0], hw.matmul_flops)
    del layers
    torch.cuda.empty_cache()
    if args.engine:
        result["engine"] = engine()
    result["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"decode {result['decode']['picked']['layer_fraction_of_copy_bw']:.0%} of copy bandwidth (target 70%), "
          f"prefill {result['prefill']['picked']['layer_fraction_of_matmul']:.0%} of the matmul rate (target 60%); "
          f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
