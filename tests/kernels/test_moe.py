"""The fused MoE kernels (kernels/moe.py) against kernels/moe_reference.py, under TRITON_INTERPRET=1
on the CPU at tiny shapes, and at Qwen3-30B-A3B's shape on a GPU."""
import math
from dataclasses import replace

import pytest
import torch

from kernels import moe
from kernels import moe_reference as ref
from tests.kernels.util import DEVICE, REL_TOL, gpu, rel_err


def _inputs(T, H, I, E, k, dtype, seed=0, experts=None, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).to(device)
    weights, ids = ref.route(torch.randn(T, experts or E, generator=g).to(device), k, renormalize=True)
    return x, w13, w2, weights, ids


def _runs(sorted_ids, block_m):
    """Each block's assignment ids, sorted (the order within an expert's run is free)."""
    return [sorted(sorted_ids[b:b + block_m].tolist()) for b in range(0, sorted_ids.numel(), block_m)]


def test_align_sorts_by_expert_and_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert = moe.align(ids, 4, 0, 2)
    assert sorted_ids.shape == (moe.max_blocks(8, 4, 2) * 2,)
    # expert 0: assignments 1, 4; expert 1: 7 (+ pad 8); expert 2: 0, 2, 5, 6; expert 3: 3 (+ pad)
    runs = _runs(sorted_ids, 2)
    assert runs[:2] == [[1, 4], [7, 8]] and sorted(runs[2] + runs[3]) == [0, 2, 5, 6]
    assert runs[4:] == [[3, 8]] + [[8, 8]] * 3
    assert block_expert.tolist() == [0, 1, 2, 2, 3, -1, -1, -1]
    # expert parallel: experts 2, 3 here, the others' assignments get no rows
    sorted_ids, block_expert = moe.align(ids, 2, 2, 2)
    assert sorted(sorted_ids[:4].tolist()) == [0, 2, 5, 6] and sorted_ids[4:].tolist() == [3] + [8] * 7
    assert block_expert.tolist() == [0, 0, 1, -1, -1, -1]


def test_align_many_assignments():
    """More assignments than one chunk of the counting loop; every assignment lands once, in its
    expert's run."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (700, 3), generator=g, dtype=torch.int32).to(DEVICE)
    sorted_ids, block_expert = moe.align(ids, 6, 0, 16)
    flat = ids.flatten().tolist()
    real = sorted_ids[sorted_ids < 2100].tolist()
    assert sorted(real) == list(range(2100))
    for b, e in enumerate(block_expert.tolist()):
        rows = [r for r in sorted_ids[b * 16:(b + 1) * 16].tolist() if r < 2100]
        assert all(flat[r] == e for r in rows) and (e >= 0 or not rows)


def test_align_many_programs_and_expert_parallel():
    """Counts over several programs (3,000 assignments, 1,024 a program), block experts over
    several (130 experts: 32 blocks a program), a rank's experts 20..119 only: each local
    assignment lands once, in its expert's run; runs start on a block, in expert order; the rest
    is padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 130, (1000, 3), generator=g, dtype=torch.int32).to(DEVICE)
    n, start, local = ids.numel(), 20, 100
    sorted_ids, block_expert = moe.align(ids, local, start, 16)
    blocks = moe.max_blocks(n, local, 16)
    assert block_expert.numel() == blocks > 32 and sorted_ids.numel() == blocks * 16
    flat = ids.flatten().tolist()
    mine = [a for a in range(n) if start <= flat[a] < start + local]
    assert sorted(r for r in sorted_ids.tolist() if r < n) == mine
    assert all(r == n for r in sorted_ids.tolist() if r >= n)
    experts = block_expert.tolist()
    used = [e for e in experts if e >= 0]
    assert used == sorted(used) and experts[len(used):] == [-1] * (blocks - len(used))
    for b, e in enumerate(experts):
        rows = [r for r in sorted_ids[b * 16:(b + 1) * 16].tolist() if r < n]
        assert all(flat[r] == start + e for r in rows) and (e >= 0 or not rows)
    e_local = ids.flatten().long().cpu() - start
    counts = torch.bincount(e_local[(e_local >= 0) & (e_local < local)], minlength=local)
    assert used == [e for e in range(local) for _ in range(-(-int(counts[e]) // 16))]


def test_sum_rows():
    rows = torch.randn(12, 40).to(torch.float16).to(DEVICE)
    want = rows.view(4, 3, 40).float().sum(dim=1).to(torch.float16)
    assert torch.equal(moe.sum_rows(rows, 3), want)


@pytest.mark.parametrize("T, H, I, E, k, plan", [
    (3, 64, 32, 8, 2, moe.Plan(16, 16, 32, 1, 1)),  # decode: a row or two per expert, most experts idle
    (29, 48, 40, 4, 3, moe.Plan(32, 32, 16, 1, 1)),  # prefill-like: runs over several blocks, ragged tiles
])
def test_fused_moe_matches_reference(T, H, I, E, k, plan):
    x, w13, w2, weights, ids = _inputs(T, H, I, E, k, torch.float32, seed=T)
    got = moe.fused_moe(x, w13, w2, weights, ids, p=plan)
    assert got.shape == (T, H) and got.dtype == x.dtype
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float32]


# (group_m, tma, fuse_gate_up): every program order, weight load and gate/up form
OPTIONS = [(0, False, True), (0, True, False), (0, True, True), (1, False, False), (5, True, True), (5, False, True)]


@pytest.mark.parametrize("group_m, tma, fused", OPTIONS, ids=lambda o: str(o))
def test_fused_moe_plan_options(group_m, tma, fused):
    """Each option against the reference where the tiles are ragged: I = 40 over 32-column tiles
    (the TMA gate tile runs into the up rows, the fused one past I), H = 48 over 32 (the last K
    step half out), row blocks 5.. with rows (group_m = 5: a partial last group that has work);
    the down kernel with tiles of its own."""
    x, w13, w2, weights, ids = _inputs(29, 48, 40, 4, 3, torch.float32, seed=11)
    assert moe._stacked_tma(w13) and moe._stacked_tma(w2)  # the TMA path is the one taken
    _, block_expert = moe.align(ids, 4, 0, 16)
    assert block_expert.numel() == 9 and (block_expert[5:] >= 0).any()
    p = moe.Plan(16, 32, 32, 1, 1, group_m, tma, fused, moe.Tiles(16, 16, 1, 1, group_m, tma))
    got = moe.fused_moe(x, w13, w2, weights, ids, p=p)
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("fused", [False, True])
def test_fused_moe_tma_float16_and_decode(fused):
    """16-bit TMA loads at a decode-like batch (most experts idle, one row each), then rows whose
    stride TMA cannot take (H = 36 and I = 20 halves: 72 and 40 bytes), which fall back to pointer
    loads."""
    x, w13, w2, weights, ids = _inputs(5, 64, 32, 8, 2, torch.float16, seed=7)
    p = moe.Plan(16, 16, 32, 1, 1, 1, True, fused, moe.Tiles(32, 16, 1, 1, 2, True))
    assert rel_err(moe.fused_moe(x, w13, w2, weights, ids, p=p), ref.fused_moe(x, w13, w2, weights, ids)) \
        < REL_TOL[torch.float16]
    x, w13, w2, weights, ids = _inputs(6, 36, 20, 4, 2, torch.float16, seed=8)
    assert not moe._stacked_tma(w13) and not moe._stacked_tma(w2)
    assert rel_err(moe.fused_moe(x, w13, w2, weights, ids, p=p), ref.fused_moe(x, w13, w2, weights, ids)) \
        < REL_TOL[torch.float16]


def test_fused_moe_float16():
    x, w13, w2, weights, ids = _inputs(7, 32, 48, 4, 2, torch.float16, seed=3)
    got = moe.fused_moe(x, w13, w2, weights, ids, p=moe.Plan(16, 16, 16, 1, 1))
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float16]


@pytest.mark.parametrize("p", [moe.Plan(16, 16, 16, 1, 1), moe.Plan(16, 16, 16, 1, 1, 2, True, True)], ids=str)
def test_fused_moe_expert_parallel_part(p):
    """A rank holding experts 4..7 of 8 adds only their part; the two ranks' parts sum to the whole
    (also through TMA descriptors over the rank's experts only)."""
    x, w13, w2, weights, ids = _inputs(6, 32, 16, 8, 3, torch.float32, seed=5)
    parts = [moe.fused_moe(x, w13[s:s + 4], w2[s:s + 4], weights, ids, s, 8, p) for s in (0, 4)]
    assert rel_err(parts[1], ref.fused_moe(x, w13[4:], w2[4:], weights, ids, 4)) < REL_TOL[torch.float32]
    assert rel_err(parts[0] + parts[1], ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("group_m, tma, fused", OPTIONS, ids=lambda o: str(o))
def test_persistent_launch_equals_one_program_a_tile(group_m, tma, fused):
    """Persistent programs (4 on the CPU) walk the used blocks' tiles in the same order of K steps:
    the same rows bit for bit as one program a tile, at ragged tiles, and for an expert-parallel
    rank (blocks without an expert at the end)."""
    x, w13, w2, weights, ids = _inputs(29, 48, 40, 4, 3, torch.float32, seed=12)
    base = moe.Plan(16, 32, 32, 1, 1, group_m, tma, fused, moe.Tiles(16, 16, 1, 1, group_m, tma))
    p = replace(base, persistent=True, down=replace(base.down, persistent=True))
    got = moe.fused_moe(x, w13, w2, weights, ids, p=p)
    assert torch.equal(got, moe.fused_moe(x, w13, w2, weights, ids, p=base))
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float32]
    x, w13, w2, weights, ids = _inputs(6, 32, 16, 8, 3, torch.float32, seed=5)
    part = moe.fused_moe(x, w13[4:], w2[4:], weights, ids, 4, 8, p)
    assert torch.equal(part, moe.fused_moe(x, w13[4:], w2[4:], weights, ids, 4, 8, base))


def test_plans_decode_small_prefill_large():
    assert moe.plan(64, 8, 128).block_m == 16  # Qwen3-30B-A3B decode: 4 rows per expert
    assert moe.plan(1024, 8, 128).block_m == 64  # 64 rows per expert: less padding than 128
    assert moe.plan(2048, 8, 128).block_m == 128  # 128 rows per expert: 128-row tiles 570 against 608 us
    assert moe.plan(4096, 8, 128).block_m == 128  # 256 rows per expert: 5% faster on an H100
    assert moe.plan(16384, 8, 128).block_m == 128
    assert moe.max_blocks(64 * 8, 128, 16) == 32 + 128
    # the plans as measured: decode on pointer loads, the down kernel on the gate/up's tiles;
    # prefill from 32 rows an expert the sweep's best (TMA, one gate|up dot, the down's own tiles)
    assert moe.plan(64, 8, 128) == moe.Plan(16, 64, 128, 4, 4)
    assert moe.plan(64, 8, 128).down_tiles() == moe.Tiles(64, 128, 4, 4)
    for tokens in (512, 1024, 2048, 4096, 8192, 16384):  # each size its sweep's winner
        p = moe.plan(tokens, 8, 128)
        assert p.tma and p.fuse_gate_up and p.down_tiles().tma
        assert p.down_tiles().block_n == (128 if tokens <= 1024 else 256)
    assert moe.plan(2048, 8, 128).group_m == 4 and moe.plan(8192, 8, 128).down_tiles().group_m == 1
    assert moe.plan(16384, 8, 128).down_tiles() == moe.Tiles(256, 64, 8, 4, group_m=4, tma=True, persistent=True)
    # persistent launches where they measured faster: the down kernel from 2,048 tokens, gate/up at 4,096-8,192
    assert [moe.plan(t, 8, 128).down_tiles().persistent for t in (1024, 2048, 16384)] == [False, True, True]
    assert [moe.plan(t, 8, 128).persistent for t in (2048, 4096, 8192, 16384)] == [False, True, True, False]
    # float32: half the K step, the same shared memory a stage
    wide = moe.plan(16384, 8, 128, itemsize=4)
    assert wide.block_k == moe.plan(16384, 8, 128).block_k // 2 and wide.down_tiles().block_k == 32
    assert moe.plan(64, 8, 128, itemsize=4).down_tiles() == moe.Tiles(64, 64, 4, 4)


def test_plan_table():
    """plan() takes the first entry whose bound holds for the mean rows an expert; bounds rise to
    math.inf (lab/moe_gpu.py --sweep prints a table in this form)."""
    bounds = [b for b, _ in moe.PLAN_TABLE]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf
    a, b, c = moe.Plan(16, 16, 16, 1, 1), moe.Plan(32, 16, 16, 1, 1), moe.Plan(64, 16, 16, 1, 1)
    table = ((16, a), (362, b), (math.inf, c))
    assert [moe.plan(t, 8, 128, table) for t in (1, 256, 257, 5792, 5793, 10 ** 6)] == [a, a, b, b, c, c]
    assert moe.plan(100, 2, 0, table) == b  # no experts: 200 rows, as over one


def test_gate_up_and_down_kernels_alone():
    """experts() is gate_up() then down(): the sweep times them apart, the down kernel on tiles
    of its own; a compile-only call (nothing compiled under the interpreter) runs nothing."""
    x, w13, w2, weights, ids = _inputs(9, 32, 16, 4, 2, torch.float32, seed=2)
    p = moe.Plan(16, 16, 16, 1, 1, down=moe.Tiles(32, 16, 1, 1, 1, True))
    sorted_ids, block_expert = moe.align(ids, 4, 0, 16)
    act = moe.gate_up(x, w13, sorted_ids, block_expert, 2, p)
    assert act.shape == (block_expert.numel() * 16, 16)
    rows = moe.down(act, w2, sorted_ids, block_expert, weights, p)
    assert torch.equal(rows, moe.experts(x, w13, w2, weights, sorted_ids, block_expert, p))
    out = rows.view(9, 2, 32).sum(dim=1)
    assert rel_err(out, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.float32]
    assert not moe.down(act, w2, sorted_ids, block_expert, weights, p, zero_fill=True, compile_only=True).any()


@gpu
@pytest.mark.parametrize("T", [64, 4096])
def test_fused_moe_qwen3_30b_shape(T):
    x, w13, w2, weights, ids = _inputs(T, 2048, 768, 128, 8, torch.bfloat16, seed=T)
    got = moe.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < REL_TOL[torch.bfloat16]
    # both launch forms of the picked tiles give the same rows
    p = moe.plan(T, 8, 128)
    flip = replace(p, persistent=not p.persistent, down=replace(p.down_tiles(), persistent=not p.down_tiles().persistent))
    assert torch.equal(got, moe.fused_moe(x, w13, w2, weights, ids, p=flip))


@gpu
@pytest.mark.parametrize("start", [0, 4])
def test_mixtral_tp2_and_expert_parallel_shapes_persistent(start):
    """Mixtral-8x7B's experts as a rank holds them at 2 GPUs, 4,096 tokens (about 1,024 rows an
    expert: the persistent plans): tensor parallel (all 8 experts, half the width) and expert
    parallel (4 whole experts, the other rank's assignments left to it); both launch forms equal,
    and equal to the reference."""
    T, H, k = 4096, 4096, 2
    E, I = (8, 7168) if start == 0 else (4, 14336)
    x, w13, w2, weights, ids = _inputs(T, H, I, E, k, torch.bfloat16, seed=start, experts=8)
    p = moe.plan(T, k, E)
    assert p.down_tiles().persistent
    flip = replace(p, persistent=not p.persistent, down=replace(p.down_tiles(), persistent=not p.down_tiles().persistent))
    got = moe.fused_moe(x, w13, w2, weights, ids, start, 8, p)
    assert torch.equal(got, moe.fused_moe(x, w13, w2, weights, ids, start, 8, flip))
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids, start)) < REL_TOL[torch.bfloat16]
