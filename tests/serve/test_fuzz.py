"""Fuzzing the HTTP API from its own OpenAPI schema: no input may produce a 5xx.

Two fuzzers: schemathesis (valid and invalid requests derived from the schema; skipped when it is
not installed) and a plain hypothesis one that throws arbitrary JSON at every schema field.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build

FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    # max_tokens capped low so that valid generated requests stay fast
    cfg = ServerConfig(max_tokens_limit=4, max_n=4, max_sequences_per_request=8, shutdown_timeout_s=1.0)
    with ServerThread(build(model_dir), cfg) as srv:
        yield srv


def check_no_server_error(status: int, text: str) -> None:
    assert status < 500, text
    if status >= 400:
        body = json.loads(text)
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_schemathesis_finds_no_5xx(fuzz_server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.generation.modes import GenerationMode

    import requests

    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    session = requests.Session()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=40, **FUZZ_SETTINGS)
        @given(case=schema.as_strategy(generation_mode=mode))
        def run(case) -> None:
            response = case.call(base_url=fuzz_server.base_url, session=session, timeout=30)
            check_no_server_error(response.status_code, response.text)

        run()
    fuzz_server.wait_idle()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


def request_fields(app, path: str) -> list[str]:
    spec = app.openapi()
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return list(spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


BASES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/v1/responses": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
         "/v1/embeddings": {"input": "hi"},
         "/v1/score": {"text_1": "hi", "text_2": ["a", "b"]},
         "/v1/rerank": {"query": "hi", "documents": ["a", "b"]}}


@pytest.mark.parametrize("path", list(BASES))
def test_arbitrary_json_in_every_field(fuzz_server, path):
    fields = request_fields(fuzz_server.app, path)

    @settings(max_examples=100, **FUZZ_SETTINGS)
    @given(changes=st.dictionaries(st.sampled_from(fields), JSON, min_size=1, max_size=4))
    def run(changes) -> None:
        r = fuzz_server.http.post(path, json={**BASES[path], **changes}, timeout=30)
        check_no_server_error(r.status_code, r.text)

    run()
    fuzz_server.wait_idle()
