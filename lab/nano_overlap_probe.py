"""Do a mixed step's cross-GPU sums hide behind the other half of the batch? Two GPUs:
`python -m lab.nano_overlap_probe --out F`.

Llama-3-70B at TP=2 spends ~10% of a 768-row mixed step in its 160 fused sums (all-reduce +
residual add + RMSNorm, kernels/allreduce_norm.py), each between the projection that makes it and
the one that needs it (bench/NOTES.md, 2026-11-27). Beside a matmul the fused kernel slows it by
<1% and finishes ~19 us after it (lab/sum_overlap_probe.py), but within one batch there is nothing
to run beside a sum. Here the rows are cut in two halves, A and B, carried through the layers in
turn on one stream (qkv A, o A, qkv B, o B, gate/up A, down A, gate/up B, down B), each half's sums
on a second stream while the other half multiplies, against the whole batch as the engine runs it
today. Per layer: qkv, o (on the first 4,096 of qkv's columns: attention itself is left out, the
same in both), the sum + norm, gate/up, SiLU, down, the sum + norm; --layers layers of their own
weights (beyond L2), one CUDA graph per way, replayed alternately; the medians over --repeats
replays with CUDA events, and each way's output against the other (cuBLAS may pick other kernels at
half the rows, so not bit for bit). Writes one JSON with the GPUs and the date.
"""
from __future__ import annotations

import argparse

import torch

from lab.spawn import peer_ranks, runs_over_rows
from lab.tp_linear import shapes

# Llama-3-70B at TP=2, one rank: qkv columns, hidden size, attention output (32 heads x 128), MLP width
_SHAPES = shapes("llama3-70b", 2)
(QKV, HIDDEN), ATTN, INTER = _SHAPES["qkv"], _SHAPES["o"][1], _SHAPES["down"][1]
EPS = 1e-5


def _weights(layers: int, device, gen) -> list[dict]:
    def w(n, k):
        return (torch.randn(n, k, device=device, generator=gen) / k ** 0.5).bfloat16()
    return [{"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, ATTN), "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER),
             "ln1": torch.ones(HIDDEN, device=device).bfloat16(), "ln2": torch.ones(HIDDEN, device=device).bfloat16()}
            for _ in range(layers)]


def _attention_then_mlp(x, layer, add_norm, silu_and_mul):
    """x: normed input -> (the o projection's part of a sum, a function that takes its sum + norm
    and returns the down projection's part)."""
    from torch.nn import functional as F

    q = F.linear(x, layer["qkv"])
    h = F.linear(q[:, :ATTN], layer["o"])

    def mlp(normed):
        return F.linear(silu_and_mul(F.linear(normed, layer["gate_up"])), layer["down"])
    return h, mlp


def whole(x, residual, layers, add_norm, silu_and_mul):
    """The engine's order: every sum between the projection that makes it and the one after."""
    normed, residual = add_norm(x, residual, layers[0]["ln1"])
    for i, layer in enumerate(layers):
        h, mlp = _attention_then_mlp(normed, layer, add_norm, silu_and_mul)
        normed, residual = add_norm(h, residual, layer["ln2"])
        out = mlp(normed)
        nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else layer["ln1"]
        normed, residual = add_norm(out, residual, nxt)
    return normed, residual


def halves(x, residual, layers, add_norm, silu_and_mul, side: torch.cuda.Stream):
    """Two halves of the rows in turn, each sum on `side` (in the same order on every rank: the
    fused kernel's calls pair up by count) while the other half's projections run."""
    main = torch.cuda.current_stream()
    parts = list(zip(x.chunk(2), residual.chunk(2)))
    # every tensor that crosses between the streams stays referenced until the end: freed, its
    # memory could go to a later allocation on its own stream while the other stream still reads it
    keep = []

    def on_side(t, res, weight):
        made = torch.cuda.Event()
        made.record(main)
        side.wait_event(made)
        with torch.cuda.stream(side):
            normed, res = add_norm(t, res, weight)
            done = torch.cuda.Event()
            done.record(side)
        keep.extend((t, normed, res))
        return normed, res, done

    pending = [on_side(t, r, layers[0]["ln1"]) for t, r in parts]
    for i, layer in enumerate(layers):
        mlps = []
        for j in range(2):
            normed, res, done = pending[j]
            main.wait_event(done)
            h, mlp = _attention_then_mlp(normed, layer, add_norm, silu_and_mul)
            mlps.append(mlp)
            pending[j] = on_side(h, res, layer["ln2"])
        nxt = layers[i + 1]["ln1"] if i + 1 < len(layers) else layer["ln1"]
        for j in range(2):
            normed, res, done = pending[j]
            main.wait_event(done)
            pending[j] = on_side(mlps[j](normed), res, nxt)
    for _, _, done in pending:
        main.wait_event(done)
    return torch.cat([p[0] for p in pending]), torch.cat([p[1] for p in pending])


def _rank(rank: int, port: int, rows: int, layers_n: int, repeats: int) -> tuple[dict, object]:
    from kernels.fused import silu_and_mul

    _, comm, device, peer = peer_ranks(rank, port, 2, rows * HIDDEN * 2)

    def add_norm(t, res, weight):
        return peer.add_norm(t, res, weight, EPS)

    layers = _weights(layers_n, device, torch.Generator(device=device).manual_seed(11 + rank))
    same = torch.Generator(device=device).manual_seed(3)  # the same inputs on both ranks
    x = torch.randn(rows, HIDDEN, device=device, generator=same).bfloat16()
    residual = torch.randn(rows, HIDDEN, device=device, generator=same).bfloat16()
    side = torch.cuda.Stream(device)
    ways = {"whole": lambda: whole(x, residual, layers, add_norm, silu_and_mul),
            "halves": lambda: halves(x, residual, layers, add_norm, silu_and_mul, side)}
    graphs, outs = {}, {}
    for name, fn in ways.items():
        fn()  # compiles, and a first eager run of each way
        torch.cuda.synchronize()
        comm.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[name] = fn()
        graphs[name] = graph
    times = {name: [] for name in ways}
    for i in range(repeats + 2):  # the first two warm up
        for name, graph in graphs.items():
            comm.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times[name].append(start.elapsed_time(end))
    res = {"rows": rows, "layers": layers_n, "repeats": repeats}
    for name, ts in times.items():
        ts.sort()
        res[f"{name}_ms"] = ts[len(ts) // 2]
        res[f"{name}_ms_per_layer"] = ts[len(ts) // 2] / layers_n
    res["halves_over_whole"] = res["halves_ms"] / res["whole_ms"]
    (a, ra), (b, rb) = outs["whole"], outs["halves"]
    res["normed_max_diff"] = float((a.float() - b.float()).abs().max())
    res["normed_max"] = float(a.float().abs().max())
    res["residual_max_diff"] = float((ra.float() - rb.float()).abs().max())
    return res, comm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="768,512", help="rows of the batch (even)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return runs_over_rows(_rank, [int(r) for r in args.rows.split(",")], (args.layers, args.repeats), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
