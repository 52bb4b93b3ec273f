"""kernels/sample.py against kernels/reference.py sample_probs: where the draws may land and how
often, greedy rows, seeds."""
import pytest
import torch

from kernels import reference
from kernels.sample import sample_rows
from tests.kernels.util import DEVICE, gpu


def _params(n, temp, top_k, top_p, seed0=0, device=DEVICE):
    return (torch.full((n,), temp, dtype=torch.float32, device=device), torch.full((n,), top_k, dtype=torch.int32, device=device),
            torch.full((n,), top_p, dtype=torch.float32, device=device),
            torch.arange(seed0, seed0 + n, dtype=torch.int64, device=device))


def _frequencies(row, n, temp, top_k, top_p, block):
    x = row.repeat(n, 1).to(DEVICE)
    params = _params(n, temp, top_k, top_p)
    out = sample_rows(x, *params, block=block)
    want = reference.sample_probs(row.unsqueeze(0), *(p[:1].cpu() for p in params[:3]))[0]
    return torch.bincount(out.cpu(), minlength=row.numel()).double() / n, want


@pytest.mark.parametrize("temp,top_k,top_p", [(0.7, 6, 0.8), (1.3, 3, 1.0), (0.9, 6, 1.0)])
def test_draws_follow_the_nucleus(temp, top_k, top_p):
    """240 draws of one 6-token row, read in blocks of 4 (the interpreter is slow; the GPU test
    below draws 4,000): each token's frequency near its renormalized nucleus probability (fixed
    seeds, so the outcome is fixed too), none outside the nucleus."""
    row = torch.tensor([0.3, 1.2, -0.5, 0.9, 0.0, 1.0])
    freq, want = _frequencies(row, 240, temp, top_k, top_p, block=4)
    assert (freq[want == 0] == 0).all()
    assert (freq - want).abs().max() < 0.09, (freq, want)


@gpu
@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 40, 1.0), (0.7, 40, 0.8), (1.3, 5, 1.0), (0.9, 8, 0.6)])
def test_draws_follow_the_nucleus_closely_on_the_gpu(temp, top_k, top_p):
    row = torch.randn(40, generator=torch.Generator().manual_seed(7)) * 1.5
    freq, want = _frequencies(row, 4000, temp, top_k, top_p, block=16)
    assert (freq[want == 0] == 0).all()
    assert (freq - want).abs().max() < 0.03, (freq - want).abs().max()


def test_greedy_rows_and_degenerate_nuclei_take_the_first_largest():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    x[1, [7, 200]] = x[1].max() + 1  # a tie across blocks: the first wins
    x = x.to(DEVICE)
    temps = torch.tensor([0, 0, 5.0, 5.0, 0, 1.0], device=DEVICE)
    top_k = torch.tensor([300, 300, 1, 300, 300, 300], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1, 1, 1, 1e-6, 0.5, 1.0], dtype=torch.float32, device=DEVICE)
    out = sample_rows(x, temps, top_k, top_p, torch.arange(6, device=DEVICE), block=64)
    assert out[:5].tolist() == torch.argmax(x[:5].float(), dim=-1).tolist()
    assert out[1] == 7


def test_a_seed_fixes_the_draw():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 100, generator=g).to(DEVICE)
    temps, top_k, top_p, _ = _params(16, 1.0, 100, 0.95)
    a = sample_rows(x, temps, top_k, top_p, torch.arange(16, device=DEVICE))
    b = sample_rows(x, temps, top_k, top_p, torch.arange(16, device=DEVICE))
    c = sample_rows(x, temps, top_k, top_p, torch.arange(100, 116, device=DEVICE))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a row's draw depends on its own seed and logits, not on its batch mates
    assert torch.equal(sample_rows(x[5:9], temps[:4], top_k[:4], top_p[:4], torch.arange(5, 9, device=DEVICE)), a[5:9])


@pytest.mark.parametrize("parts", [2, 5])
def test_a_first_pass_split_into_parts_draws_as_one(parts):
    """The parts' maxima, sums and race winners combine into the one-program row's: same draws,
    greedy tokens (a tie across parts included) and a row of -inf logits."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 700, generator=g) * torch.linspace(0.5, 5, 12)[:, None]).to(torch.bfloat16)
    x[1, [30, 650]] = x[1].max() + 1
    x[2] = float("-inf")
    x = x.to(DEVICE)
    temps = torch.tensor([0, 0, 0, 0.7, 1.0, 1.3] * 2, device=DEVICE)
    top_k = torch.tensor([700, 700, 700, 20, 700, 3] * 2, dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1, 1, 1, 0.9, 0.95, 1.0] * 2, dtype=torch.float32, device=DEVICE)
    seeds = torch.arange(12, device=DEVICE)
    one = sample_rows(x, temps, top_k, top_p, seeds, block=64, parts=1)
    assert torch.equal(sample_rows(x, temps, top_k, top_p, seeds, block=64, parts=parts), one)
    assert one[:3].tolist() == [int(x[0].float().argmax()), 30, 0]


@gpu
def test_real_vocabulary_on_the_gpu():
    """64 rows of Qwen2.5's 151,936 logits in bf16: every draw inside its nucleus, greedy rows
    equal torch.argmax, and the draws spread (not all the top token)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 151936, generator=g) * 3).to(torch.bfloat16).cuda()
    temps, top_k, top_p, seeds = _params(64, 0.8, 151936, 0.95, device="cuda")
    temps[:8] = 0
    top_k[8:16] = 50
    out = sample_rows(x, temps, top_k, top_p, seeds).cpu()
    want = reference.sample_probs(x[:24].float().cpu(), temps[:24].cpu(), top_k[:24].cpu(), top_p[:24].cpu())
    assert all(want[i, int(out[i])] > 0 for i in range(24))
    assert out[:8].tolist() == torch.argmax(x[:8].float(), dim=-1).cpu().tolist()
    assert len(set(out[16:].tolist())) > 40
