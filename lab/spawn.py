"""Ranks of a lab measurement as spawned processes around one host store (lab/allreduce.py,
lab/sum_overlap_probe.py, lab/nano_overlap_probe.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def rank0_result(target: Callable, n: int, args: tuple, timeout_s: float) -> dict:
    """target(rank, port, *args) -> (result, comm) in n spawned processes -> rank 0's result, or a
    failing rank's {"error": traceback}, whichever comes first; the ranks joined after."""
    from engine.parallel.group import host_store

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = host_store(n, timeout_s=120)
    procs = [ctx.Process(target=_rank_entry, args=(target, r, store.port, args, queue)) for r in range(n)]
    for proc in procs:
        proc.start()
    got = queue.get(timeout=timeout_s)
    for proc in procs:
        proc.join(120)
    return got


def _rank_entry(target: Callable, rank: int, port: int, args: tuple, queue) -> None:
    """One spawned rank: its result onto the queue (rank 0's), then a barrier and the group torn
    down; a failure's traceback onto the queue and exit code 1."""
    import traceback

    try:
        from engine.parallel.group import destroy_group

        result, comm = target(rank, port, *args)
        if rank == 0:
            queue.put(result)
        comm.barrier()
        destroy_group(comm.group)
    except BaseException:
        queue.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise SystemExit(1)


def peer_ranks(rank: int, port: int, world: int, fused_max_bytes: int):
    """This rank's NCCL group over the host store at port, its Comm, its GPU and the engine's peer
    all-reduce buffers (kernels/allreduce_norm.py's fused kernel up to fused_max_bytes, launched
    without PDL) -> (group, comm, device, peer)."""
    import torch

    from engine.parallel import peer_allreduce
    from engine.parallel.comm import Comm
    from engine.parallel.group import connect_store, init_group, rank_env

    env = rank_env("127.0.0.1", port, rank, world)
    group = init_group(env, "cuda", store=connect_store(env))
    comm = Comm(group)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    sms = comm.min_int(torch.cuda.get_device_properties(device).multi_processor_count)
    peer = peer_allreduce.allocate(device, group.device, world, sms, fused_max_bytes=fused_max_bytes)
    peer_allreduce.rendezvous(peer)
    peer.pdl = False
    return group, comm, device, peer


def runs_over_rows(target: Callable, rows: list[int], args: tuple, out_path: str) -> int:
    """target(rank, port, rows, *args) -> (result, comm) on two spawned ranks for each row count: rank 0's
    results printed and written to out_path (the GPUs, the date, "runs") after each -> exit code."""
    import datetime
    import json
    import sys

    import torch

    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 1
    out = {"gpu": f"2x {torch.cuda.get_device_name(0)}", "date": datetime.date.today().isoformat(), "runs": []}
    for n in rows:
        res = rank0_result(target, 2, (n, *args), timeout_s=600)
        if "error" in res:
            print(res["error"], file=sys.stderr)
            return 1
        print(json.dumps(res), flush=True)
        out["runs"].append(res)
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0
