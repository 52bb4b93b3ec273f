"""kernels/penalties.py against kernels/reference.py penalize_rows: bit for bit, rows of the batch
and slots of the buffers in any order, vocabularies that end inside a block."""
import pytest
import torch

from kernels import reference
from kernels.penalties import penalize_rows
from tests.kernels.util import DEVICE, gpu


def _case(n, vocab, slots, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 4
    x[:, :3] = float("-inf")  # banned tokens (min_tokens) stay banned
    counts = torch.randint(0, 3, (slots, vocab), generator=g).float() * (torch.rand(slots, vocab, generator=g) < 0.2)
    prompt = torch.rand(slots, vocab, generator=g) < 0.1
    r = max(1, n - 2)
    rows = torch.randperm(n, generator=g)[:r]
    at = torch.randperm(slots, generator=g)[:r]
    params = torch.stack([torch.rand(r, generator=g) * 1.5 + 0.5, torch.rand(r, generator=g) * 4 - 2,
                          torch.rand(r, generator=g) * 4 - 2], dim=1)
    params[0] = torch.tensor([1.0, 0.0, 0.0])  # a row whose penalties ask for nothing
    return [t.to(DEVICE) for t in (x, rows, at, params, counts, prompt)]


@pytest.mark.parametrize("n,vocab,slots", [(3, 100, 4), (5, 2500, 8), (1, 17, 2)])
def test_equals_reference_bit_for_bit(n, vocab, slots):
    x, rows, at, params, counts, prompt = _case(n, vocab, slots, seed=vocab)
    want = x.cpu().clone()
    reference.penalize_rows(want, rows.cpu(), at.cpu(), params.cpu(), counts.cpu(), prompt.cpu())
    penalize_rows(x, rows, at, params, counts, prompt)
    assert torch.equal(x.cpu(), want)
    untouched = [i for i in range(n) if i not in rows.tolist()]
    assert torch.equal(want[untouched], _case(n, vocab, slots, seed=vocab)[0].cpu()[untouched])


@gpu
def test_real_vocabulary_on_the_gpu():
    x, rows, at, params, counts, prompt = _case(64, 151_936, 80, seed=1)
    want = x.cpu().clone()
    reference.penalize_rows(want, rows.cpu(), at.cpu(), params.cpu(), counts.cpu(), prompt.cpu())
    penalize_rows(x, rows, at, params, counts, prompt)
    assert torch.equal(x.cpu(), want)
