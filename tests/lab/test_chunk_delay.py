"""lab/chunk_delay.py: a client's chunks lined up with the API's and the engine's traces."""
from __future__ import annotations

import pytest

from lab.chunk_delay import analyse


def test_hops_and_the_largest_gap():
    # the engine sends a step every 10 ms (one 30 ms late), the API takes each in 1 ms later and
    # hands it to the streams in 0.5 ms, the client reads it 2 ms after that
    sent = [1000.0 + 10 * i for i in range(10)]
    sent[5:] = [s + 20 for s in sent[5:]]
    # the request: sent at 990 ms, in the API 0.75 ms later, at its add 2 ms after the send, taken in by the
    # engine 0.5 ms after that
    engine = [{"t0": s - 5, "t_sent": s, "decodes": 1} for s in sent] + [{"added": [7], "t0": 992.5}]
    api = [{"t0": s + 1, "t_end": s + 1.5, "outputs": 1} for s in sent]
    api.append({"request": 7, "received": 990.75, "t0": 992.0, "added": 993.0, "first": 1001.0, "t_end": 1111.5})
    chunks = [(s + 3.5 - 990.0) / 1e3 for s in sent]  # seconds after the request was sent
    bench = {"clock_start_s": 0.99, "requests": [{"start_s": 0.0, "chunk_s": chunks, "ttft_ms": 13.5}]}
    res = analyse(bench, engine, api)
    assert res["client_gap_ms"]["p50"] == pytest.approx(10.0) and res["client_gap_ms"]["max"] == pytest.approx(30.0)
    assert res["engine_to_api_ms"]["p50"] == pytest.approx(1.0)
    assert res["api_to_client_ms"]["p50"] == pytest.approx(2.0)
    big = res["largest_client_gaps"][-1]
    assert big["gap_ms"] == pytest.approx(30.0) and big["engine_gap_ms"] == pytest.approx(30.0)
    t = res["ttft"]
    assert t["client_to_api_add_ms"]["p50"] == pytest.approx(2.0)
    assert t["client_to_api_received_ms"]["p50"] == pytest.approx(0.75)
    assert t["api_received_to_add_ms"]["p50"] == pytest.approx(1.25)
    assert t["api_add_to_engine_took_ms"]["p50"] == pytest.approx(0.5)
    assert t["engine_took_to_api_ack_ms"]["p50"] == pytest.approx(0.5)
    assert t["api_add_to_first_token_ms"]["p50"] == pytest.approx(9.0)
    assert t["client_ms"]["p50"] == pytest.approx(13.5)
