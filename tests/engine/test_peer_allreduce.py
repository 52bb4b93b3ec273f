"""The one-shot all-reduce over peer memory: chosen only where every rank can set it up, equal to
NCCL's sum on two GPUs inside CUDA graphs (many in a row through one buffer, replayed), NCCL for
eager calls, and the engine's greedy output with it equals one GPU's. The all-reduce fused with
the residual add and RMSNorm equals NCCL's sum and the norm kernel bit for bit, calls of every
size in any order through its buffer's two halves."""
from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

from engine.parallel.peer_allreduce import ONE_SHOT_MAX_BYTES, peer_access
from tests.engine.ranks import run_ranks
from tests.engine.test_pipeline_parallel import GREEDY, make_prompts

TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_peer_access_says_why_not():
    assert peer_access(torch.device("cpu"), 2) == "not a GPU"
    unmeasured = max(ONE_SHOT_MAX_BYTES) + 1
    assert "no measured size limit" in peer_access(torch.device("cuda", 0), unmeasured)


def _rank_main(rank: int, port: int, errors, target, device_type: str, n: int) -> None:
    from engine.parallel.comm import Comm
    from engine.parallel.group import connect_store, destroy_group, init_group, rank_env

    try:
        env = rank_env("127.0.0.1", port, rank, n)
        group = init_group(env, device_type, store=connect_store(env, timeout_s=60), timeout_s=60)
        try:
            target(Comm(group))
        finally:
            destroy_group(group)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1)


def _on_cpu(comm) -> None:
    torch.set_num_threads(1)
    assert comm.use_peer_memory(torch.device("cpu")) == "not a GPU"
    assert comm.peer is None
    t = torch.full((4, 8), float(comm.rank + 1))
    assert torch.equal(comm.all_reduce(t), torch.full((4, 8), 3.0))


def test_on_the_cpu_every_rank_keeps_the_process_group():
    run_ranks(_rank_main, (_on_cpu, "cpu", 2))


def _on_gpus(comm) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", comm.group.local_rank)
    assert comm.use_peer_memory(device) is None
    peer = comm.peer
    gen = torch.Generator(device=device).manual_seed(1234 + comm.rank)

    def nccl_sum(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, group=comm.group.device)
        return y

    def captured(fn, x: torch.Tensor):
        """fn(x) warmed up, then captured into a graph: (graph, the captured output)."""
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn(x)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x)
        return graph, out

    hidden = 4096
    for rows in (1, 3, 64, peer.max_bytes // (hidden * 2)):
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        y = x.clone()
        assert not peer.fits(y) and comm.all_reduce(y) is y  # eager: NCCL, in place
        graph, out = captured(comm.all_reduce, x)
        assert out is not x  # captured: the peer path, a new tensor
        graph.replay()
        torch.testing.assert_close(out, nccl_sum(x), rtol=0, atol=0)
    too_big = torch.ones(peer.max_bytes // 4 + 4, device=device, dtype=torch.float32)
    graph, out = captured(comm.all_reduce, too_big)
    assert out is too_big  # NCCL, in place

    # many in a row through the one buffer in one graph, each reading the last: a rank that
    # overwrote its buffer before the other had read it would show here
    x = torch.randn(64, hidden, device=device, dtype=torch.float32, generator=gen)

    def chain(v: torch.Tensor) -> torch.Tensor:
        for i in range(40):
            v = comm.all_reduce(v * 0.5 + (i + comm.rank))
        return v

    static = x.clone()
    graph, out = captured(chain, static)
    for _ in range(3):
        static.copy_(torch.randn(64, hidden, device=device, dtype=torch.float32, generator=gen))
        want = static.clone()
        for i in range(40):
            want = nccl_sum(want * 0.5 + (i + comm.rank))
        graph.replay()
        torch.testing.assert_close(out, want)


def _fused_on_gpus(comm) -> None:
    import torch.distributed as dist

    from engine.triton_ops import triton_ops
    from kernels.fused import rms_norm

    device = torch.device("cuda", comm.group.local_rank)
    assert comm.use_peer_memory(device) is None
    peer, ops = comm.peer, triton_ops()
    gen = torch.Generator(device=device).manual_seed(99 + comm.rank)
    same = torch.Generator(device=device).manual_seed(5)  # the same on every rank: weights, residuals

    def unfused(x, residual, w):
        y = x.clone()
        dist.all_reduce(y, group=comm.group.device)
        return rms_norm(y, w, 1e-5, residual) if residual is not None else (rms_norm(y, w, 1e-5), y)

    def captured(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    assert not peer.fused  # until fuse_norm: the plain all-reduce
    for hidden, dtype in ((4096, torch.bfloat16), (8192, torch.bfloat16), (1000, torch.float32)):
        comm.fuse_norm(hidden, dtype, pdl=True)
        w = torch.randn(hidden, device=device, dtype=dtype, generator=same)
        most = peer.fused_max_bytes // (hidden * dtype.itemsize)  # more would take NCCL (in place), then the norm
        for rows in sorted({min(n, most) for n in (1, 5, 64, 200, most)}):
            x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen)
            r = torch.randn(rows, hidden, device=device, dtype=dtype, generator=same)
            for residual in (r, None):
                assert not peer.fits(x)  # eager: not the fused path
                graph, (normed, res) = captured(lambda: comm.reduce_norm(ops, x, residual, w, 1e-5))
                graph.replay()
                want_normed, want_res = unfused(x, residual, w)
                assert torch.equal(res, want_res), (hidden, rows, residual is None)
                assert torch.equal(normed, want_normed), (hidden, rows, residual is None)

    # one graph of calls of changing sizes, each reading the last (the programs' row sets change
    # from call to call: a program that wrote before its peer had read would show), replayed
    hidden = 4096
    w = torch.randn(hidden, device=device, dtype=torch.bfloat16, generator=same)
    sizes = [64, 1, 300, 7, 128, 64, 2, 511, 33, 64] * 3
    static_x = torch.randn(512, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    static_r = torch.randn(512, hidden, device=device, dtype=torch.bfloat16, generator=same)

    def chain(reduce_norm):
        x, r = static_x, static_r
        for n in sizes:
            h, r2 = reduce_norm(x[:n] * 0.5, r[:n])
            x = torch.cat((h, x[n:])) if n < 512 else h
            r = torch.cat((r2, r[n:])) if n < 512 else r2
        return x, r

    graph, (out_x, out_r) = captured(lambda: chain(lambda a, b: comm.reduce_norm(ops, a, b, w, 1e-5)))
    for _ in range(3):
        static_x.copy_(torch.randn(512, hidden, device=device, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        want_x, want_r = chain(lambda a, b: unfused(a, b, w))
        assert torch.equal(out_x, want_x) and torch.equal(out_r, want_r)


@pytest.mark.gpu
@TWO_GPUS
def test_all_reduce_fused_with_the_norm_equals_nccl_and_the_norm_on_two_gpus():
    run_ranks(_rank_main, (_fused_on_gpus, "cuda", 2))


@pytest.mark.gpu
@TWO_GPUS
def test_one_shot_equals_nccl_on_two_gpus():
    run_ranks(_rank_main, (_on_gpus, "cuda", 2))


@pytest.mark.gpu
@TWO_GPUS
def test_tp2_with_the_one_shot_all_reduce_equals_one_gpu_float32(tiny_models):
    from serve.llm import LLM

    ps = make_prompts(2)
    kw = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    for i, arch in enumerate(("llama", "qwen2")):
        want = LLM(str(tiny_models[arch]), **kw).generate(ps, GREEDY)
        with LLM(str(tiny_models[arch]), tensor_parallel_size=2, **kw) as llm:
            # the second engine of this process reuses the first one's group name: NCCL (peer_access)
            assert (llm.engine.runner.comm.peer is not None) == (i == 0)
            got = llm.generate(ps, GREEDY)
            # a sampled step gathers the ranks' logits after the graph (greedy ones take the argmax
            # keys inside it): a temperature this low samples the greedy tokens
            cold = llm.generate(ps, dataclasses.replace(GREEDY, temperature=1e-6))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.token_ids for o in cold] == [o.token_ids for o in want]
