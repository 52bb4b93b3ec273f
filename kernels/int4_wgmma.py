"""The W4A16 matmul of decode steps and small mixed ones for Hopper, in Gluon: the 4-bit weight is
unpacked straight into the registers of warpgroup MMA's A operand.

Triton's `tl` version (kernels/int4.py) converts each value with the int -> float unit (a quarter
of the integer units' rate) and, because a 128-column block's operand is assembled from its
nibble planes, either multiplies plane by plane (one wgmma and its wait per 16 columns) or passes
the operand through shared memory: both left the kernel at 0.15-0.22 of its memory bound on an
H200. Here each thread loads exactly the words whose values it holds in the A operand (the
operand layout restricted to the block's 16 words: engine/int4.py puts column 16j + c in nibble j
of word c, so a thread's columns 16j + c of every plane j come from the same few words), and one
inline-asm instance turns two words into four 16-bit operand pairs with four integer instructions
and two packed subtractions: a byte permute gathers byte j of both words, a mask-and-or (0x000F000F
| MAGIC) makes each low nibble the mantissa of OFFSET + q, the shifted copy the high nibble's, and
subtracting OFFSET + zero leaves q - zero exactly. Joined and reshaped, the planes are the A
operand of one wgmma per group (up to 128 columns) with no data movement (the compiler is told to
fail otherwise); x's rows go through shared memory as the B operand (cp.async, three buffers);
scale multiplies each group's float32 sum. Each iteration loads the words, zero points and scales
of the group two ahead into registers, so their latency hides behind two MMAs.

One program: 64 weight rows (a warpgroup's M) by up to 128 x rows (the MMA's N); K is split over
programs and the partials summed in split order by the last to arrive (as kernels/linear.py does).
On an H200 (Llama-3-8B's projections, 1-16 rows) it takes 0.53-0.67x the 16-bit matmul's time, at
0.27-0.45 of its own memory bound (bench/NOTES.md, 2026-11-28): one wgmma and its wait an
iteration, a CTA barrier for x, and ~230 instructions a thread per 64 weight values leave it
latency- and issue-bound.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                    warpgroup_mma_wait)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    # Triton 3.6 (the GPU's) names the CTA barrier thread_barrier and cp.async
    # async_copy_global_to_shared; 3.9 (CI's) barrier and async_load
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon: kernels/int4.py's kernel serves every case
    gluon = None

from kernels.launch import cdiv, launch, next_pow2, sm_count, split_count
from kernels.linear import grouped_tile, split_buffers

BLOCK_N = 64  # weight rows a program: the M of one warpgroup's wgmma
BLOCK_K = 128  # the columns of the 16 words that hold a block's 8 nibble planes
# more rows than this dequantize the weight and multiply with cuBLAS (kernels/int4.py): at 512 rows
# that took 0.57-0.78x this kernel's time on Llama-3-8B's projections, at 256 rows 1.15-1.3x but for
# qkv's 0.92x (H200, bench/NOTES.md 2026-11-28)
MAX_M = 256

# q in the lowest mantissa bits of MAGIC is the 16-bit value OFFSET + q exactly
_MAGIC = {torch.bfloat16: (0x43004300, 128.0, "sub.rn.bf16x2"), torch.float16: (0x64006400, 1024.0, "sub.rn.f16x2")}


def _unpack_asm(magic: int, sub: str) -> str:
    """Two words ($2, $3), a byte selector ($4) and OFFSET + zero as a 16-bit pair ($6) -> nibbles
    2j ($0) and 2j + 1 ($1) of both words, each as (q - zero) 16-bit pairs."""
    return (f"{{ .reg .b32 t; prmt.b32 t, $2, $3, $4; lop3.b32 $0, t, 0x000F000F, {magic:#x}, 0xEA;"
            f" shr.u32 t, t, 4; lop3.b32 $1, t, 0x000F000F, {magic:#x}, 0xEA;"
            f" {sub} $0, $0, $6; {sub} $1, $1, $6; }}")


_ASM = {dtype: _unpack_asm(magic, sub) for dtype, (magic, _, sub) in _MAGIC.items()}


if gluon is not None:

    @gluon.jit
    def _byte_planes(words, zz, byte, ASM: gl.constexpr):
        """Nibble planes 2 byte and 2 byte + 1 of the words [BLOCK_N, 16], minus zero, in zz's dtype."""
        sel = gl.full(words.shape, 0, gl.int32, words.type.layout) + (byte | ((4 + byte) << 8))
        return gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r", [words, sel, zz], dtype=(zz.dtype, zz.dtype),
                                         is_pure=True, pack=2)

    @gluon.jit
    def _operand(words, zz, first, PLANES: gl.constexpr, ASM: gl.constexpr, layout: gl.constexpr):
        """Planes first .. first + PLANES - 1 (PLANES 2, 4 or 8; first even) as the [BLOCK_N, 16 PLANES]
        A operand in column order: plane p's 16 columns follow plane p - 1's."""
        lo, hi = _byte_planes(words, zz, first // 2, ASM)
        op = gl.join(lo, hi)  # [.., 16, 2]: the last index is the plane's parity
        if PLANES >= 4:
            lo, hi = _byte_planes(words, zz, first // 2 + 1, ASM)
            op = gl.join(op, gl.join(lo, hi))
        if PLANES == 8:
            lo, hi = _byte_planes(words, zz, first // 2 + 2, ASM)
            lo2, hi2 = _byte_planes(words, zz, first // 2 + 3, ASM)
            op = gl.join(op, gl.join(gl.join(lo, hi), gl.join(lo2, hi2)))
        if PLANES == 2:
            op = gl.permute(op, (0, 2, 1))
        elif PLANES == 4:
            op = gl.permute(op, (0, 3, 2, 1))
        else:
            op = gl.permute(op, (0, 4, 3, 2, 1))
        op = gl.reshape(op, (op.shape[0], 16 * PLANES))
        return gl.convert_layout(op, layout, assert_trivial=True)

    @gluon.jit
    def _group_weights(words_at, z_ptr, s_ptr, rows, scale_rows, row_ok, scale_ok, k, k_hi, stride_sg,
                       GROUP: gl.constexpr):
        """The words of column k's 128-column block and the zero points and scales of its group,
        for the program's rows (zeros where k >= k_hi)."""
        more = k < k_hi
        g = k // GROUP
        words = gl.load(words_at + (k // 128) * 16, mask=row_ok[:, None] & more, other=0)
        zero = gl.load(z_ptr + g * stride_sg + rows, mask=row_ok & more, other=0)
        scale = gl.load(s_ptr + g * stride_sg + scale_rows, mask=scale_ok & more, other=0.0)
        return words, zero, scale

    @gluon.jit
    def _store_tile(acc, b_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_BIAS: gl.constexpr):
        if HAS_BIAS:
            acc += gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit(do_not_specialize=["M"])
    def _w4a16_wgmma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                            split, stride_xm, stride_wn, stride_sg, stride_om,
                            GROUP: gl.constexpr, CHUNK: gl.constexpr, OFFSET: gl.constexpr, ASM: gl.constexpr,
                            HAS_BIAS: gl.constexpr, SPLIT_ONE: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, PDL: gl.constexpr):
        """out^T tile [BLOCK_N, BLOCK_M] = W x^T, one wgmma per CHUNK (= min(GROUP, 128)) columns."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        BLOCK_K: gl.constexpr = 128
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // CHUNK, CHUNK // 8], [4, 1], [1, 0])
        out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CHUNK], dtype)

        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_lo = pid_k * k_per_split
        k_hi = gl.minimum(k_lo + k_per_split, K)

        rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
        words_at = (w_ptr + rows[:, None].to(gl.int64) * stride_wn
                    + gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))[None, :])
        row_ok = rows < N
        scale_rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        scale_ok = scale_rows < N
        # the first two chunks' weights before the wait (no kernel writes them)
        w0, z0, s0 = _group_weights(words_at, z_ptr, s_ptr, rows, scale_rows, row_ok, scale_ok, k_lo, k_hi,
                                    stride_sg, GROUP)
        w1, z1, s1 = _group_weights(words_at, z_ptr, s_ptr, rows, scale_rows, row_ok, scale_ok, k_lo + CHUNK, k_hi,
                                    stride_sg, GROUP)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

        xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        xc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, x_layout))
        x_at = x_ptr + xm[:, None].to(gl.int64) * stride_xm + xc[None, :]
        x_ok = (xm[:, None] < M) & (xc[None, :] < CHUNK)
        x_bufs = gl.allocate_shared_memory(dtype, [3, BLOCK_M, CHUNK], x_smem_layout)
        for j in gl.static_range(2):
            _cp_async(x_bufs.index(j), x_at + k_lo + j * CHUNK, mask=x_ok & (k_lo + j * CHUNK < k_hi))
            async_copy.commit_group()
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        # one group's MMA an iteration; the weights of the group two ahead load into registers and
        # its x into the third shared buffer meanwhile
        for k in range(k_lo, k_hi, CHUNK):
            i = (k - k_lo) // CHUNK
            w2, z2, s2 = _group_weights(words_at, z_ptr, s_ptr, rows, scale_rows, row_ok, scale_ok, k + 2 * CHUNK,
                                        k_hi, stride_sg, GROUP)
            zz = (z0.to(gl.float32) + OFFSET).to(dtype)[:, None]
            if CHUNK == BLOCK_K:
                a = _operand(w0, zz, 0, CHUNK // 16, ASM, a_layout)
            else:
                a = _operand(w0, zz, (k % BLOCK_K) // 16, CHUNK // 16, ASM, a_layout)
            async_copy.wait_group(1)  # this thread's copies of x's chunk i landed
            fence_async_shared()
            _cta_barrier()  # everyone's; and every warp is past the wgmma that read buffer (i + 2) % 3
            _cp_async(x_bufs.index((i + 2) % 3), x_at + k + 2 * CHUNK, mask=x_ok & (k + 2 * CHUNK < k_hi))
            async_copy.commit_group()
            d = warpgroup_mma(a, x_bufs.index(i % 3).permute((1, 0)), acc, use_acc=False, is_async=True)
            d = warpgroup_mma_wait(0, deps=[d])
            acc += d * s0.to(gl.float32)[:, None]
            w0, z0, s0 = w1, z1, s1
            w1, z1, s1 = w2, z2, s2
        async_copy.wait_group(0)

        acc = gl.convert_layout(acc, out_layout)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
        if SPLIT_ONE:
            _store_tile(acc, b_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_BIAS)
        else:
            tile = offs_m[None, :] * N + offs_n[:, None]
            mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
            gl.store(part_ptr + pid_k * M * N + tile, acc, mask=mask)
            _cta_barrier()  # every thread's partial is stored before the count goes up
            arrived = gl.atomic_add(count_ptr + pid, 1)  # acq_rel: the last sees every partial
            if arrived == split - 1:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, out_layout)
                for s in range(0, split):
                    total += gl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(count_ptr + pid, 0)
                _store_tile(total, b_ptr, out_ptr, offs_n, offs_m, M, N, stride_om, HAS_BIAS)


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports(x: torch.Tensor, K: int, group: int) -> bool:
    """Whether this kernel takes x [M, K] times a 4-bit weight in groups of `group` columns: a
    Hopper GPU, 16-bit x of at most MAX_M rows, K in whole 128-column blocks, and groups of 32, 64 or
    a multiple of 128 (a group's planes are one MMA)."""
    return (gluon is not None and x.is_cuda and x.dtype in _ASM and x.shape[0] <= MAX_M and K % BLOCK_K == 0
            and (group in (32, 64) or group % BLOCK_K == 0)
            and _hopper(torch.cuda.current_device() if x.device.index is None else x.device.index))


@dataclass(frozen=True)
class Plan:
    block_m: int
    split: int


def plan(M: int, N: int, K: int, sms: int) -> Plan:
    """x's rows as the MMA's N: 16-64 a tile up to 128 rows, 128 beyond (each tile unpacks the
    weight again: fewer tiles unpack less, but a 128-row tile's 252 registers leave two programs
    an SM); K split until about three programs an SM (two with 64-row tiles and more). The best plans
    of sweeps on an H200 (Llama-3-8B's projections at 1-256 rows, bench/NOTES.md 2026-11-28) or within
    10% of them, except qkv at 256 rows (1.27x the best: 64-row tiles unsplit) and down at 128 (1.15x:
    128-row tiles, K in four)."""
    block_m = max(16, min(64, next_pow2(M))) if M <= 128 else 128
    tiles = cdiv(M, block_m) * cdiv(N, BLOCK_N)
    steps = K // BLOCK_K
    return Plan(block_m, split_count(tiles, steps, (2.9 if block_m <= 32 else 1.9) * sms, min_steps=2, most=16))


def launch_args(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                bias: torch.Tensor | None, out: torch.Tensor, p: Plan, pdl: bool) -> tuple:
    """(grid, args, kwargs) of one launch (the CPU compile test builds them too)."""
    M, K = x.shape
    N = w.shape[0]
    k_per_split = cdiv(K // BLOCK_K, p.split) * BLOCK_K
    split = cdiv(K, k_per_split)
    tiles = cdiv(M, p.block_m) * cdiv(N, BLOCK_N)
    part, counters = split_buffers(out, split, tiles)
    args = (x, w, scale, zero, bias if bias is not None else out, out, part, counters, M, N, K, k_per_split, split,
            x.stride(0), w.stride(0), scale.stride(0), out.stride(0))
    kwargs = dict(GROUP=group, CHUNK=min(group, BLOCK_K), OFFSET=_MAGIC[x.dtype][1], ASM=_ASM[x.dtype],
                  HAS_BIAS=bias is not None, SPLIT_ONE=split == 1, BLOCK_M=p.block_m, BLOCK_N=BLOCK_N, GROUP_M=8,
                  PDL=pdl, num_warps=4, launch_pdl=pdl)
    return (tiles, split), args, kwargs


def w4a16_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False,
                 p: Plan | None = None) -> torch.Tensor:
    """kernels/int4.py's w4a16_matmul on Hopper (supports() holds; scale and zero [K/G, N] checked
    there): x [M, K] @ the 4-bit w [N, K/8] dequantized .T (+ bias) -> out [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid, args, kwargs = launch_args(x, w, scale, zero, group, bias, out, p or plan(M, N, K, sm_count(x.device)), pdl)
    launch(_w4a16_wgmma_kernel, grid, *args, **kwargs)
    return out
