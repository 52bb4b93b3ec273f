"""`serve kv-calc` (serve/kv_calc_cmd.py): text and JSON output, bad input, --measure without a GPU."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.presets import MODEL_PRESETS, resolve_model
from kvcache import calc
from kvcache.calc import plan
from kvcache.gpus import GiB, GPUMemory, resolve_gpu_memory
from serve import kv_calc_cmd as cmd

REPO = Path(__file__).resolve().parents[2]
H100 = resolve_gpu_memory("H100").total_bytes
JSON_KEYS = {"weight_bytes", "bytes_per_token", "bytes_per_block", "num_blocks", "max_tokens", "max_concurrent_seqs"}


def preset(name: str) -> ModelConfig:
    return resolve_model(name).config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve kv-calc")
    cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_text(capsys):
    assert cmd.run(parse("--model", "llama3-8b", "--gpu-memory", "H100")) == 0
    out = capsys.readouterr().out
    for needle in ("Llama-3-8B on H100-80GB", "weights (bfloat16)", "KV bytes per token", "131,072",
                   "2,097,152", "blocks", "tokens that fit", "sequences of 8,192 tokens", "fp8", "int8", "estimate"):
        assert needle in out
    p = cmd.plan_request(cmd.read_request(parse("--model", "llama3-8b", "--gpu-memory", "H100")))
    assert f"{p.num_blocks:,}" in out and f"{p.max_tokens:,}" in out
    # the graph reserve is the engine's own estimate, counted before the KV cache, with the prefill
    # graphs up to the largest mixed step the engine's rule allows on an H100's roofline
    tokens = cmd.graph_tokens(cmd.read_request(parse("--model", "llama3-8b", "--gpu-memory", "H100")), "bfloat16", 8192)
    assert 256 < tokens.piecewise < 8192 and tokens.step == tokens.piecewise  # one GPU: whole-step graphs as far
    assert p.graph_bytes == (calc.estimate_graph_bytes(preset("Llama-3-8B"), "bfloat16", 256, 8192, 16)
                             + calc.estimate_piecewise_graph_bytes(preset("Llama-3-8B"), "bfloat16", tokens.piecewise)
                             + calc.estimate_step_graph_bytes(256, 8192, 16, tokens.step)) > 0


@pytest.mark.parametrize("model,gpu,tp,capped,steps", [
    # the GPU sets the pace: prefill graphs up to the largest mixed step; under TP no step the host
    # paces, so no whole-step graphs
    ("llama3-70b", "H100", "2", True, 0),
    ("llama3-70b", "H200", "4", True, 0),
    # a 64-row forward under 4x the host's work a round: no prompt budget; under TP whole-step graphs
    # for the steps still that short
    ("llama3-8b", "H100", "4", False, (16, 2304)),
    ("qwen2.5-0.5b", "H100", "1", False, 2304),
    ("llama3-70b", "80GiB", "2", False, 2304),  # no known rates: the largest steps the configuration allows
])
def test_graph_tokens_follow_the_engines_rules(model, gpu, tp, capped, steps):
    req = cmd.read_request(parse("--model", model, "--gpu-memory", gpu, "-tp", tp))
    tokens = cmd.graph_tokens(req, "bfloat16", 8192)
    assert (256 < tokens.piecewise < 8192) if capped else tokens.piecewise == 8192
    assert (steps[0] <= tokens.step < steps[1]) if isinstance(steps, tuple) else tokens.step == steps


def test_cuda_device_names_find_their_gpu_preset():
    from kvcache.gpus import find_gpu_preset

    assert find_gpu_preset("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    assert find_gpu_preset("NVIDIA H200").rates is not None
    assert find_gpu_preset("NVIDIA Some Future GPU") is None


def test_cli_text_names_the_active_parameters_of_a_mixture_of_experts(capsys):
    assert cmd.run(parse("--model", "qwen3-30b-a3b", "--gpu-memory", "H100")) == 0
    assert "30.53B parameters, 3.35B active a token" in capsys.readouterr().out


def test_cli_json(capsys):
    argv = ("--model", "Llama-3-8B", "--gpu-memory", "80GiB", "--kv-cache-dtype", "fp8", "--max-model-len", "4k",
            "--memory-utilization", "0.85", "--json")
    assert cmd.run(parse(*argv)) == 0
    out = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= out.keys()
    graphs = (calc.estimate_graph_bytes(preset("Llama-3-8B"), "bfloat16", 256, 4096, 32)  # fp8 pages: block size 32
              + calc.estimate_piecewise_graph_bytes(preset("Llama-3-8B"), "bfloat16", 8192)
              + calc.estimate_step_graph_bytes(256, 4096, 32, 2304))
    p = plan(preset("Llama-3-8B"), 80 * GiB, 0.85, "fp8", max_model_len=4096, graph_bytes=graphs)
    assert {k: out[k] for k in JSON_KEYS} == {k: getattr(p, k) for k in JSON_KEYS}
    assert (out["bytes_per_token"], out["kv_cache_dtype"], out["max_model_len"]) == (67584, "fp8", 4096)
    assert [row["kv_cache_dtype"] for row in out["table"]] == ["bfloat16", "fp8", "int8"]
    assert out["activation_estimated"] is True


def test_cli_max_num_batched_tokens_changes_the_estimate(capsys):
    small = ("--model", "llama3-8b", "--gpu-memory", "H100", "--json", "--max-num-batched-tokens", "2048")
    assert cmd.run(parse(*small)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["activation_bytes"] == plan(preset("Llama-3-8B"), H100, max_num_batched_tokens=2048).activation_bytes
    assert out["activation_bytes"] < plan(preset("Llama-3-8B"), H100).activation_bytes


def test_cli_tensor_parallel(capsys):
    assert cmd.run(parse("--model", "llama3-70b", "--gpu-memory", "H100", "--tensor-parallel-size", "4", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tensor_parallel_size"], out["num_kv_heads_per_gpu"], out["bytes_per_token"]) == (4, 2, 81920)


def test_cli_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS[0].config_dict()))
    assert cmd.run(parse("--model", str(tmp_path), "--gpu-memory", "H100", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 131072


def test_cli_quantization_of_a_quantized_checkpoint_is_refused(tmp_path, capsys):
    cfg = MODEL_PRESETS[0].config_dict()
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cmd.run(parse("--model", str(tmp_path), "--gpu-memory", "H100", "--quantization", "fp8")) == 2
    err = capsys.readouterr().err
    assert "already" in err and "AWQ" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [
    ("--model", "nope", "--gpu-memory", "H100"),
    ("--model", "llama3-8b", "--gpu-memory", "80"),
    ("--model", "llama3-8b", "--gpu-memory", "Voodoo5"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--memory-utilization", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--memory-utilization", "lots"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "sixteen"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "12"),  # serve run refuses it too
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-model-len", "100k"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-num-batched-tokens", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-model-len", "-1"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--tensor-parallel-size", "-2"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--kv-cache-dtype", "fp4"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--dtype", "int4"),
    ("--gpu-memory", "H100"),
    ("--model", "llama3-8b"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert cmd.run(parse(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


def test_cli_weights_dont_fit_exits_1(capsys):
    assert cmd.run(parse("--model", "Llama-3-70B", "--gpu-memory", "H100")) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--tensor-parallel-size 2 or more" in err


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (131072, "128 KiB"), (1081344, "1.03 MiB"),
                                     (16_060_522_496, "14.96 GiB")])
def test_format_bytes(n, text):
    assert cmd.format_bytes(n) == text


def test_measure_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --measure runs (see the gpu-marked test)")
    assert cmd.run(parse("--measure", "--model", "llama3-8b")) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "serve.kv_calc_cmd", "--model", "qwen2.5-0.5b", "--gpu-memory", "L4", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert JSON_KEYS <= out.keys()
    assert out["bytes_per_token"] == 12288
    bad = subprocess.run([sys.executable, "-m", "serve.kv_calc_cmd", "--model", "qwen2.5-0.5b", "--gpu-memory", "lots"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_defaults_match_the_engine():
    cfg = EngineConfig()
    assert (calc.DEFAULT_MAX_NUM_BATCHED_TOKENS, calc.DEFAULT_MAX_NUM_SEQS, calc.DEFAULT_STEP_GRAPH_MAX_TOKENS) == (
        cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.step_graph_max_tokens)
    args = parse()
    assert args.block_size is None and float(args.memory_utilization) == cfg.gpu_memory_utilization
    for kv, block_size in (("auto", 16), ("bfloat16", 16), ("fp8", 32), ("int8", 32)):
        assert EngineConfig(kv_cache_dtype=kv).block_size == block_size
        assert calc.plan(preset("llama3-8b"), 80 * GiB, kv_cache_dtype=kv).block_size == block_size
        assert EngineConfig(kv_cache_dtype=kv, block_size=64).block_size == 64


def test_gpu_memory_defaults_to_this_machines_gpu(monkeypatch, capsys):
    """Without --gpu-memory the calculator sizes for the local GPU, named as the driver names it;
    with no GPU it asks for the flag in one line."""
    monkeypatch.setattr(cmd, "local_gpu", lambda: GPUMemory("NVIDIA H100 80GB HBM3", H100))
    req = cmd.read_request(parse("--model", "Llama-3-8B"))
    assert req.gpu_label == "NVIDIA H100 80GB HBM3" and req.gpu_memory_bytes == H100
    monkeypatch.setattr(cmd, "local_gpu", lambda: None)
    with pytest.raises(cmd.KVCalcInputError, match="--gpu-memory is required on a machine without a GPU"):
        cmd.read_request(parse("--model", "Llama-3-8B"))


def test_a_draft_model_takes_its_weights_graphs_and_a_pool_of_as_many_blocks(capsys, tmp_path):
    """--speculative-config's draft model (engine/draft.py): its weights and decode graphs on the
    first GPU, and each block holds the model's KV and the draft's (the engine's rule)."""
    argv = ("--model", "llama3-70b", "--gpu-memory", "H100", "-tp", "4", "--json")
    spec = json.dumps({"model": "Llama-3-8B", "num_speculative_tokens": 4})
    assert cmd.run(parse(*argv)) == 0
    alone = json.loads(capsys.readouterr().out)
    assert cmd.run(parse(*argv, "--speculative-config", spec)) == 0
    out = json.loads(capsys.readouterr().out)
    draft_weights = calc.weight_bytes_per_gpu(preset("Llama-3-8B"), "bfloat16", 1)
    draft_graphs = calc.estimate_graph_bytes(preset("Llama-3-8B"), "bfloat16", 256, 8192, 16)
    assert out["draft_weight_bytes"] == draft_weights and out["weight_bytes"] == alone["weight_bytes"] + draft_weights
    assert out["graph_bytes"] == alone["graph_bytes"] + draft_graphs
    assert out["draft_bytes_per_block"] == 2_097_152 and out["bytes_per_block"] == alone["bytes_per_block"]
    assert out["num_blocks"] == out["kv_cache_bytes"] // (out["bytes_per_block"] + out["draft_bytes_per_block"])
    assert out["kv_cache_bytes"] == alone["kv_cache_bytes"] - draft_weights - draft_graphs
    # the other KV dtypes' rows change both pools' pages
    fp8 = next(row for row in out["table"] if row["kv_cache_dtype"] == "fp8")
    p = cmd.plan_request(cmd.read_request(parse(*argv, "--speculative-config", spec))).with_kv_dtype("fp8", 32)
    assert fp8["num_blocks"] == p.num_blocks == p.kv_cache_bytes // (p.bytes_per_block + p.draft_bytes_per_block)
    # 32-token FP8 pages with a float32 scale per token and KV head: 32 layers x 8 heads x 32 x (128 + 4) x 2
    assert p.draft_bytes_per_block == 2_162_688
    assert cmd.run(parse(*argv[:-1], "--speculative-config", spec)) == 0
    text = capsys.readouterr().out
    assert "of which the draft model" in text and "first GPU, which holds the draft model" in text
    # with --quantization fp8 the draft's projections are FP8 too
    assert cmd.run(parse(*argv, "--speculative-config", spec, "--quantization", "fp8")) == 0
    fp8_draft = json.loads(capsys.readouterr().out)["draft_weight_bytes"]
    assert draft_weights / 2 < fp8_draft < draft_weights * 0.6
    # where the weights don't fit, the advice counts the draft's on the first GPU
    small = ("--model", "llama3-70b", "--gpu-memory", "60GiB", "-tp", "2")
    assert cmd.run(parse(*small)) == 1 and "use --tensor-parallel-size 4 or more" in capsys.readouterr().err
    assert cmd.run(parse(*small, "--speculative-config", spec)) == 1
    assert "with its draft model needs" in (err := capsys.readouterr().err) and "--tensor-parallel-size 8" in err
    # n-gram drafts take no memory; a larger vocabulary, bad JSON and pipeline stages are refused
    assert cmd.run(parse(*argv, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == alone["num_blocks"]
    for bad, words in (('{"model": "Qwen2.5-0.5B", "num_speculative_tokens": 4}', "larger vocabulary"),
                       ("{nope", "--speculative-config"), (spec, "pipeline parallelism")):
        extra = ("-pp", "2") if words == "pipeline parallelism" else ()
        assert cmd.run(parse(*argv, "--speculative-config", bad, *extra)) == 2
        assert words in capsys.readouterr().err
