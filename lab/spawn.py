"""Ranks of a lab measurement as spawned processes around one host store (lab/allreduce.py,
lab/sum_overlap_probe.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def rank0_result(target: Callable, n: int, args: tuple, timeout_s: float) -> dict:
    """target(rank, port, *args, queue) in n spawned processes -> the first dict any of them puts on
    the queue (rank 0's result, or a failing rank's {"error": traceback}); the ranks joined after."""
    from engine.parallel.group import host_store

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = host_store(n, timeout_s=120)
    procs = [ctx.Process(target=target, args=(r, store.port, *args, queue)) for r in range(n)]
    for proc in procs:
        proc.start()
    got = queue.get(timeout=timeout_s)
    for proc in procs:
        proc.join(120)
    return got
