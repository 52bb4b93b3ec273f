"""Whether one program an SM pulls its share of a decode layer's bytes at the copy bandwidth when it
asks for much of it at once: TMA boxes into shared memory, DEPTH of them in flight (up to the
program's whole share), each waited for and read once into registers.

    python -m lab.tma_stream [--json OUT]

A layer kernel for a small model's decode step (bench/NOTES.md, 2026-11-27 night) would stream the
next operation's weights while the current one computes; its ceiling is how fast one resident
program an SM can stream. Triton's pipelined TMA loads at one program an SM read at 0.58-0.70 of
the copy bandwidth and plain loads at 0.30-0.51 (lab/stream_floor.py); the Gluon gate/up with a
ring of 4-8 boxes of 4 KB pulled ~11 GB/s an SM, under half its share (lab/gluon_gate_up.py). This
sweeps box size, depth and programs an SM with nothing but the wait and a read of each box, times
Triton's TMA stream of the same bytes in the same call (lab/stream_floor.py), and writes one JSON
with the GPU's name and the date. Hopper only.

Measured on an H100 (bench/NOTES.md, 2026-11-28): one program an SM with 4-8 boxes of 8-16 KB in
flight streams like Triton's eight: a layer's 48.7 MB at 0.85-0.88 of the copy bandwidth, the MLP's
26 MB at 0.76-0.79, gate/up's 17.4 MB at 0.68-0.70; a program's whole share asked for at once is
slower (0.53-0.80).
"""
from __future__ import annotations

import argparse
import datetime

import torch

from lab.kernels import cold_copies, copy_bandwidth, graph_time, write_json

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # renamed between Triton 3.6 and 3.9
except ImportError:  # pragma: no cover
    gluon = None

COLS = 128  # a box is [rows, 128] bf16: 256-byte rows
SMEM = 200 * 1024  # what the boxes of one program may take
# Qwen2.5-0.5B at 64 rows, 576-token contexts: the MLP's weights, gate/up's, and the layer's bytes
SIZES = (("mlp weights", 26_148_864), ("gate_up", 17_432_576), ("layer", 48_697_344))

if gluon is not None:

    @gluon.jit
    def _stream_kernel(desc, out_ptr, n_tiles, DEPTH: gl.constexpr, NUM_WARPS: gl.constexpr):
        ROWS: gl.constexpr = desc.block_type.shape[0]
        BCOLS: gl.constexpr = desc.block_type.shape[1]
        pid = gl.program_id(0)
        t0 = pid * n_tiles // gl.num_programs(0)  # an even share of the boxes
        n = (pid + 1) * n_tiles // gl.num_programs(0) - t0
        bufs = gl.allocate_shared_memory(desc.dtype, [DEPTH, ROWS, BCOLS], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(DEPTH):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(DEPTH):
            if i < n:
                mbarrier.expect(bars.index(i), desc.block_type.nbytes)
                _tma_load(desc, [(t0 + i) * ROWS, 0], bars.index(i), bufs.index(i))
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        acc = gl.zeros([ROWS, BCOLS], gl.float32, layout)
        for j in range(n):
            s = j % DEPTH
            mbarrier.wait(bars.index(s), (j // DEPTH) & 1)
            acc += bufs.index(s).load(layout).to(gl.float32)
            if j + DEPTH < n:
                _cta_barrier()  # every warp has read box s before the next one lands there
                mbarrier.expect(bars.index(s), desc.block_type.nbytes)
                _tma_load(desc, [(t0 + j + DEPTH) * ROWS, 0], bars.index(s), bufs.index(s))
        for i in gl.static_range(DEPTH):
            mbarrier.invalidate(bars.index(i))
        gl.store(out_ptr + pid, gl.sum(gl.sum(acc, 1), 0))


def launch_args(buf: torch.Tensor, out: torch.Tensor, programs: int, rows: int, depth: int,
                num_warps: int = 4) -> tuple:
    """(grid, args, kwargs) for a stream of buf [N, 128] bf16 in boxes [rows, 128] over `programs`."""
    n_tiles = -(-buf.shape[0] // rows)
    layout = gl.NVMMASharedLayout.get_default_for([rows, COLS], gl.bfloat16)
    desc = GluonDescriptor(buf, list(buf.shape), [buf.stride(0), 1], [rows, COLS], layout)
    return (min(programs, n_tiles),), (desc, out, n_tiles), dict(DEPTH=depth, NUM_WARPS=num_warps, num_warps=num_warps)


def cases(sms: int) -> list[dict]:
    """Box rows x depth x programs an SM: the ring of lab/gluon_gate_up.py (4 KB boxes, 4-8 deep), deeper
    rings of larger boxes, and as much of a program's share at once as SMEM holds."""
    out = []
    for per_sm in (1, 2):
        room = SMEM // per_sm
        for rows in (16, 32, 64, 128):
            box = rows * COLS * 2
            for depth in sorted({4, 8, min(room // box, 48)}):
                if 2 <= depth and depth * box <= room:
                    out.append({"programs": per_sm * sms, "rows": rows, "depth": depth,
                                "num_warps": 8 if rows == 128 else 4})
    return out


def time_case(nbytes: int, case: dict) -> float:
    copies = cold_copies(nbytes)
    bufs = [torch.randn(nbytes // 2 // COLS, COLS, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    out = torch.empty(case["programs"], device="cuda", dtype=torch.float32)
    launches = [launch_args(b, out, case["programs"], case["rows"], case["depth"], case["num_warps"])
                for b in bufs]

    def fn(i):
        grid, args, kw = launches[i]
        _stream_kernel[grid](*args, **kw)
    fn(0)
    torch.cuda.synchronize()
    want = bufs[0].float().sum().item()
    got = out.sum().item()
    assert abs(got - want) <= 1e-3 * bufs[0].float().abs().sum().item(), (got, want)
    return graph_time(fn, copies)


def main(argv: list[str] | None = None) -> int:
    from kernels.launch import sm_count
    from lab.stream_floor import time_stream

    ap = argparse.ArgumentParser(prog="python -m lab.tma_stream", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    sms = sm_count(torch.device("cuda"))
    bw = copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "copy_bandwidth": bw,
           "sizes": []}
    print(f"{res['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name, nbytes in SIZES:
        row = {"name": name, "bytes": nbytes, "at_copy_bw_us": nbytes / bw * 1e6, "triton": [], "gluon": []}
        for tcase in ({"kind": "tma", "programs": sms, "num_warps": 4, "rows": 64, "stages": 5},
                      {"kind": "tma", "programs": 8 * sms, "num_warps": 4, "rows": 64, "stages": 3}):
            us = time_stream(nbytes, tcase) * 1e6
            row["triton"].append(tcase | {"us": us, "of_copy_bw": row["at_copy_bw_us"] / us})
            print(f"{name}: triton {tcase['programs']} programs, stages {tcase['stages']}: {us:.2f} us "
                  f"({row['at_copy_bw_us'] / us:.2f} of copy)", flush=True)
        for case in cases(sms):
            try:
                us = time_case(nbytes, case) * 1e6
            except Exception as e:  # a case that does not fit or fails its check: recorded
                row["gluon"].append(case | {"error": str(e).splitlines()[0][:200]})
                print(f"{name}: {case}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            row["gluon"].append(case | {"us": us, "of_copy_bw": row["at_copy_bw_us"] / us})
            print(f"{name}: gluon {case['programs']} programs, box {case['rows']} rows, depth {case['depth']}: "
                  f"{us:.2f} us ({row['at_copy_bw_us'] / us:.2f} of copy)", flush=True)
        res["sizes"].append(row)
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
