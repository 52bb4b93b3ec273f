"""A W4A16 matmul for prompt steps on Hopper, in Gluon, measured and not taken into the engine:
`python -m lab.int4_smem_gemm --out F` times it, its parts left out in turn (PROBE), cuBLAS on the
16-bit weight, and the engine's dequantization + cuBLAS, at Llama-3-8B's projections.

The engine's prompt steps with a 4-bit weight past int4_wgmma.MAX_M rows dequantize every
projection's weight to 16 bits and call cuBLAS: the weight written and read back each step. Here
each program owns 128 weight rows (one 64-row half a warpgroup, the MMA's M) by 128 or 256 rows of
x (its N) and takes 128 columns an iteration: every thread turns 8 words of its weight row into 64
values exactly as kernels/int4.py's dequantize() rounds them ((q - zero) * scale is exact in
float32, from the nibble as the float 2^23 + q; rounded once to x's dtype) and stores them to shared
memory in the MMA's layout while the tensor cores still multiply the previous iteration's tile; x's
rows arrive by cp.async STAGES - 1 iterations ahead. Two CTA barriers an iteration hand the buffers
over: one before the MMA (every thread's values and copies are in), one after the wait for the MMA
before it (both warpgroups are done reading its buffers). K can be split, the float32 partials
summed in split order by each tile's last program.

Measured on an H200 (bench/NOTES.md, 2026-11-29): correct (within 2 bf16 ulps of
reference.int4_linear; max relative error 0.005-0.006, as dequantization + cuBLAS), and no faster
than dequantization + cuBLAS but barely for gate_up at 512 rows (275 against 287 us; at 2,048 rows
990 against 813; qkv, o and down at 512 rows 1.09x, 1.61x and 1.21x its time). With the weight's
stores and x's copies left out (PROBE 3) gate_up at 2,048 rows takes 584 us, less than cuBLAS on the
16-bit weight (753): the matmul is not what is slow; x's copies (+123 us), the weight's
shared-memory stores (+168) and the unpacking (+115) do not hide behind it with one warp role and
CTA barriers in lockstep. x by TMA instead of cp.async was 12-28% slower (not explained). Splitting
K helped down (228 -> 163 us at 512 rows) and made qkv 2.6x and o 1.2x slower, which plan() does
not know. The next form is warp-specialized: producer warps that unpack and copy into a ring,
consumer warpgroups that only multiply, mbarriers instead of CTA barriers.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.int4_wgmma import _hopper, gluon  # the Gluon imports and their names in Triton 3.6 and 3.9
from kernels.launch import cdiv, launch, sm_count
from kernels.linear import grouped_tile, split_buffers

if gluon is not None:
    from kernels.int4_wgmma import (_cp_async, _cta_barrier, async_copy, fence_async_shared, gdc_launch_dependents,
                                    gdc_wait, gl, warpgroup_mma, warpgroup_mma_wait)

BLOCK_N = 128  # weight rows a program: two warpgroups' MMA M of 64
BLOCK_K = 128  # the columns of one block of 16 words
WARPS = 8


if gluon is not None:

    @gluon.jit
    def _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, planes, k, K, N, stride_wn, stride_sg,
                    GROUP: gl.constexpr):
        """The words of 128-column block k // 128 for the program's rows, and each plane's zero point
        (as 2^23 + zero) and scale ([rows, 8], or [rows, 1] where one group spans the block); zeros
        past K or N."""
        words = gl.load(w_ptr + rows[:, None].to(gl.int64) * stride_wn + (k // 8 + cols)[None, :],
                        mask=((rows < N) & (k < K))[:, None], other=0)
        ok = (rows_p < N) & (k < K)
        if GROUP % 128 == 0:
            at = (k // GROUP) * stride_sg + rows_p
            zero = gl.expand_dims(gl.load(z_ptr + at, mask=ok, other=0).to(gl.float32) + 8388608.0, 1)
            scale = gl.expand_dims(gl.load(s_ptr + at, mask=ok, other=0.0).to(gl.float32), 1)
        else:
            g = (k + planes * 16) // GROUP  # each plane's 16 columns lie in one group
            at = g[None, :] * stride_sg + rows_p[:, None]
            zero = gl.load(z_ptr + at, mask=ok[:, None], other=0).to(gl.float32) + 8388608.0
            scale = gl.load(s_ptr + at, mask=ok[:, None], other=0.0).to(gl.float32)
        return words, zero, scale

    @gluon.jit
    def _dequantize(words, zero, scale, shifts, dtype: gl.constexpr):
        """[BN, 16] words -> [BN, 128] values of dtype, column 16 j + c from nibble j of word c: the
        nibble as the float32 2^23 + q (its low mantissa bits), minus 2^23 + zero, is q - zero exactly;
        times the scale it is still exact, rounded once to dtype (as dequantize() rounds it)."""
        q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | 0x4B000000
        w = (q.to(gl.float32, bitcast=True) - zero[:, :, None]) * scale[:, :, None]
        w = w.to(dtype)
        return gl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))

    @gluon.jit
    def _store_out(acc, b_ptr, out_ptr, o_buf, pid_m, pid_n, M, N, stride_om, HAS_BIAS: gl.constexpr):
        """The float32 tile [BN, BLOCK_M] (+ bias) into out [M, N] in out's dtype, turned through the
        shared buffer o_buf ([BLOCK_M, BN], free) so that each thread stores 16 bytes of one row."""
        BN: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        if HAS_BIAS:
            offs_b = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc.type.layout))
            acc += gl.load(b_ptr + offs_b, mask=offs_b < N, other=0.0).to(gl.float32)[:, None]
        o_buf.store(gl.permute(acc.to(out_ptr.dtype.element_ty), (1, 0)))
        _cta_barrier()
        tile = o_buf.load(layout)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        gl.store(out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :], tile, mask=mask)

    @gluon.jit(do_not_specialize=["M"])
    def _w4a16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                           split, stride_xm, stride_wn, stride_sg, stride_om, GROUP: gl.constexpr,
                           HAS_BIAS: gl.constexpr, SPLIT_ONE: gl.constexpr, BLOCK_M: gl.constexpr,
                           STAGES: gl.constexpr, GROUP_M: gl.constexpr, PDL: gl.constexpr, PROBE: gl.constexpr = 0):
        """out tile [BLOCK_M, BN] = x W^T over the program's share of K; with a K split the float32
        partials ([N, M] each) are summed in split order by the tile's last program to arrive."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        BN: gl.constexpr = 128
        BK: gl.constexpr = 128
        NW: gl.constexpr = gl.num_warps()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        # a thread's 8 words of one weight row (16 rows x 2 halves a warp) and all 8 nibble planes (lanes
        # 0-15 on 16 rows' first halves, for 16-byte stores into 8 bank groups, measured 1-3% slower)
        w3: gl.constexpr = gl.BlockedLayout([1, 8, 8], [16, 1, 2], [NW, 1, 1], [2, 1, 0])
        words_layout: gl.constexpr = gl.SliceLayout(1, w3)
        planes_layout: gl.constexpr = gl.SliceLayout(2, w3)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], dtype)
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], dtype)

        pid = gl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BN, GROUP_M)
        k_lo = gl.program_id(1) * k_per_split
        steps = (gl.minimum(k_lo + k_per_split, K) - k_lo) // BK
        rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, words_layout))
        rows_p = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, planes_layout))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout))
        planes = gl.arange(0, 8, layout=gl.SliceLayout(0, planes_layout))
        shifts = planes * 4
        k_end = k_lo + steps * BK
        # the first block's weights before the wait (no kernel writes them)
        words, zero, scale = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, planes, k_lo, k_end, N, stride_wn,
                                         stride_sg, GROUP)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        xc = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
        x_at = x_ptr + xm[:, None].to(gl.int64) * stride_xm + k_lo + xc[None, :]
        x_ok = (xm[:, None] < M) & (xc[None, :] < BK)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BK], x_smem_layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], smem_layout)
        for j in gl.static_range(STAGES - 1):
            _cp_async(x_bufs.index(j), x_at + j * BK, mask=x_ok & (j < steps))
            async_copy.commit_group()
        acc = gl.zeros([BN, BLOCK_M], gl.float32, mma)
        for i in range(steps):
            s = i % STAGES
            k = k_lo + i * BK
            # into the buffer of block i - STAGES, whose MMA is done (the second barrier below);
            # PROBE 1: no unpacking (a constant tile stored), 2: no stores, 3: no stores nor x's copies
            if PROBE == 0:
                w_bufs.index(s).store(_dequantize(words, zero, scale, shifts, dtype))
            elif PROBE == 1:
                w_bufs.index(s).store(gl.reshape(gl.full([BN, 8, 16], 1.0, dtype, w3), (BN, BK)))
            words, zero, scale = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, planes, k + BK, k_end, N,
                                             stride_wn, stride_sg, GROUP)
            async_copy.wait_group(STAGES - 2)  # this thread's copies of x's block i landed
            fence_async_shared()
            _cta_barrier()  # every thread's values and copies are in: each warpgroup's MMA reads both tiles
            acc = warpgroup_mma(w_bufs.index(s), x_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # this warpgroup's MMA of block i - 1 is done
            _cta_barrier()  # and the other's: block i - 1's buffers are free
            nxt = i + STAGES - 1
            if PROBE != 3:
                _cp_async(x_bufs.index(nxt % STAGES), x_at + nxt * BK, mask=x_ok & (nxt < steps))
            async_copy.commit_group()
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)
        _cta_barrier()  # both warpgroups' MMAs are done with x's first buffer, the output's way out

        if SPLIT_ONE:
            _store_out(acc, b_ptr, out_ptr, x_bufs.index(0), pid_m, pid_n, M, N, stride_om, HAS_BIAS)
        else:
            offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
            tile = offs_n[:, None] * M + offs_m[None, :]
            mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
            gl.store(part_ptr + gl.program_id(1) * M * N + tile, acc, mask=mask)
            _cta_barrier()  # every thread's partial is stored before the count goes up
            arrived = gl.atomic_add(count_ptr + pid, 1)  # acq_rel: the last sees every partial
            if arrived == split - 1:
                total = gl.zeros([BN, BLOCK_M], gl.float32, mma)
                for p in range(0, split):
                    total += gl.load(part_ptr + p * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(count_ptr + pid, 0)
                _store_out(total, b_ptr, out_ptr, x_bufs.index(0), pid_m, pid_n, M, N, stride_om, HAS_BIAS)


def supports(x: torch.Tensor, K: int, group: int) -> bool:
    """Whether this kernel takes x [M, K] times a 4-bit weight in groups of `group` columns: a
    Hopper GPU, 16-bit x in 16-byte aligned rows of unit column stride (16-byte cp.async copies), K
    in whole 128-column blocks, groups of a multiple of 16 columns."""
    return (gluon is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and K % BLOCK_K == 0
            and group % 16 == 0 and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0
            and _hopper(torch.cuda.current_device() if x.device.index is None else x.device.index))


@dataclass(frozen=True)
class Plan:
    block_m: int
    stages: int
    split: int = 1


def plan(M: int, N: int, K: int, sms: int) -> Plan:
    """256 rows of x a program (half the unpacking a row of 128-row tiles) with two buffers, or 128
    rows with three where 256 would leave most of a tile empty. K is split only where the tiles
    leave most SMs idle, into the split with the fewest waves x steps a program (float32 partials
    cost memory traffic, so ties keep the smaller split)."""
    block_m, stages = (256, 2) if M > 192 else (128, 3)
    tiles = cdiv(M, block_m) * cdiv(N, BLOCK_N)
    steps = K // BLOCK_K
    split = 1
    if tiles < 0.8 * sms:
        cost = {s: cdiv(tiles * s, sms) * cdiv(steps, s) for s in (1, 2, 4) if s == 1 or steps // s >= 8}
        split = min(cost, key=lambda s: (cost[s], s))
    return Plan(block_m, stages, split)


def launch_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                bias: torch.Tensor | None, out: torch.Tensor, p: Plan, pdl: bool, probe: int = 0) -> tuple:
    """(grid, args, kwargs) of one launch (the CPU compile test builds them too)."""
    M, K = x.shape
    N = w.shape[0]
    k_per_split = cdiv(K // BLOCK_K, p.split) * BLOCK_K
    split = cdiv(K, k_per_split)
    tiles = cdiv(M, p.block_m) * cdiv(N, BLOCK_N)
    part, counters = split_buffers(out, split, tiles)
    args = (x, w, scale, zero, bias if bias is not None else out, out, part, counters, M, N, K, k_per_split, split,
            x.stride(0), w.stride(0), scale.stride(0), out.stride(0))
    kwargs = dict(GROUP=group, HAS_BIAS=bias is not None, SPLIT_ONE=split == 1, BLOCK_M=p.block_m, STAGES=p.stages,
                  GROUP_M=8, PDL=pdl, PROBE=probe, num_warps=WARPS, launch_pdl=pdl)
    return (tiles, split), args, kwargs


def w4a16_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False,
               p: Plan | None = None) -> torch.Tensor:
    """x [M, K] @ the 4-bit w [N, K/8] dequantized .T (+ bias) -> out [M, N] in x's dtype, on Hopper
    (supports() holds; scale and zero [K/G, N] as kernels/int4.py's group_of() checks them)."""
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid, args, kwargs = launch_args(x, w, scale, zero, group, bias, out, p or plan(M, N, K, sm_count(x.device)), pdl)
    launch(_w4a16_gemm_kernel, grid, *args, **kwargs)
    return out


def baselines(x: torch.Tensor, qs: list) -> dict:
    """cuBLAS on the 16-bit weights and the engine's dequantization + cuBLAS, us per layer of one CUDA
    graph over the 4-bit weights qs; and a kernel's error against reference.int4_linear (rel_err)."""
    from kernels import int4, reference
    from lab.kernels import graph_us

    w16 = [int4.dequantize(*q, x.dtype) for q in qs]
    out = {"cublas_bf16_us": round(graph_us(lambda: [torch.nn.functional.linear(x, w) for w in w16], rep=50,
                                            per=len(qs)), 1)}
    w16.clear()
    out["dequant_cublas_us"] = round(graph_us(lambda: [reference.linear(x, int4.dequantize(*q, x.dtype)) for q in qs],
                                              rep=50, per=len(qs)), 1)
    return out


def rel_err(got: torch.Tensor, x: torch.Tensor, q: tuple) -> float:
    """max |got - reference| / max |reference| for x times the 4-bit weight q."""
    from kernels import reference

    want = reference.int4_linear(x, *q).float()
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def measure(path: Path | None) -> dict:
    """Each case: the plan, K whole and as the plan splits it, the parts left out (gate_up at 2,048
    rows), against cuBLAS on the 16-bit weight and dequantization + cuBLAS; us per layer of one CUDA
    graph over three weight copies."""
    from engine.int4 import quantize
    from lab.kernels import gpu_and_date, graph_us

    torch.manual_seed(0)
    res = gpu_and_date() | {"timing": "cuda graph, 3 weight copies, us per layer", "group": 128, "cases": {}}
    for name, n, k, rows in (("gate_up", 28672, 4096, (512, 2048)), ("down", 4096, 14336, (512,)),
                             ("qkv", 6144, 4096, (512,)), ("o", 4096, 4096, (512,))):
        qs = [quantize((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), 128) for _ in range(3)]
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            hp = plan(m, n, k, sm_count(x.device))
            row: dict = {"plan": hp.__dict__}
            variants = [(0, split) for split in sorted({1, hp.split})]
            if name == "gate_up" and m == 2048:
                variants += [(probe, 1) for probe in (1, 2, 3)]
            for probe, split in variants:
                p = Plan(hp.block_m, hp.stages, split)

                def one(q, p=p, probe=probe):
                    grid, args, kwargs = launch_args(x, *q, 128, None, out, p, False, probe)
                    launch(_w4a16_gemm_kernel, grid, *args, **kwargs)

                row[f"probe{probe}_split{split}_us"] = round(graph_us(lambda: [one(q) for q in qs], rep=50, per=3), 1)
            row["max_rel_err"] = rel_err(w4a16_gemm(x, *qs[0], 128), x, qs[0])
            row |= baselines(x, qs)
            res["cases"][f"{name}_{m}"] = row
            print(name, m, json.dumps(row), flush=True)
            if path is not None:
                path.write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    measure(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
