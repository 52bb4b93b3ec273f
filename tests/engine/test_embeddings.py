"""Embeddings (SamplingParams.pooling, LLM.embed): the prompt's final hidden states pooled by its
last token, their mean or its first token equal transformers' base model's (float32, CPU), with
prompts in chunks, beside generating sequences in the same steps, preempted, read from the prefix
cache (last token only), and across two tensor-parallel or pipeline ranks; the model folder's
sentence-transformers files choose the pooling."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from serve import LLM, SamplingParams
from serve.embeddings import Pooling, PoolingConfigError, model_pooling
from tests.engine.test_equal_transformers import make_prompts
from tests.models import hf_greedy

CPU = dict(dtype="float32", device="cpu")
POOLINGS = ("last", "mean", "cls")


def hf_embeddings(path, prompts: list[list[int]], how: str, normalize: bool = True) -> list[np.ndarray]:
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model(input_ids=torch.tensor([p])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[how].numpy()
            out.append(v / np.linalg.norm(v) if normalize else v)
    return out


def check_close(got, want, atol: float = 2e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(3)  # 1 to 50 tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("how", POOLINGS)
def test_pooled_hidden_states_equal_transformers(tiny_models, prompts, arch, how):
    want = hf_embeddings(tiny_models[arch], prompts, how)
    # chunks of at most 8 tokens, three sequences a step: the mean is summed over several steps
    llm = LLM(str(tiny_models[arch]), num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=3, **CPU)
    check_close([o.embedding for o in llm.embed(prompts, pooling=how)], want)
    raw = llm.embed(prompts[-1:], pooling=how, normalize=False)[0].embedding
    check_close([raw], hf_embeddings(tiny_models[arch], prompts[-1:], how, normalize=False), atol=1e-4)
    cut = llm.embed(prompts[-1:], pooling=how, dimensions=8)[0].outputs.embedding
    assert len(cut) == 8 and np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-5)
    core = llm.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    core.scheduler.check_integrity()


def test_triton_backend_pools_the_same(tiny_models, prompts):
    """The Triton op set (interpreted on the CPU): the hidden states its kernels leave pool as transformers'."""
    pytest.importorskip("triton")
    path = tiny_models["qwen3"]
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=16, backend="triton", **CPU)
    for how in ("last", "mean"):
        check_close([o.embedding for o in llm.embed(prompts[3:], pooling=how)], hf_embeddings(path, prompts[3:], how),
                    atol=1e-4)


def test_embeddings_beside_generation_in_the_same_steps(tiny_models, prompts):
    """One call mixes generating and embedding sequences: the tokens stay transformers', the vectors too."""
    path = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    params = [greedy, SamplingParams(max_tokens=1, temperature=0.0, pooling="mean")] * 3
    llm = LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=16, **CPU)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[::2]] == hf_greedy(path, prompts[::2], 6)
    assert all(o.embedding is None for o in outs[::2])
    pooled = [np.frombuffer(o.embedding, dtype=np.float32) for o in outs[1::2]]
    check_close([v / np.linalg.norm(v) for v in pooled], hf_embeddings(path, prompts[1::2], "mean"))


def test_preempted_and_cached_prompts(tiny_models, prompts):
    path = tiny_models["qwen2"]
    # 8 blocks of 16 for four generating sequences and six prompts to embed in chunks of 8: the
    # generating ones grow and take blocks from prompts still being computed, which start again
    llm = LLM(str(path), num_kv_blocks=8, max_num_batched_tokens=8, **CPU)
    core = llm.engine.core
    for how in ("mean", "last"):
        for q in prompts[:4]:
            core.add_request(q, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        embedded = [core.add_request(q, SamplingParams(max_tokens=1, temperature=0.0, pooling=how))
                    for q in prompts[3:] * 2]
        got = {}
        while core.has_unfinished():
            got.update((out.seq_id, out.embedding) for out in core.step() if out.embedding is not None)
        assert any(seq.num_preemptions for seq in embedded)
        vectors = [np.frombuffer(got[seq.seq_id], dtype=np.float32) for seq in embedded]
        check_close([v / np.linalg.norm(v) for v in vectors], hf_embeddings(path, prompts[3:] * 2, how))
    # the prefix cache: a repeated prompt's last token reads its earlier blocks, the mean computes all of it
    roomy = LLM(str(path), num_kv_blocks=256, **CPU)
    long = prompts[-1]
    for how, cached in (("last", True), ("mean", False)):
        first = roomy.embed([long], pooling=how)[0].embedding
        core = roomy.engine.core
        seq = core.add_request(long, SamplingParams(max_tokens=1, temperature=0.0, pooling=how))
        while core.has_unfinished():
            core.step()
        assert (seq.num_cached_tokens > 0) == cached
        again = roomy.embed([long], pooling=how)[0].embedding
        check_close([again], [np.asarray(first)], atol=1e-6)


@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_two_ranks_embed_as_one(tiny_models, prompts, parallel):
    path = tiny_models["llama"]
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=16, **CPU)
    size = {"tensor_parallel_size": 2} if parallel == "tensor" else {"pipeline_parallel_size": 2}
    with LLM(str(path), **kw, **size) as llm:
        for how in POOLINGS:
            check_close([o.embedding for o in llm.embed(prompts, pooling=how)], hf_embeddings(path, prompts, how))


def test_the_model_folder_chooses_the_pooling(tmp_path):
    assert model_pooling(None) == model_pooling(tmp_path) == Pooling("last", True)

    def write(pooling: dict | None, *modules: str) -> None:
        listed = [{"idx": i, "name": str(i), "path": f"{i}_{kind}" if kind != "Transformer" else "",
                   "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]
        (tmp_path / "modules.json").write_text(json.dumps(listed))
        if pooling is not None:
            (tmp_path / "1_Pooling").mkdir(exist_ok=True)
            (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))

    write({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, "Transformer", "Pooling", "Normalize")
    assert model_pooling(tmp_path) == Pooling("mean", True)
    write({"pooling_mode_lasttoken": True}, "Transformer", "Pooling")
    (tmp_path / "config.json").write_text("{}")
    assert model_pooling(tmp_path / "config.json") == Pooling("last", False)  # --model may name the config
    write({"pooling_mode_cls_token": True}, "Transformer", "Pooling", "Dense", "Normalize")
    with pytest.raises(PoolingConfigError, match="Dense"):
        model_pooling(tmp_path)
    write({"pooling_mode_max_tokens": True}, "Transformer", "Pooling")
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        model_pooling(tmp_path)


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, pooling="max")
    with pytest.raises(ValueError, match="max_tokens 1"):
        SamplingParams(max_tokens=4, pooling="last")


@pytest.mark.gpu
def test_on_the_gpu(tiny_models, prompts):
    """On a GPU, eager steps, whole-step graphs and piecewise graphs (a 16-token budget chunks the
    prompts beside generating sequences) pool the same rows: float32 vectors equal transformers'; bfloat16
    ones point the same way (cosine > 0.99)."""
    path = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for how in POOLINGS:
        want = hf_embeddings(path, prompts, how)
        for dtype, graphs in (("float32", "none"), ("float32", "step"), ("float32", "piecewise"), ("bfloat16", "step")):
            with LLM(str(path), device="cuda", dtype=dtype, enforce_eager=graphs == "none", num_kv_blocks=256,
                     max_num_batched_tokens=16, step_graph_max_tokens=0 if graphs == "piecewise" else 2304) as llm:
                params = [greedy, SamplingParams(max_tokens=1, temperature=0.0, pooling=how)] * 3
                outs = llm.generate(prompts + prompts, params * 2)
                got = [np.frombuffer(o.embedding, dtype=np.float32) for o in outs[1::2]]
                got = [v / np.linalg.norm(v) for v in got]
                runner = llm.engine.runner
                assert graphs != "step" or runner.steps.num_runs > 0
                assert graphs != "piecewise" or runner.piecewise.num_runs > 0
            rows = [w for i, w in enumerate(want * 2) if i % 2 == 1]
            if dtype == "float32":
                check_close(got, rows, atol=1e-4)
            else:
                assert min(float(np.dot(g, w)) for g, w in zip(got, rows)) > 0.99


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_a_base_model_checkpoint_serves_embeddings(tiny_models, tmp_path, arch):
    """Embedding models ship the base model alone (e5-mistral's MistralModel, Qwen3Model): tensors
    named without "model.", no LM head. Served as the model with the head tied to the embedding."""
    import shutil

    import transformers

    base = transformers.AutoModel.from_pretrained(str(tiny_models[arch]), dtype=torch.float32)
    folder = tmp_path / "base"
    base.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_models[arch] / name).exists():
            shutil.copy(tiny_models[arch] / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(base).__name__]
    llm = LLM(str(folder), num_kv_blocks=64, **CPU)
    assert llm.engine.model_config.headless
    prompts = make_prompts(5)
    check_close([o.embedding for o in llm.embed(prompts)], hf_embeddings(folder, prompts, "last"))
    assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids) == 3
