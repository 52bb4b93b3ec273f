"""KV pages between two GPUs as disaggregation moves them (engine/kv_transfer.py): the decode GPU
copying a prompt's blocks out of the prefill GPU's mapped pool (pull) against NCCL send/recv
(push), and both against one contiguous peer copy of the same bytes (the link), on idle GPUs, in
one call. Llama-3-8B's pages by default (32 layers, 8 KV heads of 128, bf16, 16-token blocks).

    python -m lab.kv_pull --out kv_pull.json [--blocks 8,32,128] [--reps 20]

Rank 0 (prefill, cuda:0) fills its pool with random bytes; rank 1 (decode, cuda:1) moves blocks
from random ids into random ids of its own pool and checks every byte of the last pull and push.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec
from lab.kernels import gpu_and_date, write_json


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def _fill(pool: KVPool, seed: int) -> None:
    g = torch.Generator(pool.kv.device).manual_seed(seed)
    b = pool.kv.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8, device=b.device))


def _side(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    from engine.kv_transfer import PoolTransport, join_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    join_group(rank, 2, "127.0.0.1", port, device, timeout_s=120)
    spec = KVCacheSpec(args.layers, args.kv_heads, args.head_dim, args.block_size, "bfloat16")
    pool = KVPool(spec, args.num_blocks, device, torch.bfloat16)
    _fill(pool, rank)
    want = None
    if rank == 1:  # the prefill's pages, made again here: what every move must deliver
        want = KVPool(spec, args.num_blocks, device, torch.bfloat16)
        _fill(want, 0)
    rng = torch.Generator().manual_seed(7)
    sizes = [int(x) for x in args.blocks.split(",")]
    plans = {n: [(torch.randperm(args.num_blocks, generator=rng)[:n].tolist(),
                  torch.randperm(args.num_blocks, generator=rng)[:n].tolist()) for _ in range(args.reps + 2)]
             for n in sizes}
    result: dict = {n: {"tokens": n * args.block_size,
                        "bytes": n * pool.kv[:, :, 0].numel() * pool.kv.element_size()} for n in sizes}
    # push first: a handshake where every pair pulls leaves the group
    push = PoolTransport(pool)
    push.handshake([0], [1], rank, pull=False)
    for n in sizes:
        if rank == 0:
            for src, _ in plans[n]:
                push.send(src, 1, tag=0)
            for works, _ in push._sending:
                for w in works:
                    w.wait()
            torch.cuda.synchronize()
            continue
        it = iter(plans[n])
        result[n]["push_s"] = statistics.median(_time(lambda: push.recv(next(it)[1], 0, tag=0), args.reps + 2)[2:])
        result[n]["push_bytes_equal"] = _equal(pool, want, plans[n][-1])
    dist.barrier()
    pull = PoolTransport(pool)
    pull.handshake([0], [1], rank)  # every pair pulls: the group is left here
    if rank == 0:
        torch.cuda.synchronize()
        out["lent"] = True
        while "done" not in out:  # the decode side reads this pool until it is done
            time.sleep(0.1)
        return
    theirs = pull._peers[0][0]
    for n in sizes:
        nbytes = result[n]["bytes"]
        it = iter(plans[n])
        result[n]["pull_s"] = statistics.median(_time(lambda: _pull(pull, next(it)), args.reps + 2)[2:])
        result[n]["pull_bytes_equal"] = _equal(pool, want, plans[n][-1])
        # torch's two passes (index_select over the link into a temporary, then index_copy_)
        it = iter(plans[n])
        result[n]["pull_torch_s"] = statistics.median(_time(lambda: _torch_pull(pull, next(it)), args.reps + 2)[2:])
        # the link: the same bytes as one contiguous copy out of the prefill's mapped pool
        chunk = theirs.view(-1)[:nbytes // 8]
        local = torch.empty_like(chunk)
        result[n]["link_s"] = statistics.median(_time(lambda: local.copy_(chunk), args.reps + 2)[2:])
        r = result[n]
        for k in ("push", "pull", "pull_torch", "link"):
            r[f"{k}_GBps"] = round(nbytes / r[f"{k}_s"] / 1e9, 1)
            r[f"{k}_of_link"] = round(r["link_s"] / r[f"{k}_s"], 3)
            r[f"{k}_us"] = round(r.pop(f"{k}_s") * 1e6, 1)
        print(n, r, flush=True)
    pull.timings()
    out["result"] = result
    out["done"] = True


def _pull(t, plan) -> None:
    src, dst = plan
    t.pull(dst, 0, src, tag=1)


def _torch_pull(t, plan) -> None:
    from kernels import reference

    src, dst = plan
    for mine, theirs in zip(t._words, t._peers[0]):
        reference.copy_pages(theirs, mine, t._index(src), t._index(dst))


def _equal(pool: KVPool, want: KVPool, plan) -> bool:
    """Whether this pool's blocks `dst` hold the prefill's blocks `src`."""
    src, dst = plan
    torch.cuda.synchronize()
    return bool(torch.equal(pool.kv[:, :, dst].view(torch.uint8), want.kv[:, :, src].view(torch.uint8)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--blocks", default="8,32,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_side, args=(r, port, args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    report = gpu_and_date() | {"shape": vars(args), "by_blocks": dict(out.get("result", {})),
                               "exit_codes": [p.exitcode for p in procs]}
    print(json.dumps(report, indent=1))
    write_json(args.out, report)
    raise SystemExit(0 if all(p.exitcode == 0 for p in procs) else 1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    main()
