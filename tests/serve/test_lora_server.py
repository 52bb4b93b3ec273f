"""`serve run --lora-modules` as a real subprocess, alone, with two replicas and with a prefill and
a decode engine: the "model" field picks an adapter (its tokens those of transformers with the
adapter merged, streamed or whole, beside base-model requests), and /v1/models lists the adapters;
an unknown model is a 404, a malformed flag one line."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.test_lora import ALL, merged_greedy, save_adapter
from tests.serve.helpers import free_port
from tests.serve.test_shutdown import REPO, start_server
from tests.serve.test_tensor_parallel_server import MAX_NEW, PROMPTS, stop
from tests.serve.test_tensor_parallel_server import complete as tp_complete


def complete(port: int, model: str | None, prompt: list[int], stream: bool) -> str:
    return tp_complete(port, prompt, stream, model=model)


@pytest.mark.parametrize("mode", [[], ["--data-parallel-size", "2"], ["--disaggregate", "1:1"]])
def test_requests_pick_adapters_by_model_name(model_dir, tmp_path, mode):
    from transformers import AutoTokenizer

    sql = save_adapter(tmp_path / "sql", model_dir, ALL, r=4, alpha=8, seed=5)
    chat = save_adapter(tmp_path / "chat", model_dir, ("q_proj", "v_proj"), r=8, alpha=16, seed=6)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = {name: [tok.decode(ids, skip_special_tokens=True) for ids in merged_greedy(model_dir, path, PROMPTS, MAX_NEW)]
            for name, path in ((None, None), ("sql", sql), ("chat", chat))}
    assert want["sql"] != want[None] and want["chat"] != want[None]
    proc, port = start_server(model_dir, *mode, "--lora-modules", f"sql={sql}", f'{{"name": "chat", "path": "{chat}"}}')
    try:
        jobs = [(name, PROMPTS[i % 2], i % 3 == 0) for i, name in enumerate([None, "sql", "chat", "sql", None, "chat"])]
        with ThreadPoolExecutor(6) as pool:  # side by side: one step carries several adapters
            got = list(pool.map(lambda a: complete(port, *a), jobs))
        assert got == [want[name][i % 2] for i, (name, _, _) in enumerate(jobs)]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "sql", "prompt": PROMPTS[0]})
        assert r.status_code == 200 and r.json()["model"] == "sql"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [("llama", None, None), ("sql", "llama", str(sql)),
                                                                       ("chat", "llama", str(chat))]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models/chat").json()["root"] == str(chat)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "nope", "prompt": [5, 6]})
        assert r.status_code == 404 and "'llama', 'sql', 'chat'" in r.json()["error"]["message"]
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_a_bad_adapter_is_one_line(model_dir, tmp_path):
    for flags, line in ((["--lora-modules", "sql"], "an adapter is NAME=FOLDER; got 'sql'"),
                        (["--lora-modules", f"x={tmp_path}"], f"no adapter_config.json in {tmp_path}"),
                        (["--enable-lora", "--max-loras", "-1"], "max_loras must be an integer >= 0")):
        cmd = [sys.executable, "-m", "serve.cli", "run", "--model", str(model_dir), "--device", "cpu",
               "--port", str(free_port()), *flags]
        r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and line in r.stderr.strip().splitlines()[-1], r.stderr
        assert "Traceback" not in r.stderr, r.stderr


def test_kv_calc_counts_the_adapters(model_dir, tmp_path, capsys):
    import json

    from serve import kv_calc_cmd

    sql = save_adapter(tmp_path / "sql", model_dir, ALL, r=8, alpha=8, seed=5)
    args = ["--model", "Llama-3-8B", "--gpu-memory", "H100", "--json"]
    assert kv_calc_cmd.main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert kv_calc_cmd.main(args + ["--lora-modules", f"sql={sql}", f"b={sql}"]) == 0
    with_lora = json.loads(capsys.readouterr().out)
    # two rank-8 adapters on all of Llama-3-8B's projections: 2 x 8 x (qkv 3 x 10,240 + o 8,192 +
    # gate/up 2 x 32,768 + down 18,432) x 32 layers x 2 bytes
    assert with_lora["weight_bytes"] - base["weight_bytes"] == 2 * 8 * (3 * 10240 + 8192 + 2 * 32768 + 18432) * 32 * 2
    assert with_lora["num_blocks"] < base["num_blocks"]
    assert kv_calc_cmd.main(args + ["--lora-modules", "x"]) == 2
    assert "an adapter is NAME=FOLDER" in capsys.readouterr().err
    # --enable-lora's slots: as serve run makes them (every projection, 1 x rank 16 by default; at
    # least the start-up adapters' count and rank)
    per_slot_rank = (3 * 10240 + 8192 + 2 * 32768 + 18432) * 32 * 2
    for extra, slots, rank in ((["--enable-lora"], 1, 16), (["--enable-lora", "--max-loras", "3"], 3, 16),
                               (["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={sql}", f"b={sql}"],
                                2, 8)):
        assert kv_calc_cmd.main(args + extra) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["weight_bytes"] - base["weight_bytes"] == slots * rank * per_slot_rank, extra
    assert kv_calc_cmd.main(args + ["--max-lora-rank", "4", "--lora-modules", f"a={sql}"]) == 2
    assert "rank 8, more than --max-lora-rank 4" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [[], ["--data-parallel-size", "2"], ["--disaggregate", "1:1"]])
def test_adapters_load_and_unload_while_serving(model_dir, tmp_path, mode):
    """--enable-lora: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, on every engine; a
    load past --max-loras replaces the idle adapter; requests and /v1/models follow."""
    from transformers import AutoTokenizer

    sql = save_adapter(tmp_path / "sql", model_dir, ALL, r=4, alpha=8, seed=5)
    chat = save_adapter(tmp_path / "chat", model_dir, ("q_proj", "v_proj"), r=8, alpha=16, seed=6)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = {name: [tok.decode(ids, skip_special_tokens=True) for ids in merged_greedy(model_dir, path, PROMPTS, MAX_NEW)]
            for name, path in (("sql", sql), ("chat", chat))}
    url = "http://127.0.0.1:{}"
    proc, port = start_server(model_dir, *mode, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")
    base = url.format(port)

    def load(name, path):
        return httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)

    def models():
        return [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]

    def asked(name):
        return httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": PROMPTS[0], "max_tokens": 2},
                          timeout=60)

    try:
        r = asked("sql")
        assert r.status_code == 404 and "'sql' is not loaded" in r.json()["error"]["message"]
        r = load("sql", sql)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        assert models() == ["llama", "sql"]
        assert [complete(port, "sql", p, stream=i == 1) for i, p in enumerate(PROMPTS)] == want["sql"]
        assert load("chat", chat).status_code == 200  # one slot: over sql, which no request uses
        assert models() == ["llama", "chat"] and asked("sql").status_code == 404
        assert [complete(port, "chat", p, stream=False) for p in PROMPTS] == want["chat"]
        assert load("sql", sql).status_code == 200 and models() == ["llama", "sql"]  # back, by its path
        assert complete(port, "sql", PROMPTS[1], stream=True) == want["sql"][1]
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and models() == ["llama"] and asked("sql").status_code == 404
        r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 404
        r = load("bad", tmp_path)
        assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
        assert load("llama", sql).status_code == 400
        assert models() == ["llama"]
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_loading_needs_enable_lora(model_dir, tmp_path):
    proc, port = start_server(model_dir)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/y"})
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_serve_generate_with_an_adapter(model_dir, tmp_path):
    """`serve generate --lora FOLDER` (or a --lora-modules name) prints the adapter's text."""
    from transformers import AutoTokenizer

    sql = save_adapter(tmp_path / "sql", model_dir, ALL, r=4, alpha=8, seed=5)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "the quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=False)
    want = tok.decode(merged_greedy(model_dir, sql, [ids], 8)[0], skip_special_tokens=True)
    base = [sys.executable, "-m", "serve.cli", "generate", prompt, "--model", str(model_dir), "--device", "cpu",
            "--dtype", "float32", "--max-tokens", "8", "--ignore-eos"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for flags in (["--lora", str(sql)], ["--lora-modules", f"sql={sql}", "--lora", "sql"]):
        r = subprocess.run(base + flags, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == want
