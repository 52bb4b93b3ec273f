"""Does a small model's decode step get faster if the next matmuls' weights are asked into L2 in bulk
while decode attention streams the pages?

    python -m lab.l2_prefetch VARIANT -- [lab.offline's arguments]

Decode attention of Qwen2.5-0.5B at 64 sequences runs one program per (sequence, KV head): 128 of
the H100's 132 SMs, at ~1.6 of the ~3.0 TB/s the memory can copy; the o projection and gate/up
after it take 4.2 and 9.7 us a layer from memory and 3.7 and 6.8 with their weights in L2
(bench/NOTES.md, 2026-11-27). An earlier probe had o_proj's programs ask L2 for gate/up's weights
line by line (one prefetch instruction per 128 bytes, ~136k of them) and lost 4%. Here a separate
kernel of a few programs, launched with PDL right before attention, issues `cp.async.bulk.prefetch.L2`
over whole weights (one instruction per 64 KB) before its wait, so the request runs beside qkv and
attention without taking their SMs or issue slots.

VARIANT (decode steps of at most 64 rows only; mixed steps as the engine runs them):
  none      the engine as it is
  o_gu      o_proj's and gate/up's weights, launched before attention
  o         o_proj's only
  o_gu_d    o_gu, and down's weights by a second kernel launched before gate/up
  o_gu_d_q  o_gu_d, and the next layer's qkv weights by a third launched before down
Then runs lab.offline (in this process, so that the patched layer is what the graphs capture).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernels.launch import launch
from kernels.pdl import wait_for_prior

CHUNK = 64 * 1024  # bytes a prefetch instruction asks for
LANES = 32  # one warp: one instruction per lane per round
PROGRAMS = 4  # the SMs decode attention leaves free at 64 sequences x 2 KV heads
MAX_ROWS = 64
VARIANTS = ("none", "o_gu", "o", "o_gu_d", "o_gu_d_q")


@triton.jit
def _bulk_prefetch(ptrs, sizes):
    """Ask L2 for `sizes` bytes at each of ptrs (16-byte aligned, multiples of 16; 0: nothing)."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}", "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_range(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """This program's chunks of [ptr, ptr + nbytes): p, p + P, ... for program p of P."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, LANES)
    base = ptr.to(tl.pointer_type(tl.int8))
    for r in range(0, tl.cdiv(nbytes, CHUNK * LANES * nprog)):
        off = ((r * nprog + pid) * LANES + lane).to(tl.int64) * CHUNK
        _bulk_prefetch(base + off, tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32))


@triton.jit
def _prefetch_kernel(a_ptr, a_bytes, b_ptr, b_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr,
                     PDL: tl.constexpr):
    """Ask L2 for range a, then range b, the chunks spread over the programs; then wait (PDL)."""
    _prefetch_range(a_ptr, a_bytes, CHUNK, LANES)
    _prefetch_range(b_ptr, b_bytes, CHUNK, LANES)
    wait_for_prior(PDL)


def l2_prefetch(a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """Launch the prefetch kernel (PDL) for a's bytes and b's."""
    b_ = a if b is None else b
    nb = 0 if b is None else b.numel() * b.element_size()
    launch(_prefetch_kernel, (PROGRAMS,), a, a.numel() * a.element_size(), b_, nb,
           CHUNK=CHUNK, LANES=LANES, PDL=True, num_warps=1, launch_pdl=True)


def patch(variant: str) -> None:
    """Replace DecoderLayer.forward with one that launches the variant's prefetches in decode steps."""
    from engine.models import llama as L

    if variant == "none":
        return
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")

    def forward(self, ops, x, residual, positions, cos_sin, cache, meta, summed=False):
        on = x.is_cuda and x.shape[0] <= MAX_ROWS and meta.num_decode == x.shape[0] and isinstance(self.mlp, L.MLP)
        h, residual = self.input_norm(ops, x, residual, summed)
        attn = self.self_attn
        q, k, v = attn.project(ops, h)
        if on:
            l2_prefetch(attn.o_proj.weight, None if variant == "o" else self.mlp.gate_up_proj.weight)
        o = L.paged_attention(ops, q, k, v, positions, cos_sin, cache, meta, attn.scale)
        h = ops.linear(o.reshape(x.shape[0], attn.q_size), attn.o_proj.weight)
        ln = self.post_attention_layernorm
        h, residual = self.comm.reduce_norm(ops, h, residual, ln.weight, ln.eps)
        if on and variant in ("o_gu_d", "o_gu_d_q"):
            l2_prefetch(self.mlp.down_proj.weight)
        g = ops.gate_up_silu(h, self.mlp.gate_up_proj.weight, prefetch=self.comm.fused_sums)
        if on and variant == "o_gu_d_q" and self._probe_next is not None:
            l2_prefetch(self._probe_next.self_attn.qkv_proj.weight)
        return ops.linear(g, self.mlp.down_proj.weight), residual

    init = L.LlamaForCausalLM.__init__

    def model_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # each layer's successor, kept out of the module tree (not a submodule of its predecessor)
        for layer, after in zip(self.layers, list(self.layers[1:]) + [None]):
            object.__setattr__(layer, "_probe_next", after)

    L.LlamaForCausalLM.__init__ = model_init
    L.DecoderLayer.forward = forward


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in VARIANTS:
        raise SystemExit(__doc__)
    variant = argv.pop(0)
    if argv[:1] == ["--"]:
        argv.pop(0)
    patch(variant)
    from lab import offline
    return offline.main(argv)


if __name__ == "__main__":
    sys.exit(main())
