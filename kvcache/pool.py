"""The KV pool: the GPU (or CPU) tensors behind the block manager's block ids."""
from __future__ import annotations

import math
import mmap
import os
import weakref
from dataclasses import dataclass

import torch

from kvcache import quant
from kvcache.rotation import QKRotation
from kvcache.spec import KVCacheSpec


@dataclass
class LayerCache:
    """One layer's view of the pool."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    kv_dtype: str | None  # "fp8" | "int8", or None for an unquantized cache
    rotation: QKRotation | None = None  # fp8/int8: q and k are rotated before attention (kvcache/rotation.py)

    @property
    def plain(self) -> bool:
        """Pages in the model's dtype, no q/k rotation: the rotary kernels may write k, v directly."""
        return self.kv_dtype is None and self.rotation is None


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed pages. On the CPU they come from an anonymous memory map, which the OS zero-fills a
    page at a time as it is first written: a large pool costs RAM only as the cache fills."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return mapped(mmap.mmap(-1, nbytes), dtype, shape)


def mapped(pages: mmap.mmap, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A memory map's bytes as a tensor; the tensor keeps the map alive (torch.frombuffer holds a
    reference to the buffer)."""
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, int | None]:
    """zeros() whose CPU pages another process may map too: a memory file (memfd) rather than an
    anonymous map, zero-filled alike as it is first written. Returns the tensor and, on the CPU,
    the file's descriptor, left open: a process of the same user maps the pages through
    /proc/<pid>/fd/<fd> (engine/kv_transfer.py). On a GPU, (zeros(), None)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return zeros(shape, dtype, device), None
    fd = os.memfd_create("pagedserve-kv")
    try:
        os.ftruncate(fd, nbytes)
        pages = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return mapped(pages, dtype, shape), fd


class KVPool:
    """Pages [layers, 2, num_blocks, kv_heads, block_size, head_dim] in the storage dtype (fp8/int8:
    each layer's V pages are used as [num_blocks, kv_heads, head_dim, block_size], kvcache/quant.py), plus
    float32 scales [layers, num_blocks, kv_heads, 2, block_size] for fp8/int8 (K's and V's of a
    page side by side, kvcache/quant.py), and for those the
    q/k rotation (kvcache/rotation.py) in act_dtype, the dtype of the model's q and k: built once
    here, so decode CUDA graphs capture a static tensor."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str,
                 act_dtype: torch.dtype = torch.float32) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        self.kv, kv_fd = shared_zeros(shape, quant.storage_dtype(spec.dtype), device)
        self.scales, scales_fd = None, None
        if spec.quantized:
            scale_shape = quant.scales_shape(num_blocks, spec.num_kv_heads, spec.block_size, (spec.num_layers,))
            self.scales, scales_fd = shared_zeros(scale_shape, torch.float32, device)
            self.scales.fill_(1.0)
        # the CPU pages' memory files, for a peer engine to map (disaggregation): open while the pool lives
        self.files = (kv_fd, scales_fd)
        weakref.finalize(self, _close, [fd for fd in self.files if fd is not None])
        kv_dtype = spec.dtype if spec.quantized else None
        # head_dim not a power of two (no Hadamard matrix; the Triton kernels refuse it anyway): no rotation
        pow2 = spec.head_dim & (spec.head_dim - 1) == 0
        self.rotation = QKRotation.build(spec.head_dim, device, act_dtype) if spec.quantized and pow2 else None
        v_shape = quant.v_page_shape(shape[2:], spec.quantized)
        self.layers = [
            LayerCache(self.kv[i, 0], self.kv[i, 1].view(v_shape),
                       *(quant.scale_views(self.scales[i]) if spec.quantized else (None, None)), kv_dtype, self.rotation)
            for i in range(spec.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
