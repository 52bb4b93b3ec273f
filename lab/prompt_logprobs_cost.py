"""What scoring a prompt costs (SamplingParams.prompt_logprobs; echo with logprobs on /v1/completions, as
lm-evaluation-harness asks for it): LLM.generate of N fresh prompts with max_tokens 1, arms interleaved
over rounds, against the same prompts' plain prefill in the same call; prompt tokens per second and
the peak of allocated GPU memory per arm.

python -m lab.prompt_logprobs_cost --model .models/llama3-8b [--num-prompts 256 --input-len 512
    --rounds 3 --json out.json]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

ARMS = {"plain": None, "prompt_logprobs=1": 1, "prompt_logprobs=5": 5, "prompt_logprobs=20": 20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch

    from lab.kernels import write_json
    from serve import LLM, SamplingParams

    llm = LLM(a.model, load_format="dummy")
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:  # fresh tokens each run: nothing from the prefix cache
        return [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(n)]

    def run(k: int | None) -> tuple[float, float]:
        ps = prompts(a.num_prompts)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        outs = llm.generate(ps, params)
        torch.cuda.synchronize()
        rate = a.num_prompts * a.input_len / (time.perf_counter() - t0)
        assert k is None or all(len(o.prompt_logprobs) == a.input_len for o in outs)
        return rate, torch.cuda.max_memory_allocated() / 2**30

    for k in ARMS.values():  # warm-up: every arm once, short
        llm.generate(prompts(8), SamplingParams(max_tokens=1, prompt_logprobs=k))
    rates: dict[str, list[float]] = {name: [] for name in ARMS}
    peaks: dict[str, float] = {name: 0.0 for name in ARMS}
    for _ in range(a.rounds):
        for name, k in ARMS.items():
            rate, peak = run(k)
            rates[name].append(rate)
            peaks[name] = max(peaks[name], peak)
    base = statistics.median(rates["plain"])
    rows = {}
    for name, r in rates.items():
        rows[name] = {"prompt_tok_s": r, "median": statistics.median(r), "ratio": statistics.median(r) / base,
                      "peak_allocated_gib": peaks[name]}
        print(f"{name:20s} {statistics.median(r):10.0f} prompt tok/s  {rows[name]['ratio']:.3f}x plain  "
              f"peak {peaks[name]:.2f} GiB", flush=True)
    write_json(a.json, {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": a.model,
                        "vocab_size": vocab, "num_prompts": a.num_prompts, "input_len": a.input_len,
                        "max_num_seqs": llm.config.max_num_seqs, "rows": rows})


if __name__ == "__main__":
    main()
