"""Tensor-parallel layers and weight shards against the unsharded model: the shard arithmetic on
its own, then two gloo ranks on the CPU whose sharded model (loaded from a checkpoint, or dummy
weights) must give the logits of the whole model, and whose every shard is the whole weight's slice."""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

from engine.parallel.layers import Segment, Shard, head_split, vocab_split
from tests.engine.ranks import run_ranks


def test_head_split_even_and_replicated():
    assert [head_split(8, 4, r, 2) for r in range(2)] == [Segment(32, 0, 16), Segment(32, 16, 16)]
    # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1 (where their Q heads attend)
    assert [head_split(2, 4, r, 4).start for r in range(4)] == [0, 0, 4, 4]
    assert head_split(1, 4, 1, 2) == Segment(4, 0, 4)


def test_vocab_split_pads_the_last_rank():
    parts = [vocab_split(10, r, 3) for r in range(3)]
    assert [p[0] for p in parts] == [Segment(10, 0, 4), Segment(10, 4, 4), Segment(10, 8, 2)]
    assert {p[1] for p in parts} == {4}


def test_shard_take_keeps_packed_segments_apart():
    full = torch.arange(12).view(12, 1)  # q (8 rows) | k (2) | v (2)
    shard = Shard(0, (Segment(8, 4, 4), Segment(2, 0, 2), Segment(2, 0, 2)))
    assert shard.take(full).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard.local_offset(2) == 6 and shard.global_size == 12
    cols = Shard(1, (Segment(6, 3, 3),))
    assert cols.take(torch.arange(12).view(2, 6)).tolist() == [[3, 4, 5], [9, 10, 11]]


# -- two ranks --------------------------------------------------------------------------------

def _rank_main(rank: int, port: int, errors, folder: str, vocab: int | None) -> None:
    try:
        _check_rank(rank, port, Path(folder), vocab)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1)


def _model(cfg, comm, folder: Path | None):
    from engine.loader import init_dummy_weights, load_weights
    from engine.models.llama import LlamaForCausalLM, rope_cos_sin

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, comm)
    model = model.to_empty(device="cpu").float()
    if folder is None:
        init_dummy_weights(model, seed=3)
    else:
        load_weights(model, folder, show_progress=False)
    model.cos_sin = rope_cos_sin(cfg, 64, "cpu")
    return model.eval()


def _forward(model, n: int = 9, gather: bool = True) -> torch.Tensor:
    """A prefill of n tokens over a fresh pool -> logits of every position (this rank's part of
    the vocabulary without gather)."""
    from engine.attention import AttnMetadata, reference_ops
    from kvcache.pool import KVPool
    from kvcache.spec import KVCacheSpec

    cfg = model.cfg
    pool = KVPool(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32"), 2, "cpu")
    ids = torch.arange(n, dtype=torch.int64) * 7 % model.global_cfg.vocab_size
    meta = AttnMetadata(torch.arange(n), torch.tensor([[0]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        torch.tensor([0, n], dtype=torch.int32), num_decode=0, max_query_len=n)
    with torch.inference_mode():
        return model(reference_ops(), ids, torch.arange(n), pool.layers, meta, torch.arange(n), gather=gather)


def _check_rank(rank: int, port: int, folder: Path, vocab: int | None) -> None:
    import dataclasses

    from engine.config import ModelConfig
    from engine.parallel.comm import Comm
    from engine.parallel.group import connect_store, destroy_group, init_group, rank_env

    torch.set_num_threads(1)
    cfg = ModelConfig.from_path(folder)
    dummy = vocab is not None
    if dummy:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)  # a vocabulary that does not divide by 2
    env = rank_env("127.0.0.1", port, rank, 2)
    group = init_group(env, "cpu", store=connect_store(env))
    try:
        whole = _model(cfg, None, None if dummy else folder)
        part = _model(cfg, Comm(group), None if dummy else folder)
        assert part.cfg.num_heads == cfg.num_heads // 2
        shards = part.param_shards()
        mine = dict(part.named_parameters())
        for name, p in whole.named_parameters():
            shard = shards.get(name)
            want = p if shard is None else shard.take(p)
            got = mine[name] if shard is None else mine[name].narrow(shard.dim, 0, shard.local_size)
            assert torch.equal(got, want), name
            if shard is not None and shard.local_size < mine[name].shape[shard.dim]:
                assert not mine[name][shard.local_size:].any(), f"{name}: padding rows not zero"
        ref, got = _forward(whole), _forward(part)
        assert got.shape == ref.shape == (9, cfg.vocab_size)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # greedy tokens from each rank's part of the vocabulary (the decode graphs' way), by the
        # reference and by the Triton kernel: the whole row's argmax on both ranks
        local = _forward(part, gather=False)
        assert local.shape == (9, -(-cfg.vocab_size // 2))
        assert torch.equal(part.gather_logits(local), got)
        from engine.attention import reference_ops
        from kernels import argmax

        for ops in (reference_ops(), dataclasses.replace(reference_ops(), argmax_keys=argmax.argmax_keys)):
            tokens = torch.full((9,), -1, dtype=torch.int64)
            assert part.greedy_tokens(ops, local, tokens) is tokens
            assert tokens.tolist() == torch.argmax(got, dim=-1).tolist()
    finally:
        destroy_group(group)


def _run_two_ranks(folder: Path, vocab: int | None) -> None:
    run_ranks(_rank_main, (str(folder), vocab), timeout_s=120)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_load_their_shards_and_match_the_whole_model(tiny_models, arch):
    """Loaded from the checkpoint: GQA + tied embeddings (llama), one KV head replicated on both
    ranks and qkv bias (qwen2), q/k norms and head_dim != hidden / heads (qwen3)."""
    _run_two_ranks(tiny_models[arch], None)


def test_two_ranks_of_dummy_weights_are_one_model(tiny_models):
    """Dummy weights: each rank's shard of the same seeded model, a vocabulary padded on rank 1."""
    _run_two_ranks(tiny_models["qwen3"], 383)


def test_a_rank_past_the_end_of_the_vocabulary_loses_every_row():
    """A vocabulary smaller than the ranks' rows leaves the last rank none of it: its keys must lose
    to every key of the others, negative logits included (a stand-in group of two: the other rank's
    keys are the first rank's)."""
    from engine.attention import reference_ops
    from engine.parallel.layers import vocab_argmax
    from kernels.reference import argmax_keys

    logits = -torch.rand(3, 4) - 1  # every row's best is negative
    logits[1, 2] = 5.0

    class OtherRank:
        size = 2

        def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
            return torch.maximum(t, argmax_keys(logits, 0))

    out = torch.full((3,), -1, dtype=torch.int64)
    vocab_argmax(reference_ops(), torch.zeros(3, 2), OtherRank(), 4, 0, out)
    assert out.tolist() == torch.argmax(logits, dim=-1).tolist()
