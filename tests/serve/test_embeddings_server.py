"""POST /v1/embeddings through the unmodified openai client: the offline engine's vectors (LLM.embed),
as floats or base64, cut to `dimensions`, normalized or not; through the engine process too; a 400
that names the field for what it can't serve, and a model whose sentence-transformers files ask
for a projection it does not have is refused rather than answered wrongly."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest

from serve.llm import LLM
from tests.serve.helpers import ServerThread, build, engine_config

TEXTS = ["Hello there", "The capital of France is a city with many bridges " * 6, "1 2 3"]


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM.from_config(engine_config(model_dir))
    return llm, [o.embedding for o in llm.embed(TEXTS)]


def embed(base_url: str, **body):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    return client.embeddings.create(model=None, **body)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_vectors_are_the_offline_engines(request, offline, where):
    srv = request.getfixturevalue("server" if where == "thread" else "process_server")
    llm, want = offline
    r = embed(srv.base_url, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    for d, w in zip(r.data, want):
        np.testing.assert_allclose(d.embedding, w, atol=1e-5)
    tokens = sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    # token ids, base64 (little-endian float32, as OpenAI sends it), dimensions, normalize
    ids = llm.tokenizer.encode(TEXTS[1])
    raw = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": [ids], "encoding_format": "base64"}).json()
    got = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, want[1], atol=1e-5)
    cut = embed(srv.base_url, input=TEXTS[1], dimensions=8).data[0].embedding
    np.testing.assert_allclose(cut, np.asarray(llm.embed(TEXTS[1:2], dimensions=8)[0].embedding), atol=1e-5)
    plain = embed(srv.base_url, input=TEXTS[1], extra_body={"normalize": False}).data[0].embedding
    assert np.linalg.norm(plain) != pytest.approx(1.0)
    np.testing.assert_allclose(np.asarray(plain) / np.linalg.norm(plain), want[1], atol=1e-5)
    srv.wait_idle()


@pytest.mark.parametrize("body,param,says", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [[1, 2, 10**6]]}, "input", "vocabulary"),
    ({"input": "x " * 5000}, "input", "context length"),
    ({"input": "hi", "dimensions": 10**6}, "dimensions", "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": "hi", "model": "other"}, "model", "not served"),
])
def test_what_it_cannot_serve_is_a_clear_error(server, body, param, says):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    server.wait_idle()


def test_too_many_inputs(model_dir):
    from serve.server_config import ServerConfig

    with ServerThread(build(model_dir), ServerConfig(max_waiting_requests=4, shutdown_timeout_s=1.0)) as srv:
        r = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": ["a"] * 5}, timeout=30)
        assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]
        assert len(embed(srv.base_url, input=["a"] * 4).data) == 4


def test_a_projection_it_does_not_have_is_refused(model_dir, tmp_path):
    folder = tmp_path / "with-dense"
    shutil.copytree(model_dir, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with ServerThread(build(folder)) as srv:
        r = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400 and "Dense" in r.json()["error"]["message"]
        ok = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # generation is served as before


def same_embeddings(url: str, reference_url: str) -> None:
    """The server at url embeds TEXTS as the reference server does (each served by one engine whole)."""
    want, got = (httpx.post(f"{u}/v1/embeddings", json={"input": TEXTS}, timeout=60).json() for u in (reference_url, url))
    np.testing.assert_allclose([d["embedding"] for d in got["data"]], [d["embedding"] for d in want["data"]], atol=1e-5)
    assert got["usage"] == want["usage"]


def test_score_and_rerank_are_cosine_similarities(server, offline):
    """vLLM's /v1/score and the Jina/Cohere /v1/rerank with an embedding model: the cosine of the
    normalized embeddings, LLM.embed's."""
    import numpy as np

    llm, _ = offline
    query, docs = "Which city is the capital of France?", ["Paris is the capital.", "Bananas are yellow.", "1 2 3"]
    vectors = [np.asarray(o.embedding) for o in llm.embed([query] + docs)]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    r = httpx.post(f"{server.base_url}/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=1e-5)
    pairs = httpx.post(f"{server.base_url}/v1/score", json={"text_1": docs, "text_2": docs[::-1]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [float(vectors[1 + i] @ vectors[3 - i]) for i in range(3)], atol=1e-5)
    ranked = httpx.post(f"{server.base_url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2},
                        timeout=60).json()
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in ranked["results"]] == best
    assert [x["document"]["text"] for x in ranked["results"]] == [docs[i] for i in best]
    np.testing.assert_allclose([x["relevance_score"] for x in ranked["results"]], [want[i] for i in best], atol=1e-5)
    assert ranked["usage"]["total_tokens"] == sum(len(llm.tokenizer.encode(t)) for t in [query] + docs)
    bad = httpx.post(f"{server.base_url}/v1/score", json={"text_1": docs[:2], "text_2": docs}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    server.wait_idle()
