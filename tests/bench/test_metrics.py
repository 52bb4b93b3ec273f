from __future__ import annotations

import pytest

from bench.client import RequestResult, _ChunkCounter
from bench.metrics import SLO, Distribution, compute_metrics


def result(chunks, e2el, output_tokens=None, success=True, error=""):
    return RequestResult(index=0, prompt_len=10, success=success, error=error, chunks=chunks, e2el_s=e2el,
                         output_tokens=sum(k for _, k in chunks) if output_tokens is None else output_tokens)


def test_itl_attribution_splits_multi_token_chunks():
    r = result([(0.05, 2), (0.07, 1), (0.10, 3)], e2el=0.11)
    assert r.ttft_s == 0.05
    # the first chunk's second token has no gap; 1 token after 20 ms; 3 tokens over 30 ms
    assert r.itls_s() == pytest.approx([0.02, 0.01, 0.01, 0.01])
    assert r.tpot_s == pytest.approx((0.11 - 0.05) / 5)


def test_single_token_has_no_tpot():
    assert result([(0.05, 1)], e2el=0.05).tpot_s is None


def test_distribution():
    d = Distribution.of_seconds([0.001 * i for i in range(1, 101)])
    assert d.mean == pytest.approx(50.5)
    assert d.median == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert Distribution.of_seconds([]) == Distribution(None, None, None, None)


def test_compute_metrics_counts_and_goodput():
    ok_fast = result([(0.01, 1), (0.02, 1)], e2el=0.02)
    ok_slow = result([(0.50, 1), (0.60, 1)], e2el=0.6)
    failed = result([], e2el=0.0, success=False, error="HTTP 500: boom")
    m = compute_metrics([ok_fast, ok_slow, failed], duration_s=2.0, slo=SLO(ttft_ms=100))
    assert (m.completed, m.failed) == (2, 1)
    assert m.errors == {"HTTP 500: boom": 1}
    assert m.total_output_tokens == 4 and m.total_input_tokens == 20
    assert m.output_throughput == 2.0 and m.request_throughput == 1.0 and m.total_token_throughput == 12.0
    assert m.goodput == 0.5  # only the fast one meets ttft <= 100 ms
    assert compute_metrics([ok_fast], 1.0).goodput is None


def test_slo_parse():
    slo = SLO.parse(["ttft:500", "tpot:50", "e2el:2000"])
    assert slo == SLO(ttft_ms=500, tpot_ms=50, e2el_ms=2000)
    assert SLO.parse(None) is None
    for bad in (["ttft"], ["foo:1"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_chunk_token_counting_sources():
    c = _ChunkCounter()
    assert c.count({"choices": [{"text": "ab", "token_ids": [1, 2, 3]}]}) == 3
    assert c.count({"choices": [{"text": "a"}], "usage": {"completion_tokens": 2}}) == 2
    assert c.count({"choices": [{"text": "b"}], "usage": {"completion_tokens": 5}}) == 3
    assert _ChunkCounter().count({"choices": [{"text": "a", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    assert _ChunkCounter().count({"choices": [{"text": "a"}]}) == 1
    assert _ChunkCounter().count({"choices": [{"text": ""}]}) == 0
    assert _ChunkCounter().count({"choices": [], "usage": {"completion_tokens": 9}}) == 0
