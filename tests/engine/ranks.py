"""Spawned processes as the ranks of a group, for tests that run collectives on the CPU or GPUs."""
from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def run_ranks(main: Callable, args: tuple, n: int = 2, timeout_s: float = 180) -> None:
    """main(rank, port, errors, *args) in n spawned processes around one host store (rank 0's
    rendezvous, on a free port); a rank puts its traceback on `errors` before it exits non-zero.
    Fails with those messages unless every rank exits 0 in time."""
    from engine.parallel.group import host_store

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    store = host_store(n, timeout_s=60)
    procs = [ctx.Process(target=main, args=(r, store.port, errors, *args)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert [p.exitcode for p in procs] == [0] * n, "\n".join(messages)
