"""The model's generation_config.json sets the sampling fields a request leaves out (vLLM's
`--generation-config auto`); a request's own values win; `vllm` keeps pagedserve's defaults."""
import json
import shutil

import pytest

from serve import LLM, SamplingParams
from serve.generation_config import sampling_defaults
from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
             "repetition_penalty": 1.05, "max_new_tokens": 2048}


@pytest.fixture()
def model_with_defaults(tiny_models, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], path)
    (path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return path


def test_the_sampling_fields_are_read(model_with_defaults, tmp_path):
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert sampling_defaults("auto", model_with_defaults) == want
    assert sampling_defaults("auto", model_with_defaults / "config.json") == want
    assert sampling_defaults(str(model_with_defaults), None) == want
    assert sampling_defaults("vllm", model_with_defaults) == {}
    assert sampling_defaults("auto", tmp_path) == {} and sampling_defaults("auto", None) == {}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        sampling_defaults("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="generation_config.json: .*top_p"):
        sampling_defaults("auto", tmp_path)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        ServerConfig(generation_config=str(tmp_path / "nowhere"))


def test_requests_take_the_models_defaults_and_override_them(model_with_defaults):
    engine = build(model_with_defaults)
    with ServerThread(engine) as srv:
        planner = srv.state.planner
        from serve.protocol import ChatCompletionRequest, CompletionRequest

        plan = planner.completion(CompletionRequest(model="m", prompt="Hello", max_tokens=4))
        p = plan.params[0]
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.7, 0.8, 20, 1.05, 0.0)
        chat = planner.chat(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                  temperature=0, top_k=-1, top_p=1.0, repetition_penalty=1.0))
        p = chat.params[0]
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 1.0, -1, 1.0)
        # over HTTP: left out, the model's temperature; given, the request's
        body = {"model": srv.state.model_name, "prompt": "Hello", "max_tokens": 6, "seed": 3}
        sampled = srv.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        again = srv.http.post("/v1/completions", json={**body, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                       "repetition_penalty": 1.05}).json()["choices"][0]["text"]
        assert sampled == again
    with ServerThread(build(model_with_defaults), ServerConfig(generation_config="vllm", shutdown_timeout_s=1.0)) as srv:
        from serve.protocol import CompletionRequest

        p = srv.state.planner.completion(CompletionRequest(model="m", prompt="Hello", max_tokens=4)).params[0]
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, -1, 1.0)


def test_offline_generate_without_params_takes_them(tiny_models, tmp_path):
    path = tmp_path / "greedy"
    shutil.copytree(tiny_models["llama"], path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 2}))
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.defaults == {"temperature": 0.0}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0))]
    assert [o.token_ids for o in llm.generate(prompts)] == greedy
    assert LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, generation_config="vllm").defaults == {}
