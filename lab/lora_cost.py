"""What serving LoRA adapters costs: decode steps and a served-like offline workload on an engine
without adapters, and on one with N random adapters (rank R, every projection of every layer)
whose requests use no adapter, one adapter, or all N mixed, in the same call.

python -m lab.lora_cost --model .models/llama3-8b --adapters 4 --rank 16 --batch 1 8 64 --result-json PATH
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from lab.kernels import write_json
from lab.offline import time_decode



def random_adapter(out: Path, model: str, rank: int, seed: int) -> Path:
    """A PEFT adapter of random bfloat16 weights for every projection of the model at `model`."""
    import torch
    from safetensors.torch import save_file

    from engine.config import ModelConfig
    from engine.lora import TARGETS

    cfg = ModelConfig.from_path(model)
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t, (module, _) in TARGETS.items():
            o, n = shapes[t]
            key = f"base_model.model.model.layers.{layer}.{module.split('.')[0]}.{t}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n, generator=g) / n ** 0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (0.01 * torch.randn(o, rank, generator=g)).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS)}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=128, help="the offline workload's requests (all at once)")
    ap.add_argument("--engine", default="{}", help="more LLM() arguments, as JSON")
    ap.add_argument("--adapter-dir", default=None, help="where the random adapters go (default: a temporary folder)")
    ap.add_argument("--repeats", type=int, default=3, help="offline runs per case (the median counts)")
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    import torch

    from serve import LLM, SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    tmp = Path(args.adapter_dir) if args.adapter_dir else Path(tempfile.mkdtemp(prefix="lora-cost-"))
    t0 = time.perf_counter()
    adapters = {f"a{i}": str(random_adapter(tmp / f"a{i}", args.model, args.rank, i)) for i in range(args.adapters)}
    print(f"{args.adapters} adapters written in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rows = []
    for engine in ("base", "lora"):
        kw = dict(load_format="dummy", max_num_seqs=max(max(args.batch), args.requests), **json.loads(args.engine))
        if engine == "lora":
            kw["lora_modules"] = adapters
        with LLM(args.model, **kw) as llm:
            vocab = min(30000, llm.engine.model_config.vocab_size)
            uses = ["none"] if engine == "base" else ["none", "one", "mixed"]
            for use in uses:
                def plist(n: int) -> list:
                    return [replace(params, lora={"none": 0, "one": 1, "mixed": 1 + j % args.adapters}[use])
                            for j in range(n)]
                for b in args.batch:
                    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(b)]
                    time_decode(llm, prompts[:1], plist(1))  # warm
                    n, elapsed, steps = time_decode(llm, prompts, plist(b))
                    row = {"engine": engine, "requests_use": use, "kind": "decode", "batch": b,
                           "step_ms": 1e3 * elapsed / steps, "tok_s": n / elapsed}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
                llm.generate(prompts[:4], plist(4))  # warm
                times = []
                for r in range(args.repeats):  # fresh prompts each time: no prefix-cache hits
                    if r:
                        prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)]
                                   for _ in range(args.requests)]
                    sync()
                    t = time.perf_counter()
                    llm.generate(prompts, plist(args.requests))
                    sync()
                    times.append(time.perf_counter() - t)
                elapsed = sorted(times)[len(times) // 2]
                row = {"engine": engine, "requests_use": use, "kind": "offline", "requests": args.requests,
                       "input_len": args.input_len, "output_len": args.output_len, "seconds": elapsed,
                       "runs_s": times, "output_tok_s": args.requests * args.output_len / elapsed}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = {(r["kind"], r.get("batch")): r for r in rows if r["engine"] == "base"}
    for r in rows:
        b = base[(r["kind"], r.get("batch"))]
        r["vs_base"] = (b["step_ms"] / r["step_ms"]) if r["kind"] == "decode" else r["output_tok_s"] / b["output_tok_s"]
    for r in rows:
        print(f"{r['engine']:5s} {r['requests_use']:6s} {r['kind']:8s} {r.get('batch', r.get('requests')):4d}: "
              f"{r['vs_base']:.3f}x of the engine without adapters", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    write_json(args.result_json, {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "model": args.model,
                                  "adapters": args.adapters, "rank": args.rank, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
