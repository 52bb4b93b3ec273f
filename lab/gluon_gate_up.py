"""A decode step's gate/up + SiLU for up to 64 rows in Gluon: x kept in shared memory, the weights
streamed by TMA through a deep ring, one program per SM over an even share of the columns.

`lab/persistent_mlp.py` found a small model's decode kernels bound by each SM's chain of dependent
instructions (one warp per scheduler; every program re-reads and re-converts its x tiles), not by
bytes (bench/NOTES.md, 2026-11-27). This asks whether the gate/up matmul gets nearer the copy
bandwidth when each program loads x [64, K] once into shared memory (TMA, zero-filled past M and
K) and then only streams its weight rows: program p owns units [p * U // P, (p + 1) * U // P) of
UNIT gate rows (and the same up rows), and issues their tiles [UNIT, BLOCK_K] STAGES ahead of the
wgmmas that consume them. The epilogue rounds gate and up to the dtype, then SiLU(gate) * up, as
kernels/gate_up.py does. A warp-specialized form (_ws_gate_up_kernel) gives the ring to a producer
warp, so that the loads never wait for the warpgroup's products. Hopper only; `python -m
lab.gluon_gate_up` times both against the engine's kernel per layer in a CUDA graph over many
layers' weights (cold L2).

Measured on an H100 (bench/NOTES.md, 2026-11-27/28): bitwise equal to the reference, and slower than
kernels/gate_up.py at Qwen2.5-0.5B's shape in every variant (best 11.79 against 9.89 us a layer at
64 rows; warp-specialized 11.39 against 9.87); deeper rings slower. Not used by the engine.
"""
from __future__ import annotations

import argparse

import torch

from kernels.launch import sm_count
from lab.kernels import gpu_and_date, write_json

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover
    gluon = None

BLOCK_M, BLOCK_K = 64, 128
# (unit, stages, block_k, x first, warp-specialized)
VARIANTS = [(16, 4, 128, True, False), (32, 4, 128, True, False), (32, 2, 256, True, False),
            (16, 4, 128, True, True), (16, 8, 128, True, True), (8, 8, 128, True, True), (8, 16, 128, True, True),
            (32, 4, 128, True, True), (32, 6, 128, True, True)]

if gluon is not None:

    @gluon.jit
    def silu_mul_store(acc_g, acc_u, out_ptr, rows, n, M, I, stride_om):
        """out[rows, n] = SiLU(gate) * up as kernels/gate_up.py rounds it: gate and up to out's dtype
        first, the activation rounded too, the product last."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(gl.float32)
        up = acc_u.to(dtype).to(gl.float32)
        act = (gate / (1.0 + gl.exp2(gate * -1.4426950408889634))).to(dtype).to(gl.float32)
        mask = (rows < M)[:, None] & (n < I)[None, :]
        gl.store(out_ptr + rows[:, None].to(gl.int64) * stride_om + n[None, :], (act * up).to(dtype), mask=mask)

    @gluon.jit
    def _load_unit_tile(w_desc, g_smem, u_smem, bar, j, first_unit, I, K_STEPS: gl.constexpr):
        """Weight tile j of this program: unit first_unit + j // K_STEPS, K step j % K_STEPS."""
        UNIT: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
        n0 = (first_unit + j // K_STEPS) * UNIT
        k0 = (j % K_STEPS) * BK
        mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
        _tma_load(w_desc, [n0, k0], bar, g_smem)
        _tma_load(w_desc, [I + n0, k0], bar, u_smem)

    @gluon.jit(do_not_specialize=["M"])
    def _gate_up_kernel(x_desc, w_desc, out_ptr, M, I, stride_om, n_units,
                        K_STEPS: gl.constexpr, STAGES: gl.constexpr, X_FIRST: gl.constexpr):
        BM: gl.constexpr = x_desc.block_type.shape[0]
        UNIT: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = x_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, UNIT, 16])
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        first = pid * n_units // progs
        last = (pid + 1) * n_units // progs
        tiles = (last - first) * K_STEPS

        x_smem = gl.allocate_shared_memory(dtype, [K_STEPS, BM, x_desc.block_type.shape[1]], x_desc.layout)
        g_smem = gl.allocate_shared_memory(dtype, [STAGES, UNIT, w_desc.block_type.shape[1]], w_desc.layout)
        u_smem = gl.allocate_shared_memory(dtype, [STAGES, UNIT, w_desc.block_type.shape[1]], w_desc.layout)
        x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(x_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        # the weights first (they do not depend on x) or x first, then the other
        if X_FIRST:
            mbarrier.expect(x_bar, K_STEPS * x_desc.block_type.nbytes)
            for kx in gl.static_range(K_STEPS):
                _tma_load(x_desc, [0, kx * x_desc.block_type.shape[1]], x_bar, x_smem.index(kx))
        for j0 in gl.static_range(STAGES):
            if j0 < tiles:
                _load_unit_tile(w_desc, g_smem.index(j0), u_smem.index(j0), ready.index(j0), j0, first, I, K_STEPS)
        if not X_FIRST:
            mbarrier.expect(x_bar, K_STEPS * x_desc.block_type.nbytes)
            for kx in gl.static_range(K_STEPS):
                _tma_load(x_desc, [0, kx * x_desc.block_type.shape[1]], x_bar, x_smem.index(kx))
        mbarrier.wait(x_bar, 0)

        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, UNIT, layout=gl.SliceLayout(0, acc_layout))
        acc_g = gl.zeros([BM, UNIT], gl.float32, acc_layout)
        acc_u = gl.zeros([BM, UNIT], gl.float32, acc_layout)
        for j in range(tiles):
            s = j % STAGES
            k = j % K_STEPS
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            acc_g = warpgroup_mma(x_smem.index(k), g_smem.index(s).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(x_smem.index(k), u_smem.index(s).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
            if j + STAGES < tiles:  # slot s is free again: the tile STAGES ahead into it
                _load_unit_tile(w_desc, g_smem.index(s), u_smem.index(s), ready.index(s), j + STAGES, first, I,
                                K_STEPS)
            if k == K_STEPS - 1:
                silu_mul_store(acc_g, acc_u, out_ptr, rows, (first + j // K_STEPS) * UNIT + cols, M, I, stride_om)
                acc_g = gl.zeros([BM, UNIT], gl.float32, acc_layout)
                acc_u = gl.zeros([BM, UNIT], gl.float32, acc_layout)
        mbarrier.invalidate(x_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def _ws_produce(w_desc, g_bufs, u_bufs, ready, empty, first, last, I, K_STEPS: gl.constexpr,
                    STAGES: gl.constexpr):
        """One warp: this program's weight tiles into the ring, as far ahead as the free slots allow."""
        UNIT: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
        for j in range((last - first) * K_STEPS):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier: the slot is free
            n0 = (first + j // K_STEPS) * UNIT
            k0 = (j % K_STEPS) * BK
            mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
            _tma_load(w_desc, [n0, k0], ready.index(s), g_bufs.index(s))
            _tma_load(w_desc, [I + n0, k0], ready.index(s), u_bufs.index(s))

    @gluon.jit
    def _ws_consume(x_smem, x_bar, g_bufs, u_bufs, ready, empty, out_ptr, M, I, stride_om, first, last,
                    K_STEPS: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: a tile's two wgmmas stay in flight while the next tile's are issued; a slot is
        released as soon as the wgmmas that read it are done."""
        BM: gl.constexpr = x_smem.type.shape[1]
        UNIT: gl.constexpr = g_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, UNIT, 16])
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, UNIT, layout=gl.SliceLayout(0, acc_layout))
        acc_g = gl.zeros([BM, UNIT], gl.float32, acc_layout)
        acc_u = gl.zeros([BM, UNIT], gl.float32, acc_layout)
        mbarrier.wait(x_bar, 0)
        for j in range((last - first) * K_STEPS):
            s = j % STAGES
            k = j % K_STEPS
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            acc_g = warpgroup_mma(x_smem.index(k), g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(x_smem.index(k), u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))  # the tile before is done
            if k > 0:
                mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            if k == K_STEPS - 1:
                acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index(s), count=1)
                silu_mul_store(acc_g, acc_u, out_ptr, rows, (first + j // K_STEPS) * UNIT + cols, M, I, stride_om)
                acc_g = gl.zeros([BM, UNIT], gl.float32, acc_layout)
                acc_u = gl.zeros([BM, UNIT], gl.float32, acc_layout)

    @gluon.jit(do_not_specialize=["M"])
    def _ws_gate_up_kernel(x_desc, w_desc, out_ptr, M, I, stride_om, n_units,
                           K_STEPS: gl.constexpr, STAGES: gl.constexpr, X_FIRST: gl.constexpr):
        """Warp-specialized: a producer warp streams the weight tiles, the warpgroup multiplies. X_FIRST
        comes with the launch arguments it shares with _gate_up_kernel and is unused: x is issued first."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        UNIT: gl.constexpr = w_desc.block_type.shape[0]
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        first = pid * n_units // progs
        last = (pid + 1) * n_units // progs
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [K_STEPS, BM, x_desc.block_type.shape[1]], x_desc.layout)
        g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, UNIT, w_desc.block_type.shape[1]], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, UNIT, w_desc.block_type.shape[1]], w_desc.layout)
        x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(x_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.expect(x_bar, K_STEPS * x_desc.block_type.nbytes)
        for kx in gl.static_range(K_STEPS):
            _tma_load(x_desc, [0, kx * x_desc.block_type.shape[1]], x_bar, x_smem.index(kx))
        gl.warp_specialize([(_ws_consume, (x_smem, x_bar, g_bufs, u_bufs, ready, empty, out_ptr, M, I, stride_om,
                                           first, last, K_STEPS, STAGES)),
                            (_ws_produce, (w_desc, g_bufs, u_bufs, ready, empty, first, last, I, K_STEPS, STAGES))],
                           [1], [40])


def launch_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, programs: int, unit: int = 16,
                stages: int = 8, block_k: int = BLOCK_K, x_first: bool = False) -> tuple:
    """(grid, args, kwargs) for x [M <= 64, K], w [2I, K] (gate rows, then up rows), out [M, I]."""
    M, K = x.shape
    I = w.shape[0] // 2
    assert M <= BLOCK_M and I % unit == 0 and x.dtype == w.dtype == out.dtype
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_desc = GluonDescriptor(x, [M, K], [x.stride(0), 1], [BLOCK_M, block_k],
                             gl.NVMMASharedLayout.get_default_for([BLOCK_M, block_k], gdt))
    w_desc = GluonDescriptor(w, [2 * I, K], [w.stride(0), 1], [unit, block_k],
                             gl.NVMMASharedLayout.get_default_for([unit, block_k], gdt))
    n_units = I // unit
    grid = (min(programs, n_units),)
    args = (x_desc, w_desc, out, M, I, out.stride(0), n_units)
    return grid, args, dict(K_STEPS=-(-K // block_k), STAGES=stages, X_FIRST=x_first, num_warps=4)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, unit: int = 16, stages: int = 8, block_k: int = BLOCK_K,
                 x_first: bool = False, out: torch.Tensor | None = None, ws: bool = False) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.shape[0] // 2), dtype=x.dtype, device=x.device) if out is None else out
    grid, args, kwargs = launch_args(x, w, out, sm_count(x.device), unit, stages, block_k, x_first)
    (_ws_gate_up_kernel if ws else _gate_up_kernel)[grid](*args, **kwargs)
    return out


def main(argv: list[str] | None = None) -> int:
    from kernels import reference
    from kernels.gate_up import mlp_gate_up
    from lab.kernels import copy_bandwidth, graph_us

    ap = argparse.ArgumentParser(prog="python -m lab.gluon_gate_up", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    rows = []
    for model, K, I, layers in (("qwen2.5-0.5b", 896, 4864, 24), ("smollm2-135m", 576, 1536, 30)):
        g = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(2 * I, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in range(layers)]
        for M in (16, 64):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = reference.gate_up_silu(x, weights[0])
            base = graph_us(lambda: [mlp_gate_up(x, w) for w in weights], per=layers)
            row = {"model": model, "rows": M, "engine_us": base, "floor_us": 2 * I * K * 2 / bw * 1e6, "variants": []}
            print(f"{model} M={M}: engine {base:.2f} us a layer (floor {row['floor_us']:.2f})", flush=True)
            for unit, stages, bk, xf, ws in VARIANTS:
                k_steps = -(-K // bk)
                if I % unit or k_steps * BLOCK_M * bk * 2 + stages * 2 * unit * bk * 2 > 210_000:
                    continue
                v = {"unit": unit, "stages": stages, "block_k": bk, "x_first": xf, "warp_specialized": ws}
                try:
                    got = gate_up_silu(x, weights[0], unit, stages, bk, xf, ws=ws)
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    us = graph_us(lambda: [gate_up_silu(x, w, unit, stages, bk, xf, ws=ws) for w in weights],
                                  per=layers)
                except Exception as e:  # a variant that does not fit: recorded
                    row["variants"].append(v | {"error": str(e).splitlines()[0][:200]})
                    print(f"  {v}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                row["variants"].append(v | {"us": us, "rel_err": err, "bitwise": bool(torch.equal(got, ref))})
                print(f"  unit {unit:2d} stages {stages:2d} block_k {bk} x first {xf!s:5} ws {ws!s:5}: {us:6.2f} us "
                      f"({base / us:.2f}x the engine's) err {err:.1e} bitwise {torch.equal(got, ref)}", flush=True)
            rows.append(row)
    write_json(a.json, gpu_and_date() | {"copy_bandwidth": bw, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
