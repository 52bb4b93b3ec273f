"""ModelRunner: Batch -> input tensors + attention metadata -> logits -> sampled tokens.

Implements the scheduler's Executor protocol. Holds the model, the KV pool and the op set.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.attention import AttnMetadata, Ops, reference_ops
from engine.config import ModelConfig
from engine.loader import init_dummy_weights, load_weights
from engine.models.llama import LlamaForCausalLM, rope_cos_sin
from engine.sampler import SamplingBatch, sample
from kvcache.calc import kv_cache_bytes
from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec, resolve_kv_dtype
from scheduler.request import Batch, SampleOutput
from serve.config import EngineConfig

log = logging.getLogger("pagedserve")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_cfg: ModelConfig, device: torch.device) -> str:
    """auto: the checkpoint's dtype on a GPU; float32 on the CPU, where half precision is slow."""
    if dtype != "auto":
        return dtype
    return model_cfg.torch_dtype if device.type == "cuda" else "float32"


def select_ops(device: torch.device) -> Ops:
    if device.type == "cuda":
        try:
            from engine.triton_ops import triton_ops
        except ImportError:
            return reference_ops()
        return triton_ops()
    return reference_ops()


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig,
                 max_model_len: int, show_progress: bool = True) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype_name = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.max_model_len = max_model_len
        self.ops = select_ops(self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)

        with torch.device("meta"):
            model = LlamaForCausalLM(model_cfg)
        model = model.to_empty(device=self.device).to(self.dtype)
        if cfg.load_format == "dummy":
            init_dummy_weights(model, cfg.seed)
        else:
            assert model_path is not None
            load_weights(model, model_path, show_progress)
        model.cos_sin = rope_cos_sin(model_cfg, max_model_len, self.device)
        self.model = model.eval()

        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype_name)
        self.kv_spec = KVCacheSpec(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                   cfg.block_size, kv_dtype)
        self.num_blocks = cfg.num_kv_blocks or self._auto_num_blocks()
        self.pool = KVPool(self.kv_spec, self.num_blocks, self.device)

    def _auto_num_blocks(self) -> int:
        if self.device.type != "cuda":
            return max(1, self.kv_spec.num_blocks_for(self.cfg.cpu_kv_cache_gib * 2**30))
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)  # CUDA context, other processes
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        self.activation_bytes = torch.cuda.max_memory_allocated(self.device) - weights + max(0, outside_torch)
        self.weight_bytes = weights
        kv_bytes = kv_cache_bytes(total, self.cfg.gpu_memory_utilization, weights, self.activation_bytes,
                                  self.graph_bytes_reserved())
        blocks = self.kv_spec.num_blocks_for(kv_bytes)
        if blocks < 1:
            raise ValueError("no GPU memory is left for the KV cache after the weights and activations; "
                             "raise --gpu-memory-utilization or lower --max-num-batched-tokens")
        return blocks

    def graph_bytes_reserved(self) -> int:
        """GPU memory set aside for CUDA-graph capture (0 until graphs are enabled)."""
        return 0

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens tokens, writing nowhere, to measure activation peak."""
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        spec = self.kv_spec
        pool = KVPool(spec, 1, self.device)
        meta = AttnMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([min(n, spec.block_size)], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            num_decode=0, max_query_len=n)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.model(self.ops, ids, pos, pool.layers, meta, torch.arange(min(n, self.cfg.max_num_seqs), device=self.device))
        torch.cuda.synchronize(self.device)
        del pool

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, torch.Tensor, SamplingBatch]:
        bs = self.kv_spec.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logit_idx: list[int] = []
        params, out_pos = [], []
        max_blocks = max(len(it.seq.block_table) for it in batch.items)
        tables = []
        for it in batch.items:
            seq, s, e = it.seq, it.start, it.end
            ids.extend(seq.token_ids[s:e])
            positions.extend(range(s, e))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(s, e))
            qsl.append(qsl[-1] + it.num_new_tokens)
            seq_lens.append(e)
            tables.append(table + [0] * (max_blocks - len(table)))
            if it.samples:
                logit_idx.append(qsl[-1] - 1)
                params.append(seq.params)
                out_pos.append(seq.num_output_tokens)
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = AttnMetadata(
            slot_mapping=t(slots, torch.int64),
            block_tables=t(tables, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            query_start_loc=t(qsl, torch.int32),
            num_decode=batch.num_decode,
            max_query_len=max(it.num_new_tokens for it in batch.items),
        )
        return t(ids, torch.int64), t(positions, torch.int64), meta, t(logit_idx, torch.int64), SamplingBatch(params, out_pos)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[SampleOutput | None]:
        input_ids, positions, meta, logit_idx, sbatch = self.prepare(batch)
        outputs: list[SampleOutput | None] = [None] * len(batch.items)
        logits = self.model(self.ops, input_ids, positions, self.pool.layers, meta, logit_idx)
        if not sbatch.params:
            return outputs
        tokens, logprobs = sample(logits, sbatch, self.generator)
        j = 0
        for i, it in enumerate(batch.items):
            if it.samples:
                outputs[i] = SampleOutput(tokens[j], logprobs[j])
                j += 1
        return outputs
