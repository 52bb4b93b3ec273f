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
