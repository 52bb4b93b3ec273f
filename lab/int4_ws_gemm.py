"""The warp-specialized form of lab/int4_smem_gemm.py's W4A16 GEMM for prompt steps (Hopper, Gluon):
`python -m lab.int4_ws_gemm --out F` times it against cuBLAS on the 16-bit weight and the engine's
dequantization + cuBLAS at Llama-3-8B's projections.

lab/int4_smem_gemm.py had every warp unpack, store and copy between CTA barriers, and the work around
its matmul did not hide (bench/NOTES.md, 2026-11-29). Here the roles are split, as
kernels/prefill_ws.py splits them: a 4-warp producer partition takes x's tiles by TMA and unpacks
the weight's 64-column halves into a ring of STAGES buffers; two consumer warpgroups, one per 64
weight rows, only wait for a stage, multiply it (wgmma, x's rows as N), and hand it back. mbarriers:
`x_ready` (TMA bytes), `w_ready` (the producer's values stored: its warps meet at a barrier, then one
arrives), `empty` (both consumers' MMAs of the stage are done). The weight's values are rounded as
kernels/int4.py's dequantize() rounds them.

Measured on an H200 (bench/NOTES.md, 2026-11-29): correct, and no faster than the lockstep form:
gate_up at 512 rows 277 us against dequantization + cuBLAS's 272, at 2,048 rows 1,002 against 804
(the lockstep form 990); down at 2,048 rows 480 against 383. Separating the roles does not hide the
unpacking and the weight's trip through shared memory; what is left to try is the weight as the
MMA's register operand (no shared-memory stores), unpacked by the consumers between asynchronous
MMAs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels.int4_wgmma import _hopper, gluon  # the Gluon imports and their names in Triton 3.6 and 3.9
from kernels.launch import cdiv, launch
from kernels.linear import grouped_tile

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from kernels.int4_wgmma import _cta_barrier, fence_async_shared, gl, warpgroup_mma, warpgroup_mma_wait
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BN = 128  # weight rows a program: one 64-row half a consumer warpgroup
BK = 64  # columns a stage: half of a 128-column block of 16 words
STAGES = 4


if gluon is not None:

    @gluon.jit
    def _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, planes, k, K, N, stride_wn, stride_sg, group):
        """The 16 words of 128-column block k // 128 for the rows, and the 2^23 + zero and scale of
        each of the planes ([rows, 4]); zeros past K or N. (A partition's arguments reach it as
        values, not constexprs: `group` is one.)"""
        words = gl.load(w_ptr + rows[:, None].to(gl.int64) * stride_wn + (k // 8 + cols)[None, :],
                        mask=((rows < N) & (k < K))[:, None], other=0)
        ok = (rows_p < N) & (k < K)
        at = ((k + planes * 16) // group)[None, :] * stride_sg + rows_p[:, None]  # a plane's 16 columns: one group
        zero = gl.load(z_ptr + at, mask=ok[:, None], other=0).to(gl.float32) + 8388608.0
        scale = gl.load(s_ptr + at, mask=ok[:, None], other=0.0).to(gl.float32)
        return words, zero, scale

    @gluon.jit
    def _half(words, zero, scale, shifts, dtype: gl.constexpr):
        """Planes 4h .. 4h+3 (shifts: their bit offsets; zero and scale theirs) of the words as the
        [rows, 64] values of dtype, column 16 j + c from plane j of word c."""
        q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | 0x4B000000
        w = ((q.to(gl.float32, bitcast=True) - zero[:, :, None]) * scale[:, :, None]).to(dtype)
        return gl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2]))

    @gluon.jit
    def _produce(x_desc, w_ptr, s_ptr, z_ptr, x_bufs, w_bufs, x_ready, w_ready, empty, M, N, K, stride_wn,
                 stride_sg, group):
        dtype: gl.constexpr = x_desc.dtype
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        NS: gl.constexpr = x_bufs.type.shape[0]
        # [rows, 4 planes, 16 words]: a thread 8 words of a row, the 4 planes of a half
        w3: gl.constexpr = gl.BlockedLayout([1, 4, 8], [16, 1, 2], [4, 1, 1], [2, 1, 0])
        words_layout: gl.constexpr = gl.SliceLayout(1, w3)
        planes_layout: gl.constexpr = gl.SliceLayout(2, w3)
        pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, 128, 8)
        rows = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, words_layout))
        rows_p = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, planes_layout))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout))
        p4 = gl.arange(0, 4, layout=gl.SliceLayout(0, planes_layout))
        words, zero, scale = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, p4, 0, K, N, stride_wn, stride_sg,
                                         group)
        _, zero_hi, scale_hi = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, p4 + 4, 0, K, N, stride_wn,
                                           stride_sg, group)
        for b in range(K // 128):
            k = (b + 1) * 128
            nxt_words, nxt_zero, nxt_scale = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, p4, k, K, N,
                                                         stride_wn, stride_sg, group)
            _, nxt_zero_hi, nxt_scale_hi = _load_block(w_ptr, s_ptr, z_ptr, rows, rows_p, cols, p4 + 4, k, K, N,
                                                       stride_wn, stride_sg, group)
            for h in gl.static_range(2):
                i = 2 * b + h
                s = i % NS
                mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)  # a fresh barrier: its phase before 0 is done
                mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
                _tma_load(x_desc, [pid_m * BLOCK_M, i * 64], x_ready.index(s), x_bufs.index(s))
                if h == 0:
                    w_bufs.index(s).store(_half(words, zero, scale, p4 * 4, dtype))
                else:
                    w_bufs.index(s).store(_half(words, zero_hi, scale_hi, p4 * 4 + 16, dtype))
                fence_async_shared()
                _cta_barrier()  # the partition's 4 warps: every value is stored before the one arrival
                mbarrier.arrive(w_ready.index(s), count=1)
            words, zero, scale, zero_hi, scale_hi = nxt_words, nxt_zero, nxt_scale, nxt_zero_hi, nxt_scale_hi

    @gluon.jit
    def _consume(x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias,
                 HALF: gl.constexpr):
        BLOCK_M: gl.constexpr = x_bufs.type.shape[1]
        NS: gl.constexpr = x_bufs.type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        acc = gl.zeros([64, BLOCK_M], gl.float32, mma)
        steps = K // 64
        for i in range(steps):
            s = i % NS
            ph = (i // NS) & 1
            mbarrier.wait(x_ready.index(s), ph)
            mbarrier.wait(w_ready.index(s), ph)
            acc = warpgroup_mma(w_bufs.index(s).slice(HALF * 64, 64), x_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # the stage before is read: hand it back
            if i > 0:
                mbarrier.arrive(empty.index((i - 1) % NS), count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, 128, 8)
        offs_n = pid_n * 128 + HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        if has_bias:
            acc += gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        gl.store(out_ptr + offs_m[None, :].to(gl.int64) * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)

    # one function a consumer partition: HALF as a constexpr (see kernels/prefill_ws.py)
    @gluon.jit
    def _consume0(x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias):
        _consume(x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias, 0)

    @gluon.jit
    def _consume1(x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias):
        _consume(x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias, 1)

    @gluon.jit(do_not_specialize=["M"])
    def _w4a16_ws_kernel(x_desc, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, stride_wn, stride_sg, stride_om,
                         group, has_bias, STAGES: gl.constexpr, REGS_C: gl.constexpr, REGS_P: gl.constexpr):
        dtype: gl.constexpr = x_desc.dtype
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 64], dtype)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 64], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, 128, 64], w_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(i), count=1)
            mbarrier.init(w_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        consumer_args = (x_bufs, w_bufs, x_ready, w_ready, empty, b_ptr, out_ptr, M, N, K, stride_om, has_bias)
        producer_args = (x_desc, w_ptr, s_ptr, z_ptr, x_bufs, w_bufs, x_ready, w_ready, empty, M, N, K, stride_wn,
                         stride_sg, group)
        gl.warp_specialize([(_consume0, consumer_args), (_consume1, consumer_args), (_produce, producer_args)],
                           [4, 4], [REGS_C, REGS_P])


def supports(x: torch.Tensor, K: int, group: int) -> bool:
    """A Hopper GPU, 16-bit x that TMA can address (unit column stride, 16-byte aligned base and
    rows), K in whole 128-column blocks, groups of a multiple of 16 columns."""
    return (gluon is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and K % 128 == 0
            and group % 16 == 0 and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0
            and _hopper(torch.cuda.current_device() if x.device.index is None else x.device.index))


def launch_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                bias: torch.Tensor | None, out: torch.Tensor, block_m: int, regs: tuple[int, int] = (176, 152)) -> tuple:
    """(grid, args, kwargs) of one launch (the CPU compile test builds them too)."""
    M, K = x.shape
    N = w.shape[0]
    layout = gl.NVMMASharedLayout.get_default_for([block_m, BK], gl.float16 if x.dtype == torch.float16 else gl.bfloat16)
    desc = GluonDescriptor(x, [M, K], [x.stride(0), 1], [block_m, BK], layout)
    args = (desc, w, scale, zero, bias if bias is not None else out, out, M, N, K, w.stride(0), scale.stride(0),
            out.stride(0), group, int(bias is not None))
    kwargs = dict(STAGES=STAGES if block_m == 256 else 6, REGS_C=regs[0], REGS_P=regs[1], num_warps=4, maxnreg=168)
    return (cdiv(M, block_m) * cdiv(N, BN),), args, kwargs


def w4a16_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               bias: torch.Tensor | None = None, block_m: int | None = None) -> torch.Tensor:
    """x [M, K] @ the 4-bit w [N, K/8] dequantized .T (+ bias) -> [M, N] in x's dtype (supports() holds)."""
    M = x.shape[0]
    out = torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device)
    if M:
        grid, args, kwargs = launch_args(x, w, scale, zero, group, bias, out, block_m or (256 if M > 192 else 128))
        launch(_w4a16_ws_kernel, grid, *args, **kwargs)
    return out


PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def measure(path: Path | None, names: list[str]) -> dict:
    """Llama-3-8B's projections at 512 and 2,048 rows: this kernel (256- and 128-row tiles) against
    cuBLAS on the 16-bit weight and dequantization + cuBLAS; us per layer of one CUDA graph over three
    weight copies."""
    from engine.int4 import quantize
    from lab.int4_smem_gemm import baselines, rel_err
    from lab.kernels import gpu_and_date, graph_us

    torch.manual_seed(0)
    res = gpu_and_date() | {"timing": "cuda graph, 3 weight copies, us per layer", "group": 128, "cases": {}}
    for name in names:
        n, k = PROJECTIONS[name]
        qs = [quantize((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), 128) for _ in range(3)]
        for m in (512, 2048):
            x = torch.randn(m, k, device="cuda").bfloat16()
            row: dict = {}
            for bm in (256, 128):
                row[f"ws_{bm}_us"] = round(graph_us(lambda: [w4a16_gemm(x, *q, 128, block_m=bm) for q in qs],
                                                    rep=50, per=3), 1)
                row[f"ws_{bm}_rel_err"] = rel_err(w4a16_gemm(x, *qs[0], 128, block_m=bm), x, qs[0])
            row |= baselines(x, qs)
            res["cases"][f"{name}_{m}"] = row
            print(name, m, json.dumps(row), flush=True)
            if path is not None:
                path.write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--proj", default=",".join(PROJECTIONS), help="which of " + ",".join(PROJECTIONS))
    a = ap.parse_args(argv)
    measure(a.out, a.proj.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
