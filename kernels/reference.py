"""Plain-torch reference ops: the test oracle for every Triton kernel and the CPU execution path.

Shapes (see kvcache/spec.py for the page layout):
  k_cache, v_cache  [num_blocks, num_kv_heads, block_size, head_dim]  storage dtype (fp8/int8 V:
                    [num_blocks, num_kv_heads, head_dim, block_size], quant.v_page_view)
  k_scale, v_scale  [num_blocks, num_kv_heads, block_size] float32, only for fp8/int8 caches
  slot_mapping      [T] int, slot = block * block_size + offset, -1 = skip
  block_tables      [B, max_blocks] int32 (unused tail entries are ignored)
  seq_lens          [B] int32, tokens in the cache for each sequence after this step's write
  query_start_loc   [B + 1] int32, prefix sums of query lengths; queries are the LAST q_len
                    positions of their sequence
"""
from __future__ import annotations

import torch

from kvcache import quant


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, kv_dtype: str | None = None,
                   q: torch.Tensor | None = None) -> None:
    """Scatter k, v [T, num_kv_heads, head_dim] into the pages; quantize when kv_dtype is fp8/int8.
    q [T, num_heads, head_dim]: the same tokens' queries, which pick K's scales (kvcache/quant.py);
    ignored by unquantized caches."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = k[keep], v[keep]
    if kv_dtype in quant.QMAX:
        qg = None
        if q is not None:
            t, h, d = k.shape
            qg = q[keep].reshape(t, h, q.shape[1] // h, d)  # query head i reads KV head i // group
        kq, ks = quant.quantize(k, kv_dtype, qg)
        vq, vs = quant.quantize(v, kv_dtype)
        k_cache[blocks, :, offsets] = kq
        quant.v_page_view(v_cache)[blocks, :, offsets] = vq
        k_scale[blocks, :, offsets] = ks
        v_scale[blocks, :, offsets] = vs
    else:
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
              seq_len: int) -> torch.Tensor:
    """One sequence's cached entries as float32 [num_kv_heads, seq_len, head_dim]."""
    block_size = cache.shape[2]
    nblocks = -(-seq_len // block_size)
    idx = block_table[:nblocks].long()
    x = cache[idx]  # [nb, H, bs, D]
    if scale is not None:
        x = quant.dequantize(x, scale[idx])
    x = x.float().permute(1, 0, 2, 3).reshape(cache.shape[1], nblocks * block_size, cache.shape[3])
    return x[:, :seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    softmax_scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's pages -> [T, num_heads, head_dim].

    Covers both prefill chunks (q_len > 1, attending to the cached prefix and to themselves) and
    decode (q_len == 1). Accumulates in float32; the result has q's dtype (written into `out` if given).
    """
    out = torch.empty_like(q) if out is None else out
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    v_pages = v_cache if v_scale is None else quant.v_page_view(v_cache)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = qsl[i], qsl[i + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[i], seq_len).repeat_interleave(group, dim=0)
        v = gather_kv(v_pages, v_scale, block_tables[i], seq_len).repeat_interleave(group, dim=0)
        qi = q[lo:hi].float().transpose(0, 1)  # [H, q_len, D]
        scores = (qi @ k.transpose(1, 2)) * softmax_scale  # [H, q_len, seq_len]
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[lo:hi] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode: one query token per sequence, q [B, num_heads, head_dim]."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, softmax_scale, k_scale, v_scale, out)


def rotary_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            softmax_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode from unrotated q, k: rotary embedding, the new k, v into the (unquantized) pages,
    then paged_decode_attention."""
    q, _ = apply_rotary(q, k, positions, cos_sin, v, k_cache, v_cache, slot_mapping)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out=out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             order: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face's Llama computes it; with residual, first x += residual and
    return (normed, x + residual) so the caller keeps the sum as the next residual. order: the
    normed output's columns in this order (normed[..., order])."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    if order is not None:
        out = out.index_select(-1, order)
    return out if residual is None else (out, residual)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding. q [T, Hq, D], k [T, Hkv, D], cos_sin [max_pos, 2, D] float32
    (cos then sin, each already duplicated over both halves). With v and the (unquantized) pages,
    then writes the rotated k and v into them (write_kv_cache)."""
    cs = cos_sin[positions.long()]
    cos = cs[:, 0].unsqueeze(1).to(q.dtype)
    sin = cs[:, 1].unsqueeze(1).to(q.dtype)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if k_cache is not None:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] holding gate then up -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, V] -> int64 [N], the first index of each row's maximum (greedy tokens)."""
    return torch.argmax(x, dim=-1, out=out)


def argmax_keys(x: torch.Tensor, offset: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, V], the logits of vocabulary entries offset .. offset + V - 1 -> int64 [N]: each row's
    maximum and its first index as one key, (order-preserving int32 of the float32 value) << 32 |
    (2**32 - 1 - (offset + index)), NaN above every value (kernels/argmax.py)."""
    idx = torch.argmax(x, dim=-1)
    best = x.gather(1, idx[:, None])[:, 0].float() + 0.0
    bits = best.view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = torch.where(best.isnan(), 0x7FFFFFFF, ordered)
    keys = (ordered << 32) | (0xFFFFFFFF - (idx + offset))
    return keys if out is None else out.copy_(keys)


def sample_probs(x: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """What kernels/sample.py draws from: per row, softmax(x / T) over the tokens with fewer than
    top_k tokens and less than top_p of the mass above them, renormalized; a row with T = 0 puts
    all of it on its first largest logit. -> float64 [N, V]."""
    x = x.double()
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        row = x[i]
        if temps[i] <= 0:
            out[i, int(row.argmax())] = 1.0
            continue
        p = torch.softmax(row / float(temps[i]), dim=-1)
        vals, order = row.sort(descending=True)
        ps = p[order]
        # a token's count and mass above it: those of the first token of its value in sorted order
        _, group, sizes = torch.unique_consecutive(vals, return_inverse=True, return_counts=True)
        starts = torch.cumsum(sizes, 0) - sizes
        count = starts[group]
        mass = (torch.cumsum(ps, 0) - ps)[count]
        keep = (count < int(top_k[i])) & ((mass < float(top_p[i])) | (float(top_p[i]) >= 1.0))
        out[i, order] = torch.where(keep, ps, 0.0)
        out[i] /= out[i].sum()
    return out


def penalize_rows(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, params: torch.Tensor,
                  counts: torch.Tensor, prompt: torch.Tensor) -> None:
    """kernels/penalties.py in torch ops, in place: row rows[i] of x takes the repetition, frequency
    and presence penalties params[i] against counts[slots[i]] and prompt[slots[i]]."""
    c = counts.index_select(0, slots)
    present = c > 0
    seen = present | prompt.index_select(0, slots)
    rep, freq, pres = (p.unsqueeze(1) for p in params.unbind(1))
    sub = x.index_select(0, rows)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * c
    sub = sub - pres * present
    x.index_copy_(0, rows, sub)


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/logprob_stats.py in torch ops: per row the log-sum-exp (float32), the target's logprob
    and its rank (1 + how many logits are higher)."""
    x = logits.float()
    lse = x.logsumexp(dim=-1)
    xt = x.gather(1, targets.unsqueeze(1))
    return lse, xt.squeeze(1) - lse, (x > xt).sum(dim=-1) + 1


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: x @ weight.T holding gate then up -> silu(gate) * up."""
    return silu_and_mul(linear(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, into `out` when given."""
    if out is None:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """dst[:, dst_blocks] = src[:, src_blocks] (kernels/copy_pages.py)."""
    dst.index_copy_(1, dst_blocks.long(), src.index_select(1, src_blocks.long()))


FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FP8_GROUP = 128


def fp8_group(w: torch.Tensor, w_scale: torch.Tensor) -> int:
    """kernels/fp8.py's group_of: the input's quantization group, K for one scale per row of w
    (w_scale [N or ceil(N/128), 1]), else 128."""
    return w.shape[1] if w_scale.shape[1] == 1 else FP8_GROUP


def quantize_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]): each row's groups of
    `group` columns scaled by their largest magnitude / 448 (kernels/fp8.py's quantize)."""
    M, K = x.shape
    groups = -(-K // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - K)).view(M, groups, group)
    amax = xf.abs().amax(dim=-1)
    # a tensor divisor: CUDA torch multiplies by the reciprocal of a scalar one, which is not always
    # the IEEE quotient the kernel takes (and moves an input across an FP8 rounding boundary)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, groups * group)[:, :K], scale


def dequantize_fp8(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 values [R, K] -> float32, with scales per row or per block of 128 rows ([R or
    ceil(R / 128), ...]) and for the whole row or per group of 128 columns ([..., 1 or ceil(K / 128)])."""
    R, K = v.shape
    row_group = 1 if scale.shape[0] == R else FP8_GROUP
    col_group = K if scale.shape[1] == 1 else FP8_GROUP
    s = scale.float().repeat_interleave(row_group, 0)[:R].repeat_interleave(col_group, 1)[:, :K]
    return v.float() * s


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the FP8 weight w [N, K].T (+ bias) with x quantized per row (and group of 128
    columns for block scales): what kernels/fp8.py computes, in float32, rounded to x's dtype."""
    group = fp8_group(w, w_scale)
    xq, xs = quantize_fp8(x, group)
    y = dequantize_fp8(xq, xs) @ dequantize_fp8(w, w_scale).t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if out is None else out.copy_(y)


def fp8_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """gate_up_silu with an FP8 gate_up weight (kernels/fp8.py)."""
    return silu_and_mul(fp8_linear(x, weight, weight_scale))


INT4_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def int4_block(K: int) -> int:
    """The columns a 4-bit weight's words interleave over (engine/int4.py): 128, or the largest
    power of two from 8 that divides K."""
    block = 128
    while K % block:
        block //= 2
    assert block >= 8, f"a 4-bit weight's K ({K}) must be a multiple of 8"
    return block


def int4_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8 C]: each word's nibbles from the lowest, in order."""
    vals = (packed.to(torch.int32)[..., None] >> INT4_SHIFTS.to(packed.device)) & 0xF
    return vals.to(torch.uint8).reshape(packed.shape[0], -1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The engine's 4-bit words int32 [R, K/8] -> uint8 [R, K] in column order: in each block of B =
    int4_block(K) columns, word c's nibble j (bits 4j..4j+3) holds column j * B/8 + c of the block,
    so each nibble position of the block's B/8 words covers B/8 consecutive columns."""
    R, words = packed.shape
    B = int4_block(words * 8)
    vals = int4_nibbles(packed).view(R, words * 8 // B, B // 8, 8)
    return vals.transpose(2, 3).reshape(R, words * 8)


def dequantize_int4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight int32 [N, K/8] with float16 scales and uint8 zero points [K/G, N] -> float32
    [N, K]: (q - zero) * scale, group by group."""
    q = unpack_int4(w).float()
    group = q.shape[1] // scale.shape[0]
    return (q - zero.t().float().repeat_interleave(group, 1)) * scale.t().float().repeat_interleave(group, 1)


def gather_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> x[:, order] [M, len(order)]; an entry of -1 gives a column of zeros
    (kernels/fused.py)."""
    padded = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)
    return padded.index_select(-1, torch.where(order < 0, x.shape[1], order))


def int4_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                order: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (its columns in `order` where given) @ the 4-bit weight w [N, K/8] dequantized, .T
    (+ bias): float32 sums, rounded to x's dtype (kernels/int4.py)."""
    if order is not None:
        x = gather_columns(x, order)
    y = x.float() @ dequantize_int4(w, scale, zero).t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if out is None else out.copy_(y)


def int4_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      order: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up_silu with a 4-bit gate_up weight (kernels/int4.py)."""
    return silu_and_mul(int4_linear(x, weight, scale, zero, order=order))
