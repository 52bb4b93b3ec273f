"""What scoring a prompt costs (SamplingParams.prompt_logprobs; echo with logprobs on /v1/completions, as
lm-evaluation-harness asks for it): LLM.generate of N fresh prompts with max_tokens 1, arms interleaved
over rounds, against the same prompts' plain prefill in the same call; prompt tokens per second and
the peak of allocated GPU memory per arm.

python -m lab.prompt_logprobs_cost --model .models/llama3-8b [--num-prompts 256 --input-len 512
    --rounds 3 --json out.json]
"""
from __future__ import annotations

import statistics
import time

from lab.arms import DummyEngine, arm_arguments, interleave

ARMS = {"plain": None, "prompt_logprobs=1": 1, "prompt_logprobs=5": 5, "prompt_logprobs=20": 20}


def main() -> None:
    a = arm_arguments(__doc__, num_prompts=256, rounds=3).parse_args()
    import torch

    from lab.kernels import write_json
    from serve import SamplingParams

    engine = DummyEngine(a.model)
    llm, vocab = engine.llm, engine.vocab

    def run(k: int | None) -> tuple[float, float]:
        ps = engine.prompts(a.num_prompts, a.input_len)
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
        llm.generate(engine.prompts(8, a.input_len), SamplingParams(max_tokens=1, prompt_logprobs=k))
    runs = interleave(ARMS, a.rounds, run)
    rates = {name: [rate for rate, _ in r] for name, r in runs.items()}
    peaks = {name: max(peak for _, peak in r) for name, r in runs.items()}
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
