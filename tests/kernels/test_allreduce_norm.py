"""The fused all-reduce + residual add + RMSNorm kernel's arithmetic, on one rank (no peers: the
sum is the rank's own rows), against kernels/fused.py's rms_norm, which the unfused path runs after
the all-reduce; rows beyond the program count go round the programs, and each call moves the
programs' epochs on and switches halves. Its exchanges between GPUs are tested on two of them
(tests/engine/test_peer_allreduce.py)."""
import pytest
import torch

from kernels import fused
from kernels.allreduce_norm import allreduce_add_norm, flag_bytes
from tests.kernels.util import DEVICE


def test_flags_hold_ready_per_program_and_rank_then_epochs():
    assert flag_bytes(3, 2) == 256 and flag_bytes(132, 2) == 1792 and flag_bytes(132, 4) == 2816


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,programs", [(5, 96, 4), (1, 1000, 8), (9, 64, 2)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_rank_equals_the_norm(rows, hidden, programs, dtype, with_residual):
    g = torch.Generator().manual_seed(rows)
    flags, half = flag_bytes(programs, 1), rows * hidden * dtype.itemsize
    buf = torch.zeros(flags + 2 * half, dtype=torch.uint8, device=DEVICE)
    flag_ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=DEVICE)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    for call in range(3):
        x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype).to(DEVICE)
        r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
        got, res = allreduce_add_norm(x, r, w, 1e-6, flag_ptrs + flags, flag_ptrs, 0, programs, half)
        want, want_res = fused.rms_norm(x, w, 1e-6, r) if with_residual else (fused.rms_norm(x, w, 1e-6), x)
        assert torch.equal(res, want_res)
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1.6e-2, rtol=1e-5)
        epochs = buf[:flags].view(torch.int32)[programs:2 * programs]
        assert epochs[:min(rows, programs)].tolist() == [call + 1] * min(rows, programs)
        assert not epochs[rows:].any()  # programs beyond the rows were not launched
        written = buf[flags + (call + 1) % 2 * half:][:half].view(dtype).view(rows, hidden)
        assert torch.equal(written, x)  # this call's rows, in the half of its epoch's parity
