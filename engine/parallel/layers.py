"""Parallel layers with local shapes, and the shard arithmetic the loader uses to cut a global
weight into this rank's part.

A Shard says which slice of a global tensor a rank holds along one dimension, as segments: a
packed weight (q|k|v, gate|up) is several global tensors stacked along the output rows, and the
rank takes its slice of each, in order. Q heads, the MLP's intermediate size and the vocabulary are
split evenly; KV heads are split evenly, or replicated whole where there are fewer than ranks
(each rank then holds the one KV head its Q heads attend to, as kvcache/spec.py sizes it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.parallel.comm import Comm
from engine.quant import INT4_PACK, Fp8Format, Int4Format, QuantizationError, WeightFormat, blocks_align, scale_shape


@dataclass(frozen=True)
class Segment:
    global_size: int  # of this part of the global tensor, along the shard dimension
    start: int  # this rank's first index in it
    length: int  # how many this rank holds


@dataclass(frozen=True)
class Shard:
    dim: int
    segments: tuple[Segment, ...]

    @property
    def global_size(self) -> int:
        return sum(s.global_size for s in self.segments)

    @property
    def local_size(self) -> int:
        return sum(s.length for s in self.segments)

    def local_offset(self, i: int) -> int:
        """Where segment i starts in the rank's tensor."""
        return sum(s.length for s in self.segments[:i])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of a global tensor (all segments stacked)."""
        parts, at = [], 0
        for s in self.segments:
            parts.append(full.narrow(self.dim, at + s.start, s.length))
            at += s.global_size
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def even_split(size: int, rank: int, ranks: int) -> Segment:
    assert size % ranks == 0, f"{size} does not split over {ranks} ranks"
    n = size // ranks
    return Segment(size, rank * n, n)


def head_split(num_heads: int, head_dim: int, rank: int, ranks: int) -> Segment:
    """This rank's heads, in elements: an even split, or with fewer heads than ranks the one head
    that ranks // num_heads consecutive ranks share."""
    if num_heads >= ranks:
        s = even_split(num_heads, rank, ranks)
        return Segment(num_heads * head_dim, s.start * head_dim, s.length * head_dim)
    assert ranks % num_heads == 0, f"{num_heads} heads can't be shared evenly by {ranks} ranks"
    return Segment(num_heads * head_dim, rank // (ranks // num_heads) * head_dim, head_dim)


def vocab_split(vocab: int, rank: int, ranks: int) -> tuple[Segment, int]:
    """(the rank's contiguous vocabulary range, rows per rank): every rank holds ceil(V / ranks)
    rows, the last ones padded where V does not divide."""
    per = -(-vocab // ranks)
    start = min(rank * per, vocab)
    return Segment(vocab, start, min(per, vocab - start)), per


def _weight(module: nn.Module, shard: Shard, rows: int, cols: int, quant: WeightFormat | None,
            by_group: bool = False) -> None:
    """module.weight [rows, cols] in the checkpoint's format (engine/quant.py), and the buffers
    weight_scale (None for a 16-bit weight) and weight_zero (4-bit weights only):
    - FP8: FP8 values with float32 scales. Block scales whose blocks would straddle two packed
      segments (q|k|v of small heads) or a rank's cut are held per row instead;
    - 4-bit: int32 words [rows, cols / 8] with float16 scales and uint8 zero points [groups, rows]
      (engine/int4.py); for groups in activation order also weight_perm, int64 [cols]: the input
      column of each of the weight's columns (the loader sorts them by group; x comes in that
      order: LlamaForCausalLM.fold_act_orders). Split along its input columns (a row-parallel
      weight under tensor parallelism), a rank takes its share of the groups in group order where
      the layer before writes its input so (by_group: the MLP's down, whose input columns gate/up's
      rows choose, no weight_perm); else every group, holding this rank's columns of it and
      zeros for the rest (weight_perm -1 there): the weight is as wide as the whole one."""
    module.quant = quant
    module.lora = None  # LoRA adapters' stacked weights, where some adapter targets it (engine/lora.py)
    scale = zero = perm = None
    if isinstance(quant, Int4Format):
        ordered = quant.act_order and not (by_group and shard.dim == 1 and shard.local_size != shard.global_size)
        if ordered and shard.dim == 1:
            cols = shard.global_size  # every group (the same width where the weight is not split)
        group = cols if quant.group == -1 else quant.group
        if cols % group or cols % INT4_PACK:
            raise QuantizationError(f"a 4-bit weight of {cols} input columns on this rank does not split into "
                                    f"groups of {group}; use fewer ranks")
        if ordered:
            perm = torch.arange(cols)
        module.weight = nn.Parameter(torch.empty(rows, cols // INT4_PACK, dtype=torch.int32), requires_grad=False)
        scale = torch.empty(cols // group, rows, dtype=torch.float16)
        zero = torch.empty(cols // group, rows, dtype=torch.uint8)
    else:
        module.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e4m3fn if quant else None),
                                     requires_grad=quant is None)
        if isinstance(quant, Fp8Format):
            scale = torch.empty(scale_shape(rows, cols, quant.blocked, shard.dim == 1 or blocks_align(shard.segments)))
    module.register_buffer("weight_scale", scale)
    module.register_buffer("weight_zero", zero)
    module.register_buffer("weight_perm", perm)


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T (+ b_r): this rank's rows of the output (of each packed segment); no collective."""

    def __init__(self, in_features: int, segments: list[Segment], bias: bool,
                 quant: WeightFormat | None = None) -> None:
        super().__init__()
        self.shard = Shard(0, tuple(segments))
        out = self.shard.local_size
        _weight(self, self.shard, out, in_features, quant)
        self.bias = nn.Parameter(torch.empty(out)) if bias else None


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T: this rank's input columns; x_r W_r^T is this rank's part of
    y, which the caller sums over the ranks (Comm.reduce_norm, with the norm after it). by_group: a
    4-bit weight in activation order takes its columns by group (_weight)."""

    def __init__(self, segment: Segment, out_features: int, quant: WeightFormat | None = None,
                 by_group: bool = False) -> None:
        super().__init__()
        self.shard = Shard(1, (segment,))
        _weight(self, self.shard, out_features, segment.length, quant, by_group)


class VocabRows(nn.Module):
    """This rank's contiguous range of the vocabulary's rows (padded to rows_per_rank): what the
    embedding and the LM head split alike."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: Comm) -> None:
        super().__init__()
        segment, rows = vocab_split(vocab_size, comm.rank, comm.size)
        self.vocab_size, self.comm = vocab_size, comm
        self.start, self.num_valid = segment.start, segment.length
        self.shard = Shard(0, (segment,))
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))


class VocabParallelEmbedding(VocabRows):
    """Each rank holds a contiguous range of the vocabulary; a token outside it looks up zeros,
    and the all-reduce sums the one rank's row into every rank. Also the weight of a
    vocabulary-parallel LM head (tied embeddings share it)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """-> this rank's part of the embeddings, a sum over the ranks (the first layer's input norm
        sums it as it sums the layers' outputs: Comm.reduce_norm)."""
        if self.comm.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return x.masked_fill_(outside.unsqueeze(-1), 0)


class ParallelLMHead(VocabRows):
    """Logits over this rank's vocabulary rows, gathered into the full vocabulary on every rank,
    so every rank samples the same token from the same logits (greedy rows need only the keys of
    vocab_argmax)."""


def vocab_logits(h: torch.Tensor, weight: torch.Tensor, comm: Comm, vocab_size: int,
                 gather: bool = True) -> torch.Tensor:
    """h [N, hidden] @ this rank's vocabulary rows -> all ranks' logits [N, vocab_size], or with
    gather=False this rank's [N, rows] (gather_logits later)."""
    logits = F.linear(h, weight)
    return gather_logits(logits, comm, vocab_size) if gather else logits


def gather_logits(logits: torch.Tensor, comm: Comm, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [N, rows] -> [N, vocab_size] (the last rank's padded rows off)."""
    if comm.size == 1:
        return logits
    logits = comm.all_gather(logits)
    return logits if logits.shape[-1] == vocab_size else logits[:, :vocab_size].contiguous()


def vocab_argmax(ops, logits: torch.Tensor, comm: Comm, start: int, num_valid: int, out: torch.Tensor) -> torch.Tensor:
    """This rank's logits [N, rows] of vocabulary entries start.. (num_valid of them real) -> the
    greedy tokens over the whole vocabulary [N] into out, on every rank the same: each rank's best
    as a key, the largest over the ranks (kernels/argmax.py), instead of gathering the logits."""
    if comm.size == 1:
        return ops.argmax_rows(logits, out)
    from kernels.argmax import key_token

    if num_valid:
        keys = ops.argmax_keys(logits[:, :num_valid], start)
    else:  # a rank past the end of a vocabulary smaller than the ranks' rows: every other key wins
        keys = torch.full((logits.shape[0],), torch.iinfo(torch.int64).min, dtype=torch.int64, device=logits.device)
    return key_token(comm.all_reduce_max(keys), out=out)
