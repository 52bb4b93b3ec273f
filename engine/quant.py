"""Quantized weights: which checkpoint formats the engine reads, and the quantization of 16-bit weights.

Two kinds: FP8 (W8A8, below) and 4-bit integers with 16-bit activations (W4A16, Int4Format).

Every dense projection (q/k/v, o, gate/up, down) of an FP8 model holds float8_e4m3fn values and a
float32 `weight_scale` in a form kernels/fp8.py multiplies: per output channel [N, 1], per 128 x
128 block [ceil(N/128), ceil(K/128)], or a row of block scales per weight row [N, ceil(K/128)]
where a packed q|k|v's heads straddle the blocks (scale_shape, blocks_align). The embedding, the
LM head and the norms stay in the model's dtype, as in every FP8 checkpoint.

Read from a config.json's `quantization_config`:
- `quant_method: fp8` with `weight_block_size: [128, 128]` (DeepSeek-V3, Qwen3-*-FP8): FP8 weights
  with block scales named `weight_scale_inv` (the factor that dequantizes, despite its name);
- `quant_method: fp8` without blocks (vLLM's own FP8 checkpoints): one `weight_scale` per tensor;
- `quant_method: compressed-tensors` with 8-bit float weights (llm-compressor's FP8 checkpoints,
  RedHatAI/*-FP8 and *-FP8-dynamic): `weight_scale` per tensor, per channel or per block.
A per-tensor scale is held per channel (the q, k and v tensors packed into one weight each keep
theirs). Static input scales (`input_scale`) are not used: inputs are quantized per token on the
fly. `--quantization fp8` quantizes a 16-bit checkpoint (or dummy weights) per channel as it loads.

4-bit (Int4Format; engine/int4.py turns each layout into the engine's, kernels/int4.py multiplies):
- `quant_method: awq` (AutoAWQ's GEMM layout: Qwen2.5-*-AWQ and most AWQ checkpoints);
- `quant_method: gptq` (AutoGPTQ, GPTQModel, optimum; Qwen2.5-*-GPTQ-Int4). With act-order
  (`desc_act`) a group's input columns are scattered (`g_idx`): the loader sorts each weight's
  columns by group (`weight_perm`) and x's columns come in the same order, so the kernels see
  contiguous groups as without it: written so by the RMSNorm before q/k/v and gate/up, by gate/up's
  reordered rows before down, and gathered before o (LlamaForCausalLM.fold_act_orders). Under
  tensor parallelism the ranks hold down's columns by group (gate/up's rows chosen to match) and
  o's as wide as the whole weight, zeros where another rank holds a group's columns
  (engine/parallel/layers.py _weight);
- `quant_method: compressed-tensors` with 4-bit integer weights in groups, symmetric (llm-compressor's
  W4A16, RedHatAI/*-quantized.w4a16), its groups in activation order (`actorder: group`,
  `weight_g_idx`) as GPTQ's desc_act.
Each holds, per projection, the 4-bit values packed eight to an int32 along K, a scale and a zero
point per group of `group` input columns and output row: w = (q - zero) * scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# kernels/reference.py's FP8 constants (this module stays importable without torch, for config.py)
FP8_GROUP = 128
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
QUANTIZATION_METHODS = ("fp8",)
INT4_PACK = 8  # 4-bit values per int32
# checkpoint tensors of an FP8 model that the engine does not read: static input scales (inputs are
# quantized per token) and KV-cache scales (the cache computes its own, kvcache/quant.py)
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


class QuantizationError(ValueError):
    """A quantized checkpoint the engine can't read; the message says why."""


@dataclass(frozen=True)
class Fp8Format:
    blocked: bool  # 128 x 128 block scales, else per output channel
    scale_name: str  # the checkpoint's scale tensor beside each weight; "" = quantized at load

    @property
    def at_load(self) -> bool:
        return not self.scale_name

    label = "FP8"

    @property
    def bytes_per_weight(self) -> float:
        return 1.0  # the float32 scales (one a row or 128 x 128 block) left out


AT_LOAD = Fp8Format(blocked=False, scale_name="")


@dataclass(frozen=True)
class Int4Format:
    """A 4-bit checkpoint's layout: method "awq" (qweight [K, N/8] packed along N in AWQ's order,
    qzeros [K/G, N/8] alike, scales [K/G, N]), "gptq" (qweight [K/8, N] packed along K, qzeros
    [K/G, N/8] holding zero - 1 unless gptq_v2, scales [K/G, N], g_idx [K]) or "compressed-tensors"
    (weight_packed [N, K/8] packed along K, values + 8, weight_scale [N, K/G])."""
    method: str
    group: int  # input columns a scale covers; -1: the whole row
    zero_minus_one: bool = False  # GPTQ's v1 checkpoints store each zero point less one
    act_order: bool = False  # GPTQ's desc_act, compressed-tensors' actorder "group": groups by a group index
    label = "4-bit"

    @property
    def bytes_per_weight(self) -> float:
        g = self.group if self.group > 0 else 4096  # one group a row: counted as a row of 4,096
        return 0.5 + 3.0 / g  # a float16 scale and a uint8 zero a group

    @property
    def group_index_name(self) -> str:
        """The suffix of each projection's group index (act_order)."""
        return "weight_g_idx" if self.method == "compressed-tensors" else "g_idx"

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint's tensors of one projection, by suffix, in the order engine/int4.py maps
        them: the packed values, the scales, the zero points (or "" where there are none)."""
        if self.method == "compressed-tensors":
            return "weight_packed", "weight_scale", ""
        return "qweight", "scales", "qzeros"


WeightFormat = Fp8Format | Int4Format


def checkpoint_format(cfg: dict[str, Any]) -> WeightFormat | None:
    """config.json's quantization_config -> its format, None for a 16-bit checkpoint; a method
    or layout the engine does not read is a QuantizationError that names it."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is not None and list(block) != [FP8_GROUP, FP8_GROUP]:
            raise QuantizationError(f"FP8 blocks of {block} are not supported (128 x 128 are)")
        _check_skipped(q.get("modules_to_not_convert") or q.get("ignored_layers") or [])
        return Fp8Format(blocked=block is not None, scale_name="weight_scale_inv" if block else "weight_scale")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method in ("awq", "gptq"):
        return _int4(q, method)
    raise QuantizationError(f"checkpoints quantized with {method!r} are not supported; pagedserve reads FP8 "
                            "(quant_method fp8 or compressed-tensors), AWQ and GPTQ 4-bit checkpoints and "
                            "quantizes 16-bit ones with --quantization fp8")


def _int4(q: dict[str, Any], method: str) -> Int4Format:
    bits = q.get("bits", q.get("w_bit"))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if bits != 4:
        raise QuantizationError(f"{method.upper()} checkpoints of {bits} bits are not supported (4 bits are)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"AWQ checkpoints of version {version!r} are not supported (gemm is)")
        if not q.get("zero_point", True):
            raise QuantizationError("AWQ checkpoints without zero points are not supported")
        _check_skipped(q.get("modules_to_not_convert") or [])
    else:
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)")
        _check_skipped(q.get("modules_to_not_convert") or [])
        return Int4Format("gptq", _group(group), zero_minus_one=fmt == "gptq", act_order=bool(q.get("desc_act")))
    return Int4Format("awq", _group(group))


def _group(group: int) -> int:
    if group != -1 and (group < 16 or group & (group - 1)):
        raise QuantizationError(f"4-bit groups of {group} columns are not supported (a power of two from 16, or "
                                "-1, are)")
    return group


def _compressed_tensors(q: dict[str, Any]) -> Fp8Format:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors checkpoints with {len(groups)} quantization groups are not "
                                "supported (one FP8 group is)")
    w = groups[0].get("weights") or {}
    if w.get("type") == "int" and w.get("num_bits") == 4:
        return _compressed_tensors_int4(q, w)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise QuantizationError(f"compressed-tensors weights of {w.get('num_bits')}-bit {w.get('type')} are not "
                                "supported (8-bit float, FP8, and 4-bit int are)")
    strategy = w.get("strategy")
    if strategy == "block" and list(w.get("block_structure") or []) != [FP8_GROUP, FP8_GROUP]:
        raise QuantizationError(f"FP8 blocks of {w.get('block_structure')} are not supported (128 x 128 are)")
    if strategy not in ("tensor", "channel", "block"):
        raise QuantizationError(f"compressed-tensors FP8 weights scaled per {strategy!r} are not supported "
                                "(per tensor, channel or 128 x 128 block are)")
    _check_skipped(q.get("ignore") or [])
    return Fp8Format(blocked=strategy == "block", scale_name="weight_scale")


def _compressed_tensors_int4(q: dict[str, Any], w: dict[str, Any]) -> Int4Format:
    fmt = q.get("format")
    if fmt not in (None, "pack-quantized"):
        raise QuantizationError(f"compressed-tensors 4-bit weights in format {fmt!r} are not supported "
                                "(pack-quantized is)")
    if not w.get("symmetric", True):
        raise QuantizationError("compressed-tensors 4-bit weights with zero points (asymmetric) are not supported; "
                                "symmetric ones are")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = _group(int(w.get("group_size") or 0))
    else:
        raise QuantizationError(f"compressed-tensors 4-bit weights scaled per {strategy!r} are not supported "
                                "(per group or channel are)")
    actorder = w.get("actorder") or "static"
    if actorder not in ("static", "weight", "group"):
        raise QuantizationError(f"compressed-tensors 4-bit weights with actorder {actorder!r} are not supported "
                                "(static, weight and group are)")
    _check_skipped(q.get("ignore") or [])
    return Int4Format("compressed-tensors", group, act_order=actorder == "group")


def _check_skipped(names: list[str]) -> None:
    kept = [n for n in names if not n.split(".")[-1] == "lm_head" and n != "re:.*lm_head"]
    if kept:
        raise QuantizationError(f"checkpoints with layers left unquantized ({kept[:3]}) are not supported; "
                                "only the LM head may be")


def quantize_weight(w: "torch.Tensor", blocked: bool) -> tuple["torch.Tensor", "torch.Tensor"]:
    """A 16/32-bit weight [N, K] -> (FP8 values, float32 scales [N, 1] or [ceil(N/128), ceil(K/128)]):
    each channel's or block's largest magnitude maps to 448."""
    import torch

    from kernels.reference import quantize_fp8

    N, K = w.shape
    if not blocked:  # each row as the kernels quantize an input row
        return quantize_fp8(w, K)
    wf = w.float()
    nb, kb = -(-N // FP8_GROUP), -(-K // FP8_GROUP)
    padded = torch.nn.functional.pad(wf, (0, kb * FP8_GROUP - K, 0, nb * FP8_GROUP - N))
    blocks = padded.view(nb, FP8_GROUP, kb, FP8_GROUP)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * FP8_GROUP, kb * FP8_GROUP)[:N, :K].contiguous(), scale


def scale_shape(rows: int, cols: int, blocked: bool, whole_blocks: bool = True) -> tuple[int, int]:
    """A weight's scales as the engine holds them: [rows, 1] per channel; blocks [ceil(rows/128),
    ceil(cols/128)], or with whole_blocks False one row of block scales per weight row [rows,
    ceil(cols/128)] (kernels/fp8.py reads all three)."""
    if not blocked:
        return rows, 1
    return (-(-rows // FP8_GROUP) if whole_blocks else rows), -(-cols // FP8_GROUP)


def blocks_align(segments) -> bool:
    """Whether a rank's packed output segments (engine/parallel/layers.py Segment) keep the
    checkpoint's 128-row blocks whole: each starts on a block, and all but a tensor's last block
    are full."""
    for i, seg in enumerate(segments):
        ends_tensor = seg.start + seg.length == seg.global_size
        if seg.start % FP8_GROUP or (seg.length % FP8_GROUP and (i < len(segments) - 1 or not ends_tensor)):
            return False
    return True
