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
