"""kernels/copy_pages.py against kernels/reference.py: pages land in other block ids of a pool of
another size, the other blocks stay, odd word counts are masked; bad shapes raise."""
import pytest
import torch

from kernels import reference as ref
from kernels.copy_pages import CHUNK, copy_pages
from tests.kernels.util import DEVICE, gpu


def _case(groups, src_blocks, dst_blocks, words, dtype=torch.int64, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**40, 2**40, (groups, src_blocks, words), generator=g).to(dtype).to(device)
    dst = torch.randint(-2**40, 2**40, (groups, dst_blocks, words), generator=g).to(dtype).to(device)
    return src, dst


@pytest.mark.parametrize("words", [8, CHUNK + 24])
def test_equals_reference(words):
    src, dst = _case(3, 7, 5, words)
    sb = torch.tensor([6, 0, 3], dtype=torch.int32, device=src.device)
    db = torch.tensor([1, 4, 0], dtype=torch.int32, device=src.device)
    want = dst.clone()
    ref.copy_pages(src, want, sb, db)
    copy_pages(src, dst, sb, db)
    assert torch.equal(dst, want)
    assert torch.equal(dst[:, [2, 3]], want[:, [2, 3]])


def test_bad_shapes_raise():
    src, dst = _case(2, 4, 4, 8)
    idx = torch.tensor([0], device=src.device)
    with pytest.raises(ValueError):
        copy_pages(src, dst[:1], idx, idx)
    with pytest.raises(ValueError):
        copy_pages(src, dst, idx, torch.tensor([0, 1], device=src.device))


@gpu
def test_llama_pages_on_the_gpu():
    src, dst = _case(64, 300, 200, 4096, device="cuda")  # 32 layers x K/V, 32 KiB pages
    sb = torch.randperm(300, device="cuda")[:48]
    db = torch.randperm(200, device="cuda")[:48]
    want = dst.clone()
    ref.copy_pages(src, want, sb, db)
    copy_pages(src, dst, sb, db)
    assert torch.equal(dst, want)
