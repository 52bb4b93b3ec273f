from __future__ import annotations

import numpy as np
import pytest

from bench.workload import WorkloadSpec, arrival_offsets, length_range, make_requests


def test_fixed_lengths_and_vocab():
    reqs = make_requests(WorkloadSpec(num_prompts=5, input_len=16, output_len=4, vocab_size=100, seed=1))
    assert [len(r.prompt) for r in reqs] == [16] * 5
    assert [r.output_len for r in reqs] == [4] * 5
    assert all(0 <= t < 100 for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt) for r in reqs}) == 5


def test_range_ratio_bounds():
    spec = WorkloadSpec(num_prompts=200, input_len=100, output_len=10, range_ratio=0.5, seed=3)
    reqs = make_requests(spec)
    assert length_range(100, 0.5) == (50, 150)
    assert all(50 <= len(r.prompt) <= 150 for r in reqs)
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 10


def test_shared_prefix():
    reqs = make_requests(WorkloadSpec(num_prompts=4, input_len=20, output_len=2, shared_prefix_len=8, seed=0))
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 1
    assert len({tuple(r.prompt[8:]) for r in reqs}) == 4
    assert all(len(r.prompt) == 20 for r in reqs)


def test_seeded():
    a = make_requests(WorkloadSpec(num_prompts=3, input_len=8, output_len=2, seed=7))
    b = make_requests(WorkloadSpec(num_prompts=3, input_len=8, output_len=2, seed=7))
    c = make_requests(WorkloadSpec(num_prompts=3, input_len=8, output_len=2, seed=8))
    assert a == b and a != c


@pytest.mark.parametrize("kwargs", [dict(range_ratio=1.0), dict(shared_prefix_len=9), dict(num_prompts=0),
                                    dict(output_len=0)])
def test_bad_spec(kwargs):
    with pytest.raises(ValueError):
        WorkloadSpec(**{"num_prompts": 2, "input_len": 8, "output_len": 2, **kwargs})


def test_poisson_arrivals_reproducible():
    a = arrival_offsets(2000, 10.0, seed=5)
    assert a == arrival_offsets(2000, 10.0, seed=5)
    assert a != arrival_offsets(2000, 10.0, seed=6)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)  # 1 / rate
    assert gaps.std() == pytest.approx(0.1, rel=0.15)  # exponential: std == mean


def test_no_rate_means_all_at_once():
    assert arrival_offsets(3, None, 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


# --- text prompts (--prompt-format text) ------------------------------------------------------------

def _tokenizer(tmp_path, bos: bool = False):
    """The tests' tiny byte-level BPE tokenizer (tests/models.py); bos: one that starts every encode
    with <|im_start|>, as Llama's add a BOS."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tests.models import build_tokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    if bos:
        start = tok.convert_tokens_to_ids("<|im_start|>")
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", start)])
        assert tok.encode("a")[0] == start
    return tok


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("kwargs", [dict(input_len=24), dict(input_len=1), dict(input_len=2),
                                    dict(input_len=100, range_ratio=0.5), dict(input_len=64, shared_prefix_len=32)])
def test_text_prompts_tokenize_to_the_request_length(tmp_path, bos, kwargs):
    """What the server counts (tokenizer.encode, special tokens added) is the prompt length asked for,
    and prompt_tokens says so; random ids of this small vocabulary (unknown ids past its 376 tokens,
    special ones, bytes of split characters) decode to text that re-encodes to other counts."""
    from bench.workload import as_text

    tok = _tokenizer(tmp_path, bos)
    ids = make_requests(WorkloadSpec(num_prompts=60, output_len=2, vocab_size=384, seed=2, **kwargs))
    texts = as_text(ids, tok)
    assert all(isinstance(t.prompt, str) for t in texts)
    assert [len(tok.encode(t.prompt)) for t in texts] == [len(r.prompt) for r in ids]
    assert [t.prompt_tokens for t in texts] == [len(r.prompt) for r in ids]
    assert [t.num_prompt_tokens for t in texts] == [len(r.prompt) for r in ids]
    assert [t.output_len for t in texts] == [r.output_len for r in ids]
    assert texts == as_text(ids, tok)  # seeded


def test_text_prompts_count_what_the_server_counts_when_they_cannot_fit(tmp_path, monkeypatch):
    """A text that does not come right within the rounds keeps its own count: prompt_tokens is
    always what the server's tokenizer reads."""
    import bench.workload as workload

    tok = _tokenizer(tmp_path)
    monkeypatch.setattr(workload, "MAX_FIT_ROUNDS", 0)  # no adjusting: the decoded ids as they are
    ids = make_requests(WorkloadSpec(num_prompts=60, input_len=24, output_len=2, vocab_size=384, seed=2))
    texts = workload.as_text(ids, tok)
    counts = [len(tok.encode(t.prompt)) for t in texts]
    assert [t.prompt_tokens for t in texts] == counts
    assert counts != [24] * 60  # this vocabulary's decoded ids seldom re-encode to as many
