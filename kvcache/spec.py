"""KVCacheSpec: the one sizing formula for the engine, the calculator and the docs.

Page layout (kvcache/pool.py): per layer, K and V pages of shape
[num_blocks, num_kv_heads, block_size, head_dim] in the storage dtype. Quantized caches
(fp8, int8) also keep one float32 scale per token and KV head for K and for V, a page's side by
side: [num_blocks, num_kv_heads, 2, block_size] (kvcache/quant.py states the convention).

bytes per token = num_layers * 2 (K and V) * num_kv_heads * (head_dim * element bytes + scale bytes)
"""
from __future__ import annotations

from dataclasses import dataclass

# Storage dtype name -> bytes per element. "auto" is resolved to the model dtype before use.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # weights and activations
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
QUANTIZED_KV_DTYPES = ("fp8", "int8")
SCALE_BYTES = 4  # one float32 scale per (token, kv head) for K and for V


def default_block_size(kv_dtype: str) -> int:
    """Tokens per block when none is given: 16, and 32 for fp8/int8. Decode attention reads
    quantized pages of 32 tokens ~6% faster than pages of 16 (2 KB per KV head at head_dim 128),
    while 16-bit pages read alike at 16 and 32 and keep the prefix cache's finer grain
    (H100, bench/KERNELS.md)."""
    return 32 if kv_dtype in QUANTIZED_KV_DTYPES else 16


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """Map a user's --kv-cache-dtype to a storage dtype name ("auto" follows the model)."""
    aliases = {"fp8_e4m3": "fp8", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    name = aliases.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        name = aliases.get(model_dtype, model_dtype)
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of auto, fp8, int8, bfloat16, float16, float32; got {kv_cache_dtype!r}")
    return name


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of KV_DTYPE_BYTES

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"unknown KV storage dtype {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def for_model(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: str, tensor_parallel_size: int = 1) -> "KVCacheSpec":
        """The per-GPU spec: KV heads are split across tensor-parallel ranks, and replicated
        when there are fewer KV heads than ranks (each rank then keeps one)."""
        if tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        tp = tensor_parallel_size
        if (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
            raise ValueError(f"{num_kv_heads} KV heads can't be split evenly over {tp} tensor-parallel GPUs")
        heads = max(1, num_kv_heads // tensor_parallel_size)
        return cls(num_layers, heads, head_dim, block_size, dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def element_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim * self.element_bytes + (SCALE_BYTES if self.quantized else 0)
        return self.num_layers * 2 * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_bytes: int, draft: KVCacheSpec | None = None) -> int:
        """How many whole blocks fit in kv_bytes; with a draft model's layout, each block beside one of
        the draft's (its pool has as many blocks: engine/draft.py)."""
        block_bytes = self.bytes_per_block + (draft.bytes_per_block if draft is not None else 0)
        return max(0, int(kv_bytes) // block_bytes)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
