"""What penalties, logit_bias and min_p cost a batch: LLM.generate of N prompts (every row with the
same parameters), arms interleaved over rounds, against plain greedy and plain sampled rows in the
same call (engine/logit_adjust.py; such rows also leave multi-step decode rounds).

python -m lab.logit_adjust_cost --model .models/qwen2.5-0.5b [--num-prompts 64 --input-len 512
    --output-len 128 --rounds 2 --json out.json]
"""
from __future__ import annotations

import statistics
import time

from lab.arms import DummyEngine, arm_arguments, interleave

ARMS = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "greedy+presence": {"temperature": 0.0, "presence_penalty": 0.5},
    "greedy+repetition": {"temperature": 0.0, "repetition_penalty": 1.1},
    "greedy+logit_bias": {"temperature": 0.0, "logit_bias": {11: 1.0, 13: -1.0}},
    "sampled+all": {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                    "repetition_penalty": 1.1, "min_p": 0.05},
}


def main() -> None:
    p = arm_arguments(__doc__, num_prompts=64, rounds=2)
    p.add_argument("--output-len", type=int, default=128)
    a = p.parse_args()
    import torch

    from lab.kernels import write_json
    from serve import SamplingParams

    engine = DummyEngine(a.model)
    llm = engine.llm

    def run(kw: dict) -> float:
        params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, **kw)
        ps = engine.prompts(a.num_prompts, a.input_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(ps, params)
        torch.cuda.synchronize()
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    for kw in ARMS.values():  # warm-up: every arm once, short
        llm.generate(engine.prompts(8, a.input_len), SamplingParams(max_tokens=8, ignore_eos=True, **kw))
    rates = interleave(ARMS, a.rounds, run)
    base = {"greedy": statistics.median(rates["greedy"]), "sampled": statistics.median(rates["sampled"])}
    rows = {}
    for name, r in rates.items():
        against = "sampled" if name.startswith("sampled") else "greedy"
        rows[name] = {"tok_s": r, "median": statistics.median(r), "against": against,
                      "ratio": statistics.median(r) / base[against]}
        print(f"{name:20s} {statistics.median(r):10.0f} tok/s  {rows[name]['ratio']:.3f}x {against}", flush=True)
    write_json(a.json, {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                        "model": a.model, "num_prompts": a.num_prompts, "input_len": a.input_len,
                        "output_len": a.output_len, "num_scheduler_steps": llm.engine.runner.num_scheduler_steps,
                        "arms": {k: {kk: str(vv) if isinstance(vv, dict) else vv for kk, vv in v.items()}
                                 for k, v in ARMS.items()}, "rows": rows})


if __name__ == "__main__":
    main()
