"""The engine's Triton op set, run by the Triton interpreter on the CPU, against the torch path."""
import pytest

from serve import LLM, SamplingParams

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["qwen3"])
def test_triton_backend_equals_reference_float32(tiny_models, arch):
    prompts = [[5, 6, 7], [9] * 20, list(range(10, 47))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = LLM(str(tiny_models[arch]), device="cpu", dtype="float32", num_kv_blocks=32).generate(prompts, params)
    tri = LLM(str(tiny_models[arch]), device="cpu", dtype="float32", num_kv_blocks=32, backend="triton",
              max_num_batched_tokens=24).generate(prompts, params)  # chunked: mixed decode + prefill steps
    assert [o.token_ids for o in tri] == [o.token_ids for o in ref]


def test_warmup_writes_nowhere(tiny_models):
    """The start-up warm-up (run on GPUs) runs mixed steps with slots -1: the pages stay as they
    were and the output afterwards equals the reference's."""
    prompts = [[5, 6, 7], list(range(10, 47))]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", num_kv_blocks=16).generate(prompts, params)
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", num_kv_blocks=16, backend="triton", max_num_seqs=2)
    runner = llm.engine.runner
    runner.pool.kv.normal_()
    before = runner.pool.kv.clone()
    runner.warmup()  # 1 decode x chunks of 16, 32, 64; 2 decodes x 16; decode-only steps of 1 and 2 (no graphs)
    assert runner.pool.kv.equal(before)
    runner.pool.kv.zero_()
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ref]
