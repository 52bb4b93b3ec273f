"""NCCL against the one-shot all-reduce over peer memory, per message size, inside CUDA graphs as
the engine runs them: each graph holds `--chain` all-reduces in a row (each reading the last), so
one replay's time over the chain is the time of one all-reduce with its launch hidden.

    python -m lab.allreduce --gpus 2 --out allreduce.json

The report gives, per size, microseconds of each and the largest size below which the one-shot
kernel wins at every size: the limit engine/parallel/peer_allreduce.py's ONE_SHOT_MAX_BYTES holds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback

import torch
import torch.multiprocessing as mp

SIZES = [8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20]


def _time_graph(fn, x: torch.Tensor, chain: int, repeats: int, comm) -> float:
    """Microseconds per all-reduce: median over repeats of one replay / chain."""
    device = x.device
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


def _rank(rank: int, n: int, port: int, chain: int, repeats: int, queue) -> None:
    try:
        import torch.distributed as dist

        from engine.parallel import peer_allreduce
        from engine.parallel.comm import Comm
        from engine.parallel.group import connect_store, destroy_group, init_group, rank_env

        env = rank_env("127.0.0.1", port, rank, n)
        group = init_group(env, "cuda", store=connect_store(env))
        comm = Comm(group)
        device = torch.device("cuda", rank)
        why = peer_allreduce.peer_access(device, n)
        peer = None
        if why is None or why.startswith("no measured size limit"):
            peer = peer_allreduce.allocate(device, group.device, n, max_bytes=max(SIZES))
            peer_allreduce.rendezvous(peer)

        def nccl(y: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(y, group=group.device)
            return y

        rows = []
        for size in SIZES:
            x = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
            row = {"bytes": size, "nccl_us": _time_graph(nccl, x.clone(), chain, repeats, comm)}
            if peer is not None:
                row["one_shot_us"] = _time_graph(peer, x.clone(), chain, repeats, comm)
                got = peer(torch.full_like(x, rank + 1.0))
                row["one_shot_correct"] = bool((got == n * (n + 1) / 2).all().item())
            rows.append(row)
        if rank == 0:
            queue.put({"rows": rows, "peer_why_not": why})
        comm.barrier()
        destroy_group(group)
    except BaseException:
        queue.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise SystemExit(1)


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
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.gpus:
        print(f"lab.allreduce: needs {a.gpus} GPUs", file=sys.stderr)
        return 1
    from engine.parallel.group import host_store

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = host_store(a.gpus, timeout_s=120)
    procs = [ctx.Process(target=_rank, args=(r, a.gpus, store.port, a.chain, a.repeats, queue)) for r in range(a.gpus)]
    for proc in procs:
        proc.start()
    got = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    if "error" in got:
        print(got["error"], file=sys.stderr)
        return 1
    result = {"gpu": torch.cuda.get_device_name(0), "gpus": a.gpus, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "chain": a.chain, **got, "one_shot_faster_up_to_bytes": crossover(got["rows"])}
    for r in got["rows"]:
        print(f"{r['bytes'] >> 10:>8} KiB  nccl {r['nccl_us']:7.1f} us  one-shot {r.get('one_shot_us', float('nan')):7.1f} us")
    print(f"one-shot faster up to {result['one_shot_faster_up_to_bytes'] >> 10} KiB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
