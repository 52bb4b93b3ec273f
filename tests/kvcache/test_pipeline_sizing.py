"""kv-calc with pipeline stages: each GPU holds its stage's layers (and the embedding or the LM
head), so the weights per GPU shrink and each GPU's KV cache holds more blocks; the figures are
those of the GPU with the fewest blocks, which the engine agrees on."""
import argparse
import json

import pytest

from engine.presets import resolve_model
from kvcache import calc
from kvcache.gpus import resolve_gpu_memory
from serve import kv_calc_cmd as cmd

H100 = resolve_gpu_memory("H100").total_bytes


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve kv-calc")
    cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen2.5-0.5B", "Llama-3-70B"])
def test_stage_weights_add_up_to_the_model(name):
    model = resolve_model(name).config
    for pp in (2, 3):
        ranges = calc.stage_layer_ranges(model.num_layers, pp)
        total = sum(calc.stage_weight_bytes(model, "bfloat16", 1, e - s, i == 0, i == pp - 1)
                    for i, (s, e) in enumerate(ranges))
        head_copy = model.vocab_size * model.hidden_size * 2 if model.tie_word_embeddings else 0
        assert total == model.weight_bytes("bfloat16") + head_copy
    assert calc.stage_weight_bytes(model, "bfloat16", 1, model.num_layers, True, True) == model.weight_bytes("bfloat16")


def test_two_stages_hold_half_the_layers_and_more_blocks():
    model = resolve_model("Llama-3-8B").config
    one = calc.plan(model, H100)
    two = calc.plan(model, H100, pipeline_parallel_size=2)
    assert two.spec.num_layers == 16 and two.bytes_per_token == one.bytes_per_token // 2
    assert two.weight_bytes < 0.6 * one.weight_bytes
    assert two.num_blocks > 2 * one.num_blocks
    assert two.to_dict()["pipeline_parallel_size"] == 2


def test_cli_70b_on_two_stages_fits(capsys):
    argv = ("--model", "Llama-3-70B", "--gpu-memory", "H100", "-pp", "2", "--memory-utilization", "0.95")
    assert cmd.run(parse(*argv, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["pipeline_parallel_size"], out["num_layers"]) == (2, 40)
    model = resolve_model("Llama-3-70B").config  # decode and piecewise graphs, no whole-step graphs
    tokens = cmd.graph_tokens(cmd.read_request(parse(*argv)), "bfloat16", 8192)
    # a stage of 40 layers still sets the pace: graphs up to the largest mixed step; no whole-step graphs
    assert tokens.piecewise < 8192 and tokens.step == 0
    assert out["graph_bytes"] == (calc.estimate_graph_bytes(model, "bfloat16", 256, 8192, 16)
                                  + calc.estimate_piecewise_graph_bytes(model, "bfloat16", tokens.piecewise))
    assert out["num_blocks"] > 0
    assert cmd.run(parse("--model", "Llama-3-70B", "--gpu-memory", "H100", "-pp", "2", "-tp", "2")) == 0
    assert "tensor parallel 2 x pipeline parallel 2 (figures per GPU: a stage of 40 layers)" in capsys.readouterr().out


@pytest.mark.parametrize("size", ["33", "0"])
def test_cli_too_many_stages_is_one_line_and_exit_2(size, capsys):
    assert cmd.run(parse("--model", "Llama-3-8B", "--gpu-memory", "H100", "--pipeline-parallel-size", size)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pipeline-parallel-size" in err[0]
