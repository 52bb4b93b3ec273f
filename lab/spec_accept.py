"""N-gram speculative decoding on real text: for chat prompts of the kinds it is for (repeat or
edit a given text, extract from it) and one it is not (free writing), one stream at a time,
greedy: the outputs with and without drafts (equal), the draft tokens accepted, the steps, and the
wall time of each (the better of two runs). Real weights are needed for a real acceptance rate: the default model runs
anywhere (on a CPU too).

python -m lab.spec_accept [--model DIR] [--max-tokens 160] [--drafts 4] [--result-json PATH]
"""
from __future__ import annotations

import argparse
import sys
import time

from lab.kernels import write_json

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Every morning the fox runs through the forest, "
             "looking for food and water. The dog sleeps in the sun near the old farmhouse, and the farmer "
             "watches them both from his window while he drinks his coffee.")
CODE = ("def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
        "    return totl\n")
TASKS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "edit-code": f"Fix the bug in this Python function and write the whole corrected function:\n\n{CODE}",
    "rewrite": f"Rewrite this text in the past tense:\n\n{PARAGRAPH}",
    "extract": f"List every animal mentioned in this text, with the sentence it appears in:\n\n{PARAGRAPH}",
    "free": "Write a short story about a dragon who learns to bake bread.",
}


def run(llm, prompts: list[list[int]], params) -> tuple[list, float, int, int, int]:
    core = llm.engine.core
    sched = core.scheduler
    steps0, acc0, draft0 = core.stats.num_steps, sched.num_accepted_tokens, sched.num_draft_tokens
    outs, t0 = [], time.perf_counter()
    for p in prompts:  # one stream at a time: the latency case speculation is for
        outs += llm.generate([p], params)
    return (outs, time.perf_counter() - t0, core.stats.num_steps - steps0, sched.num_accepted_tokens - acc0,
            sched.num_draft_tokens - draft0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    import torch

    from serve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows: dict[str, dict] = {name: {} for name in TASKS}
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": args.drafts})):
        with LLM(args.model, speculative_config=spec) as llm:
            prompts = [llm.chat_prompt([{"role": "user", "content": text}]) for text in TASKS.values()]
            run(llm, prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm
            for (name, _), prompt in zip(TASKS.items(), prompts):
                outs, wall, steps, acc, drafted = run(llm, [prompt], params)
                wall = min(wall, run(llm, [prompt], params)[1])  # the better of two runs: a quiet host's time
                rows[name][label] = {"tokens": len(outs[0].token_ids), "steps": steps, "wall_s": wall,
                                     "accepted": acc, "drafted": drafted, "ids": outs[0].token_ids}
            device = str(llm.engine.runner.device)
        del llm
    for name, r in rows.items():
        plain, ngram = r["plain"], r["ngram"]
        r["same_output"] = plain.pop("ids") == ngram.pop("ids")
        r["tokens_per_step"] = ngram["tokens"] / max(1, ngram["steps"])
        r["acceptance"] = ngram["accepted"] / max(1, ngram["drafted"])
        r["speedup"] = plain["wall_s"] / ngram["wall_s"]
        print(f"{name:10s} same={r['same_output']} tokens/step {r['tokens_per_step']:.2f} acceptance "
              f"{r['acceptance']:.2f} wall {plain['wall_s']:.2f} -> {ngram['wall_s']:.2f} s ({r['speedup']:.2f}x)",
              flush=True)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    write_json(args.result_json, {"device": gpu, "date": time.strftime("%Y-%m-%d"), "model": args.model or "default",
                                  "max_tokens": args.max_tokens, "drafts": args.drafts, "tasks": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
