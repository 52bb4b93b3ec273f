"""bench.baseline_hf on the CPU with a tiny model (the real runs are on the GPU)."""
from __future__ import annotations

import json

import pytest

from bench.baseline_hf import main

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
        "eos_token_id": 1, "bos_token_id": 0}


def test_static_batch_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "hf.json"
    code = main(["--model", str(tmp_path), "--device", "cpu", "--modes", "static", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "4", "--range-ratio", "0.25", "--batch-size", "2",
                 "--copy-bandwidth", "1", "--matmul-tflops", "1", "--result-json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    static = res["static"]
    assert static["error"] is None and static["num_requests"] == 3
    assert 9 <= static["output_tokens"] <= 15 and static["output_throughput"] > 0
    assert static["roofline_fraction"] == pytest.approx(static["output_throughput"]
                                                        / static["roofline_output_throughput"])
    assert "continuous" not in res


@pytest.mark.parametrize("argv", [["--model", "nope"], ["--model", "llama3-8b", "--batch-size", "0"],
                                  ["--model", "llama3-8b", "--copy-bandwidth", "3"]])
def test_bad_input(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench.baseline_hf: error:")


def test_bad_number_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "llama3-8b", "--num-prompts", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-prompts" in err[0]
