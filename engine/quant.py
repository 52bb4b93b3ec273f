"""FP8 weights: which checkpoint formats the engine reads, and the quantization of 16-bit weights.

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


AT_LOAD = Fp8Format(blocked=False, scale_name="")


def checkpoint_format(cfg: dict[str, Any]) -> Fp8Format | None:
    """config.json's quantization_config -> its Fp8Format, None for a 16-bit checkpoint; a method
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
    raise QuantizationError(f"checkpoints quantized with {method!r} are not supported; pagedserve reads FP8 "
                            "checkpoints (quant_method fp8 or compressed-tensors) and quantizes 16-bit ones "
                            "with --quantization fp8")


def _compressed_tensors(q: dict[str, Any]) -> Fp8Format:
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors checkpoints with {len(groups)} quantization groups are not "
                                "supported (one FP8 group is)")
    w = groups[0].get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise QuantizationError(f"compressed-tensors weights of {w.get('num_bits')}-bit {w.get('type')} are not "
                                "supported (8-bit float, FP8, is)")
    strategy = w.get("strategy")
    if strategy == "block" and list(w.get("block_structure") or []) != [FP8_GROUP, FP8_GROUP]:
        raise QuantizationError(f"FP8 blocks of {w.get('block_structure')} are not supported (128 x 128 are)")
    if strategy not in ("tensor", "channel", "block"):
        raise QuantizationError(f"compressed-tensors FP8 weights scaled per {strategy!r} are not supported "
                                "(per tensor, channel or 128 x 128 block are)")
    _check_skipped(q.get("ignore") or [])
    return Fp8Format(blocked=strategy == "block", scale_name="weight_scale")


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
