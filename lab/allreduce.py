"""NCCL against the one-shot all-reduce over peer memory, per message size, inside CUDA graphs as
the engine runs them: each graph holds `--chain` all-reduces in a row (each reading the last), so
one replay's time over the chain is the time of one all-reduce with its launch hidden. Then, per
hidden size, what a layer's row-parallel output costs up to its norm: NCCL's all-reduce and the
residual add + RMSNorm kernel, torch's one-shot kernel and the same norm, or the fused kernel
(kernels/allreduce_norm.py), which must equal NCCL's path bit for bit.

    python -m lab.allreduce --gpus 2 --out allreduce.json

The report gives, per size, microseconds of each and the largest size below which the one-shot
kernel wins at every size: the limit engine/parallel/peer_allreduce.py's ONE_SHOT_MAX_BYTES holds.
`--fused-only` times only the fused kernel's rows; `--push-max-mib M` makes it push messages up to
M MiB into the peers (kernels/allreduce_norm.py's PUSH_MAX_BYTES) instead of reading larger ones.
"""
from __future__ import annotations

import argparse
import sys

import torch

from lab.kernels import gpu_and_date, write_json
from lab.spawn import rank0_result

SIZES = [8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20]


def _time_graph(fn, x, chain: int, repeats: int, comm) -> float:
    """Microseconds per all-reduce: median over repeats of one replay / chain. x: a tensor, or a
    tuple of them that fn maps to the next."""
    device = (x[0] if isinstance(x, tuple) else x).device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            y = x
            for _ in range(chain):
                y = fn(y)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(chain):
            y = fn(y)
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        comm.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / chain)
    del graph
    times.sort()
    return times[len(times) // 2]


def _rank(rank: int, port: int, n: int, chain: int, repeats: int, fused_only: bool = False,
          push_max_mib: float | None = None) -> tuple[dict, object]:
    import torch.distributed as dist

    from engine.parallel import peer_allreduce
    from engine.parallel.comm import Comm
    from engine.parallel.group import connect_store, init_group, rank_env
    from kernels import allreduce_norm

    if push_max_mib is not None:  # before allocate(): the pushed halves are sized by it
        allreduce_norm.PUSH_MAX_BYTES = int(push_max_mib * (1 << 20))

    env = rank_env("127.0.0.1", port, rank, n)
    group = init_group(env, "cuda", store=connect_store(env))
    comm = Comm(group)
    device = torch.device("cuda", rank)
    why = peer_allreduce.peer_access(device, n)
    peer = None
    if why is None or why.startswith("no measured size limit"):
        programs = comm.min_int(torch.cuda.get_device_properties(device).multi_processor_count)
        peer = peer_allreduce.allocate(device, group.device, n, programs, max_bytes=max(SIZES),
                                       fused_max_bytes=max(SIZES))
        peer_allreduce.rendezvous(peer)
        peer.pdl = True

    def nccl(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y, group=group.device)
        return y

    rows = []
    for size in [] if fused_only else SIZES:
        x = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
        row = {"bytes": size, "nccl_us": _time_graph(nccl, x.clone(), chain, repeats, comm)}
        if peer is not None:
            row["one_shot_us"] = _time_graph(peer, x.clone(), chain, repeats, comm)
            got = peer(torch.full_like(x, rank + 1.0))
            row["one_shot_correct"] = bool((got == n * (n + 1) / 2).all().item())
        rows.append(row)
    fused = _fused_rows(comm, peer, nccl, device, chain, repeats) if peer is not None else []
    return {"rows": rows, "fused": fused, "peer_why_not": why}, comm


def _fused_rows(comm, peer, nccl, device: torch.device, chain: int, repeats: int) -> list[dict]:
    """Per hidden size and row count: microseconds from a rank's part of a row-parallel output to
    the normed sum and the new residual, three ways, and whether the fused one equals NCCL's."""
    from kernels import allreduce_norm
    from kernels.fused import rms_norm

    out = []
    gen = torch.Generator(device=device).manual_seed(7 + comm.rank)
    for hidden in (4096, 8192):
        w = torch.randn(hidden, dtype=torch.bfloat16, device=device, generator=torch.Generator(device=device).manual_seed(3))
        for rows in (1, 16, 64, 128, 256, 512, 1024, 2048):
            if rows * hidden * 2 > peer.fused_max_bytes:
                break
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device, generator=gen)
            r = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device, generator=gen)

            def unfused(state, reduce):
                h, res = state
                return rms_norm(reduce(h), w, 1e-5, res, pdl=True)

            def fused(state):
                h, res = state
                return peer.add_norm(h, res, w, 1e-5)

            row = {"hidden": hidden, "rows": rows, "bytes": rows * hidden * 2,
                   "nccl_norm_us": _time_graph(lambda s: unfused(s, nccl), (x.clone(), r), chain, repeats, comm),
                   "one_shot_norm_us": _time_graph(lambda s: unfused(s, peer), (x.clone(), r), chain, repeats, comm),
                   "fused_us": _time_graph(fused, (x, r), chain, repeats, comm)}
            want = rms_norm(nccl(x.clone()), w, 1e-5, r)
            got = _captured_once(fused, (x, r), device)
            row["fused_equal"] = all(bool(torch.equal(a, b)) for a, b in zip(got, want))
            row["pushed"] = allreduce_norm.pushes(rows * hidden * 2, peer.fused_max_bytes)
            out.append(row)
            if comm.rank == 0:  # as it goes: a run cut short still tells
                print(f"hidden {hidden:>5} rows {rows:>5}  nccl+norm {row['nccl_norm_us']:7.1f} us  one-shot+norm "
                      f"{row['one_shot_norm_us']:7.1f} us  fused "
                      f"{row['fused_us']:7.1f} us ({'pushed' if row['pushed'] else 'read'})  equal {row['fused_equal']}",
                      flush=True)
    return out


def _captured_once(fn, state, device: torch.device):
    """fn(state) from a CUDA graph (the fused kernel runs only under capture in the engine)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn(state)
    graph.replay()
    torch.cuda.synchronize(device)
    return [t.clone() for t in got]


def crossover(rows: list[dict]) -> int:
    """The largest size up to which the one-shot kernel is faster at every measured size (0: none)."""
    best = 0
    for r in rows:
        if "one_shot_us" not in r or not r.get("one_shot_correct") or r["one_shot_us"] >= r["nccl_us"]:
            break
        best = r["bytes"]
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.allreduce")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--chain", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--fused-only", action="store_true", help="only the fused kernel's rows (no size sweep)")
    p.add_argument("--push-max-mib", type=float, default=None,
                   help="the fused kernel pushes messages up to this size (default: kernels/allreduce_norm.py's)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.gpus:
        print(f"lab.allreduce: needs {a.gpus} GPUs", file=sys.stderr)
        return 1
    got = rank0_result(_rank, a.gpus, (a.gpus, a.chain, a.repeats, a.fused_only, a.push_max_mib), timeout_s=300)
    if "error" in got:
        print(got["error"], file=sys.stderr)
        return 1
    result = gpu_and_date() | {"gpus": a.gpus, "torch": torch.__version__, "chain": a.chain,
                               "push_max_mib": a.push_max_mib, **got,
                               "one_shot_faster_up_to_bytes": crossover(got["rows"])}
    for r in got["rows"]:
        print(f"{r['bytes'] >> 10:>8} KiB  nccl {r['nccl_us']:7.1f} us  one-shot {r.get('one_shot_us', float('nan')):7.1f} us")
    if got["rows"]:
        print(f"one-shot faster up to {result['one_shot_faster_up_to_bytes'] >> 10} KiB")
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
