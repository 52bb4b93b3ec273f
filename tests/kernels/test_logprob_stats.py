"""kernels/logprob_stats.py against kernels/reference.py logprob_stats: ranks exact, log-sum-exp and
logprobs to float32 rounding, bf16 and float32 rows, vocabularies that end inside a block, ties
with the target, banned (-inf) tokens."""
import pytest
import torch

from kernels import reference
from kernels.logprob_stats import logprob_stats
from tests.kernels.util import DEVICE, gpu


def _case(rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    x[0, :5] = float("-inf")
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = 2  # a banned token: logprob -inf, ranked after every finite one
    if rows > 1:
        x[1, 7] = x[1, targets[1]]  # a tie with the target does not rank above it
    return x.to(DEVICE), targets.to(DEVICE)


@pytest.mark.parametrize("rows,vocab", [(3, 100), (5, 4100), (1, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_reference(rows, vocab, dtype):
    x, targets = _case(rows, vocab, dtype, seed=vocab)
    lse, chosen, rank = logprob_stats(x, targets)
    want_lse, want_chosen, want_rank = reference.logprob_stats(x.cpu(), targets.cpu())
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(chosen.cpu(), want_chosen, rtol=1e-6, atol=1e-5)
    assert torch.equal(rank.cpu(), want_rank)
    assert chosen[0].item() == float("-inf") and rank[0].item() == vocab - 4


@gpu
def test_real_vocabulary_on_the_gpu():
    x, targets = _case(256, 151_936, torch.bfloat16, seed=1)
    lse, chosen, rank = logprob_stats(x, targets)
    want_lse, want_chosen, want_rank = reference.logprob_stats(x.cpu(), targets.cpu())
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(chosen.cpu(), want_chosen, rtol=1e-6, atol=1e-4)
    assert torch.equal(rank.cpu(), want_rank)
