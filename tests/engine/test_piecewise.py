"""Piecewise graphs (engine/piecewise.py) on the CPU: the pieces replayed in order, with attention
between them, compute what the model's forward computes. CUDA capture itself is tested on the GPU
(tests/engine/test_gpu.py); here each "graph" runs its piece directly."""
from __future__ import annotations

import pytest
import torch

from engine.piecewise import PiecewiseGraphs, piecewise_buckets
from scheduler.request import Batch, ScheduledSeq, SamplingParams, Sequence
from serve import LLM


class _Direct:
    def __init__(self, fn) -> None:
        self.replay = fn


def _direct_pieces(runner, max_tokens: int) -> PiecewiseGraphs:
    pw = PiecewiseGraphs(runner.model, runner.ops, runner.pool.layers, max_tokens, runner.device)
    for t in pw.buckets:
        pw.graphs[t] = [_Direct(lambda i=i, t=t: pw._piece(i, t)) for i in range(len(runner.model.layers) + 1)]
    return pw


def test_buckets_cover_every_step_size():
    b = piecewise_buckets(8192)
    assert b[0] == 16 and b[-1] == 8192 and b == sorted(set(b))
    assert all(y - x <= 256 for x, y in zip(b, b[1:]))
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(1000) == [16, 32, 64, 128, 256, 384, 512, 768, 1000]


def _batch(block_size: int) -> Batch:
    """Two decodes (contexts 21 and 9) and two prefill chunks (one after a 16-token cached prefix)."""
    p = SamplingParams(max_tokens=4, temperature=0)
    items = []
    for n_ctx, start, n_new, table in ((21, 20, 1, [0, 1]), (9, 8, 1, [2]), (40, 16, 24, [3, 4, 5]), (7, 0, 7, [6])):
        seq = Sequence(1000 + len(items), list(range(3, 3 + n_ctx)), p)
        seq.block_table = table
        items.append(ScheduledSeq(seq, start, n_new))
    return Batch(items, num_decode=2)


@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("qwen2", "auto"), ("qwen3", "auto"), ("llama", "fp8")])
@torch.inference_mode()
def test_pieces_compute_the_forward(tiny_models, arch, kv):
    runner = LLM(str(tiny_models[arch]), dtype="float32", device="cpu", num_kv_blocks=16,
                 kv_cache_dtype=kv).engine.runner
    torch.manual_seed(0)
    runner.pool.kv.copy_(torch.randn_like(runner.pool.kv.float()).to(runner.pool.kv.dtype))
    if runner.pool.scales is not None:
        runner.pool.scales.uniform_(0.01, 0.02)
    batch = _batch(runner.kv_spec.block_size)
    input_ids, positions, meta, logit_idx, _, _ = runner.prepare(batch)
    kv_before = runner.pool.kv.clone()

    want = runner.model(runner.ops, input_ids, positions, runner.pool.layers, meta, logit_idx)
    kv_want = runner.pool.kv.clone()
    runner.pool.kv.copy_(kv_before)

    pw = _direct_pieces(runner, 64)  # 33 tokens run in the 64-row bucket: 31 rows of padding
    pw.buf.input_ids.fill_(5)
    pw.buf.slot_mapping[:].fill_(3)  # stale slots from a bigger step: run() must reset the padding to -1
    got = pw.run(input_ids, positions, meta, logit_idx)
    assert batch.num_tokens == 33 and pw.bucket_for(33) == 64
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(runner.pool.kv, kv_want)  # the same slots written, the padding nowhere
