"""Can a mixed step's cross-GPU sum hide under its matmuls? Two GPUs: `python -m lab.sum_overlap_probe --out F`.

Llama-3-70B at TP=2 spends ~10% of a 768-row mixed step in its 160 fused sums of 12.6 MB (55.7 us
each, bench/NOTES.md 2026-11-27), one after another with the matmuls. Before building sums that run
beside the projections, this measures the primitive such a design would stand on, each rank doing
the same at once: a gate/up-sized matmul (rows x 8,192 @ 8,192 x 28,672, cuBLAS) alone; moving one
rank's rows x 8,192 bf16 partial to the other three ways: a copy out of the peer's symmetric memory
(torch's copy_ of a peer view: the copy engines, no SMs), NCCL's all-reduce, and the engine's fused
all-reduce + RMSNorm kernel (kernels/allreduce_norm.py, SMs); and each of the three on a second
stream beside the matmul. Per case the median over --repeats of the matmul's end and the transfer's
end from a common start (CUDA events). Then two chains of a layer the engine's way against torch's
async tensor parallelism (_chains). Writes one JSON with the GPUs and the date.
"""
from __future__ import annotations

import argparse

import torch

from lab.spawn import peer_ranks, runs_over_rows
from lab.tp_linear import shapes

# Llama-3-70B at TP=2, one rank's projections: (output columns, input columns)
SHAPES = shapes("llama3-70b", 2)
GATE_UP, HIDDEN = SHAPES["gate_up"]


def _timed(main_fn, side_fn, side: torch.cuda.Stream, repeats: int, comm) -> dict:
    """Median ms from a common start to the end of main_fn (current stream) and of side_fn (side)."""
    mains, sides = [], []
    for _ in range(repeats + 2):  # the first two warm up
        comm.barrier()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        main_end, side_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        side.wait_event(start)
        if main_fn is not None:
            main_fn()
            main_end.record()
        if side_fn is not None:
            with torch.cuda.stream(side):
                side_fn()
                side_end.record()
        torch.cuda.synchronize()
        mains.append(start.elapsed_time(main_end) if main_fn is not None else None)
        sides.append(start.elapsed_time(side_end) if side_fn is not None else None)
    out = {}
    for name, vals in (("main_ms", mains[2:]), ("side_ms", sides[2:])):
        if vals[0] is not None:
            out[name] = sorted(vals)[len(vals) // 2]
    return out


def _chains(rows, repeats, side, comm, peer, group_name, x, w_gate_up, r, nw, device) -> dict:
    """A row-parallel projection, its sum with the residual add and RMSNorm, and the next
    column-parallel projection, two ways: as the engine runs them (cuBLAS, the fused all-reduce +
    norm, cuBLAS), and as torch's async tensor parallelism would (torch.ops.symm_mem's
    fused_matmul_reduce_scatter: the sum scattered by rows over the copy engines while the other
    rank's rows multiply; the add + norm on this rank's half of the rows; fused_all_gather_matmul:
    the halves gathered while each multiplies). o: attention output [rows, 4,096] @ o_proj, then
    gate/up; down: [rows, 14,336] @ down, then qkv. Each chain's output is compared with NCCL's
    all-reduce and torch's RMSNorm between the same matmuls."""
    from torch.nn import functional as F

    out = {}
    half = rows // comm.size
    me = slice(comm.rank * half, (comm.rank + 1) * half)
    g = torch.Generator(device=device).manual_seed(7)  # the same inputs on both ranks but the weights
    qkv = (torch.randn(*SHAPES["qkv"], device=device) / HIDDEN ** 0.5).bfloat16()
    for name, k_in, w_next in (("o_then_gate_up", SHAPES["o"][1], w_gate_up), ("down_then_qkv", SHAPES["down"][1], qkv)):
        a = torch.randn(rows, k_in, device=device, generator=g).bfloat16()
        w_row = (torch.randn(HIDDEN, k_in, device=device) / k_in ** 0.5).bfloat16()
        residual = r.clone()

        def engine_way():
            h = F.linear(a, w_row)
            normed, _ = peer.add_norm(h, residual, nw, 1e-5)
            return F.linear(normed, w_next)

        def async_tp():
            summed = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w_row.t(), "sum", 0, group_name)
            normed = F.rms_norm(summed + residual[me], (HIDDEN,), nw, 1e-5)
            _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(normed, [w_next.t()], 0, group_name, return_A=False)
            return y

        def nccl_way():
            h = F.linear(a, w_row)
            torch.distributed.all_reduce(h, group=comm.group.device)
            return F.linear(F.rms_norm(h + residual, (HIDDEN,), nw, 1e-5), w_next)

        try:
            want = nccl_way()
            for way, fn in (("engine_way", engine_way), ("async_tp", async_tp)):
                got = fn()
                out[f"{name}_{way}_max_diff_from_nccl"] = float((want.float() - got.float()).abs().max())
            out[f"{name}_output_max"] = float(want.float().abs().max())
            out[f"{name}_engine_way"] = _timed(engine_way, None, side, repeats, comm)
            out[f"{name}_async_tp"] = _timed(async_tp, None, side, repeats, comm)
            out[f"{name}_row_gemm_alone"] = _timed(lambda: F.linear(a, w_row), None, side, repeats, comm)
            out[f"{name}_next_gemm_alone"] = _timed(lambda: F.linear(r, w_next), None, side, repeats, comm)
        except Exception as e:  # noqa: BLE001 - a torch without these ops is a result too
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _rank(rank: int, port: int, rows: int, repeats: int) -> tuple[dict, object]:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.nn import functional as F

    group, comm, device, peer = peer_ranks(rank, port, 2, max(rows * HIDDEN * 2, 2 << 20))
    src = symm_mem.empty(rows * HIDDEN, dtype=torch.bfloat16, device=device).view(rows, HIDDEN)
    src.copy_(torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rank)).bfloat16())
    handle = symm_mem.rendezvous(src, group.device.group_name)
    theirs = handle.get_buffer(1 - rank, (rows, HIDDEN), torch.bfloat16)
    recv = torch.empty_like(src)
    torch.cuda.synchronize()
    comm.barrier()
    recv.copy_(theirs)
    want = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1 - rank)).bfloat16()
    copy_correct = bool(torch.equal(recv.cpu(), want))

    x = torch.randn(rows, HIDDEN, device=device).bfloat16()
    w = (torch.randn(GATE_UP, HIDDEN, device=device) / HIDDEN ** 0.5).bfloat16()
    r = torch.randn(rows, HIDDEN, device=device).bfloat16()
    nw = torch.ones(HIDDEN, device=device).bfloat16()
    part = src.clone()
    side = torch.cuda.Stream(device)

    def gemm():
        F.linear(x, w)

    def copy_engine():
        recv.copy_(theirs)

    def nccl():
        dist.all_reduce(part, group=group.device)

    def fused():
        peer.add_norm(src, r, nw, 1e-5)

    res = {"rows": rows, "bytes": rows * HIDDEN * 2, "copy_correct": copy_correct,
           "gemm_alone": _timed(gemm, None, side, repeats, comm)}
    for name, fn in (("copy_engine", copy_engine), ("nccl", nccl), ("fused_kernel", fused)):
        res[f"{name}_alone"] = _timed(None, fn, side, repeats, comm)
        res[f"gemm_and_{name}"] = _timed(gemm, fn, side, repeats, comm)
    res.update(_chains(rows, repeats, side, comm, peer, group.device.group_name, x, w, r, nw, device))
    return res, comm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="256,768", help="rows of the matmul and of the summed partial")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return runs_over_rows(_rank, [int(x) for x in args.rows.split(",")], (args.repeats,), args.out)

if __name__ == "__main__":
    raise SystemExit(main())
