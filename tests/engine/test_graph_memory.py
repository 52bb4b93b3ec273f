"""NCCL's memory for the collectives CUDA graphs capture (engine/parallel/graph_memory.py), and
`serve kv-calc` setting it aside as the engine does."""
from __future__ import annotations

import argparse

from engine.cuda_graph import graph_buckets
from engine.parallel.graph_memory import NCCL_BYTES_PER_CAPTURE, forward_collectives, nccl_captures
from engine.parallel.peer_allreduce import FUSED_MAX_BYTES, ONE_SHOT_MAX_BYTES
from engine.piecewise import piecewise_buckets
from engine.step_graph import step_buckets, step_rows, step_shapes
from kvcache import calc
from serve import kv_calc_cmd as cmd


def test_a_forward_has_two_all_reduces_a_layer_the_embeddings_and_the_greedy_keys():
    assert forward_collectives(32, True, True) == (65, 0, 1)  # the embedding's sum with layer 0's norm
    assert forward_collectives(16, False, True) == (32, 0, 1)  # a later pipeline stage: no embedding
    # no LM head before the last stage; its last MLP output is summed into the carry without a norm
    assert forward_collectives(16, True, False) == (32, 1, 0)


def test_the_peer_kernels_take_their_messages_out_of_nccl():
    row = 8192  # bytes a row: 4,096 bf16 values
    every = nccl_captures([1, 64, 256], [512], row, 32, True, True, 0, 0)
    assert every == 3 * (65 + 1) + 65
    # up to 64 rows (512 KiB) the all-reduces go peer to peer; the greedy keys' stays NCCL's
    assert nccl_captures([1, 64, 256], [512], row, 32, True, True, 64 * row, 64 * row) == 3 + 65 + 65
    # the fused kernel up to 512 rows (the embedding's sum is fused with layer 0's norm)
    assert nccl_captures([1, 64, 256], [512], row, 32, True, True, 64 * row, 512 * row) == 3
    # a stage before the last: its carry's sum is the one-shot's
    assert nccl_captures([64, 256], [], row, 16, True, False, 64 * row, 512 * row) == 1
    assert nccl_captures([], [], row, 32, True, True, 0, 0) == 0


def test_step_shapes_pair_each_row_count_with_the_buckets_that_hold_it():
    assert step_rows(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256] and step_rows(200)[-1] == 256 and step_rows(1) == [1]
    assert step_shapes(4, [2, 16]) == [(1, 2), (2, 2), (1, 16), (2, 16), (4, 16)]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_kv_calc_sets_nccls_memory_aside_under_tensor_parallelism_only():
    one = cmd.read_request(parse("--model", "llama3-70b", "--gpu-memory", "H100", "-pp", "2"))
    assert cmd.nccl_graph_bytes(one, "bfloat16", cmd.GraphTokens(768, 0)) == 0  # no TP group: no NCCL in the graphs
    for model, tp, layers, hidden in (("llama3-70b", 2, 80, 8192), ("llama3-8b", 4, 32, 4096)):
        req = cmd.read_request(parse("--model", model, "--gpu-memory", "H100", "-tp", str(tp)))
        tokens = cmd.graph_tokens(req, "bfloat16", 8192)
        prefill = piecewise_buckets(tokens.piecewise, fine_above=tokens.step)
        if tokens.step:
            prefill += [t for _, t in step_shapes(256, step_buckets(tokens.step))]
        expected = NCCL_BYTES_PER_CAPTURE * nccl_captures(graph_buckets(256), prefill, hidden * 2, layers, True, True,
                                                          ONE_SHOT_MAX_BYTES[tp], FUSED_MAX_BYTES.get(tp, 0))
        assert cmd.nccl_graph_bytes(req, "bfloat16", tokens) == expected
        # with the fused kernel (2 ranks) only the greedy keys' all-reduces and the largest steps' sums are NCCL's
        assert (expected < 10**7) == (tp in FUSED_MAX_BYTES) and expected > 10**6
        m = req.model  # the plan's graph reserve: the activations' estimates, NCCL's share, the fused kernel's rows
        step = calc.estimate_step_graph_bytes(256, 8192, 16, tokens.step) if tokens.step else 0
        assert cmd.plan_request(req).graph_bytes == (
            calc.estimate_graph_bytes(m, "bfloat16", 256, 8192, 16, tp)
            + calc.estimate_piecewise_graph_bytes(m, "bfloat16", tokens.piecewise, tp) + step + expected
            + ((2 * 16 + 2 * 2) << 20 if tp == 2 else 0))  # two halves of 16 MiB read, two of 2 MiB pushed
