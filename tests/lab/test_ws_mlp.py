"""lab/ws_mlp.py's work shares, and it and lab/tma_stream.py compile for an H100 on the CPU (Triton's own
ptxas, no GPU): the fused decode MLP at Qwen2.5-0.5B's shape, gate/up by fixed shares and from a shared
counter (TMA for x, the weights and h, wgmma, the acquire loads and the proxy fence before h is read by
TMA, no spills), and the TMA stream at its depths.
Their results on a GPU are checked by the lab scripts (bench/NOTES.md, 2026-11-28)."""
from __future__ import annotations

import pytest

from tests.kernels.util import run_outside_interpreter

pytest.importorskip("triton")


@pytest.mark.parametrize("H, I, programs, unit", [(896, 4864, 132, 16), (896, 4864, 132, 32), (576, 1536, 16, 16)])
def test_shares_cover_every_tile_once_and_balance(H, I, programs, unit):
    from lab.ws_mlp import BK, segments, shares
    s = shares(I, H, programs, unit)
    a, b = s[:programs + 1], s[programs + 1:]
    ka, kb, n_tiles = -(-H // BK), I // BK, H // (2 * unit)
    assert a[0] == b[0] == 0 and a[-1] == (I // unit) * ka and b[-1] == n_tiles * kb
    assert all(x <= y for x, y in zip(a, a[1:])) and all(x <= y for x, y in zip(b, b[1:]))
    assert max(y - x for x, y in zip(a, a[1:])) - min(y - x for x, y in zip(a, a[1:])) <= 1
    assert max(y - x for x, y in zip(b, b[1:])) - min(y - x for x, y in zip(b, b[1:])) <= 1
    seg = segments(I, H, programs, unit)
    offs, firsts = seg[:n_tiles + 1], seg[n_tiles + 1:]
    for j in range(n_tiles):
        runs = firsts[offs[j]:offs[j + 1]]
        # a tile's runs start at its first K step and at every program boundary inside it, in K order
        assert runs[0] == j * kb and runs == sorted(runs) and all(j * kb <= r < (j + 1) * kb for r in runs)
        assert set(runs[1:]) == {x for x in b if j * kb < x < (j + 1) * kb}


def test_shares_refuse_what_the_kernel_cannot_take():
    from lab.ws_mlp import shares
    with pytest.raises(AssertionError):
        shares(1536, 576, 132)  # a program's gate/up share shorter than one unit's K steps


SCRIPT = """
import torch
from tests.kernels import sm90_compile as s
from lab import tma_stream, ws_mlp as w
M, H, I = 64, 896, 4864
bf = torch.bfloat16
x, h = torch.zeros(M, H, dtype=bf), torch.empty(M, I, dtype=bf)
wgu, wd = torch.zeros(2 * I, H, dtype=bf), torch.zeros(H, I, dtype=bf)
xl = w.gl.NVMMASharedLayout.get_default_for([w.BM, w.BK], w.gl.bfloat16)
lay = w.gl.NVMMASharedLayout.get_default_for([16, w.BK], w.gl.bfloat16)
args = (w.GluonDescriptor(x, [M, H], [H, 1], [w.BM, w.BK], xl),
        w.GluonDescriptor(wgu, [2 * I, H], [H, 1], [16, w.BK], lay),
        w.GluonDescriptor(wd, [H, I], [I, 1], [16, w.BK], lay),
        w.GluonDescriptor(h, [M, I], [I, 1], [w.BM, w.BK], xl), h,
        torch.empty(M, H, dtype=bf), torch.zeros(28 * 38, M, 32), torch.zeros(2 * 304, M, 32),
        torch.zeros(28 + 38 + 304 + 2, dtype=torch.int32), torch.tensor(w.shares(I, H, 132), dtype=torch.int32),
        torch.tensor(w.segments(I, H, 132), dtype=torch.int32), torch.zeros(132, 8, dtype=torch.int64),
        torch.zeros(132, 305, dtype=torch.int32), M, I, H, 3)
for dynamic in (False, True):
    c = s.compile_sm90(w._ws_mlp_kernel, args, dict(KA=7, KB=38, STAGES=8, DYNAMIC=dynamic, num_warps=4))
    ptx = c.asm["ptx"]
    print("mlp", c.metadata.shared, s.sass_stats(c)["local"], "wgmma" in ptx, "cp.async.bulk.tensor" in ptx,
          "ld.acquire.gpu" in ptx, "fence.proxy.async.global" in ptx)
buf = torch.zeros(26_148_864 // 2 // 128, 128, dtype=bf)
for case in tma_stream.cases(132):
    grid, a, kw = tma_stream.launch_args(buf, torch.empty(case["programs"]), case["programs"], case["rows"],
                                         case["depth"], case["num_warps"])
    c = s.compile_sm90(tma_stream._stream_kernel, a, kw)
    print("stream", c.metadata.shared, s.sass_stats(c)["local"], "cp.async.bulk.tensor" in c.asm["ptx"], grid[0])
"""


def test_kernels_compile_for_sm90():
    from lab import ws_mlp
    if ws_mlp.gluon is None:
        pytest.skip("this Triton has no Gluon")
    out = run_outside_interpreter(["-c", SCRIPT], timeout=900)
    rows = [line.split() for line in out.splitlines() if line.startswith(("mlp", "stream"))]
    mlp = [r for r in rows if r[0] == "mlp"]
    assert len(mlp) == 2  # gate/up by fixed shares, and from a shared counter
    for r in mlp:
        assert r[2:] == ["0", "True", "True", "True", "True"] and int(r[1]) <= 227 * 1024, mlp
    streams = [r for r in rows if r[0] == "stream"]
    assert len(streams) >= 12
    for _, shared, local, tma, grid in streams:
        assert int(shared) <= 227 * 1024 and local == "0" and tma == "True" and int(grid) in (132, 264), streams
