"""The decode graphs' input unpacking (kernels/graph_inputs.py) against its torch reference, and
the runner's upload layout against the inputs prepare() builds for the same decode step."""
import numpy as np
import pytest
import torch

from engine.runner import Launched
from engine.sampler import DeviceSamples
from kernels import graph_inputs
from scheduler.request import Batch, SamplingParams, ScheduledSeq, Sequence
from serve import LLM
from tests.kernels.util import DEVICE


def _stage(n: int, width: int, block_size: int, num_blocks: int, n_tokens: int, gen: torch.Generator) -> torch.Tensor:
    pos = torch.randint(0, width * block_size, (n,), generator=gen)
    pend = torch.randint(-1, n_tokens, (n,), generator=gen)
    ids = torch.randint(1, 1000, (n,), generator=gen)
    tables = torch.randint(0, num_blocks, (n, width), generator=gen, dtype=torch.int32)
    head = 2 + 3 * n
    stage = torch.zeros(head + -(-n * width // 2) + 3, dtype=torch.int64)
    stage[0], stage[1] = n, width
    stage[2:head] = torch.cat([ids, pos, pend])
    stage.view(torch.int32)[2 * head:2 * head + n * width] = tables.flatten()
    return stage


def _outputs(B: int, width: int):
    return (torch.full((B,), 7, dtype=torch.int64), torch.full((B,), 7, dtype=torch.int64),
            torch.full((B,), 7, dtype=torch.int64), torch.full((B,), 7, dtype=torch.int32),
            torch.full((B, width + 3), 5, dtype=torch.int32))


@pytest.mark.parametrize("n,B,width,block_size", [(1, 1, 1, 16), (3, 8, 5, 16), (8, 8, 300, 16), (5, 16, 2, 32), (0, 4, 1, 16)])
def test_unpack_matches_reference(n, B, width, block_size):
    gen = torch.Generator().manual_seed(n * 100 + width)
    stage = _stage(n, width, block_size, 50, 10, gen)
    tokens = torch.randint(1000, 2000, (10,), generator=gen)
    expect = _outputs(B, width)
    graph_inputs.unpack_reference(stage, tokens, *expect, block_size)
    got = [t.to(DEVICE) for t in _outputs(B, width)]
    graph_inputs.unpack(stage.to(DEVICE), tokens.to(DEVICE), *got, block_size)
    for g, e in zip(got, expect):
        assert torch.equal(g.cpu(), e)
    ids, pos, slots, seq_lens, _ = expect
    assert (slots[n:] == -1).all() and (seq_lens[n:] == 1).all() and (pos[n:] == 0).all()
    pend = stage[2 + 2 * n:2 + 3 * n]
    assert torch.equal(ids[:n][pend >= 0], tokens[pend[pend >= 0]])


def test_runner_upload_matches_prepare(tiny_models):
    """The graph path's upload, unpacked, gives the decode step what prepare() gives the others:
    input ids (pending ones from the previous step's samples), positions, slots, lengths, tables."""
    runner = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=64).engine.runner
    bs = runner.kv_spec.block_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=100, temperature=0)
    items, rows = [], {}
    for i, length in enumerate([5, 17, 33, 16, 40]):
        seq = Sequence(100 + i, rng.integers(1, 200, length).tolist(), params)
        seq.block_table = rng.permutation(64)[:-(-(length + 1) // bs)].tolist()
        pending = i % 2 == 1  # its input token is still on the device, sampled by the step before
        if pending:
            seq.num_pending = 1
            rows[seq.seq_id] = 4 - i
        start = length if pending else length - 1
        items.append(ScheduledSeq(seq, start, 1))
    prev_tokens = torch.tensor([901, 902, 903, 904, 905])
    prev = Launched(DeviceSamples(prev_tokens, []), rows, [], 5)
    batch = Batch(items, len(items))
    ids, positions, meta, _, _, _ = runner.prepare(batch, prev)

    words = runner._graph_inputs(items, prev, buf := np.zeros(1000, dtype=np.int64))
    n, width = 5, int(buf[1])
    assert words <= len(buf) and width == max(len(it.seq.block_table) for it in items)
    got = _outputs(8, runner.max_blocks_per_seq)
    graph_inputs.unpack_reference(torch.from_numpy(buf[:words].copy()), prev_tokens, *got, bs)
    g_ids, g_pos, g_slots, g_lens, g_tables = got
    assert torch.equal(g_ids[:n], ids) and torch.equal(g_pos[:n], positions)
    assert torch.equal(g_slots[:n], meta.slot_mapping) and torch.equal(g_lens[:n], meta.seq_lens)
    assert torch.equal(g_tables[:n, :width], meta.block_tables[:, :width])
    assert g_ids[1] == 904 and g_ids[3] == 902  # pending rows
