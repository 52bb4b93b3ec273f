"""What a speculative decoding step costs against a decode step: B sequences decoding, each step
verifying k draft tokens a sequence (forced: the drafts are the sequence's last token repeated, so
the cost is measured whatever the model accepts; k = 0: no drafts, what the engine costs where
none is found), on one engine with n-gram speculation and on one without it (async
scheduling, the default), in the same call. From the step times, the tokens a
step must keep for a draft to pay: t_verify(k) / t_decode; and with drafts accepted independently
at rate a, a step keeps (1 - a^(k+1)) / (1 - a) tokens a sequence.

python -m lab.spec_steps --model .models/llama3-8b --batch 1 8 32 --drafts 2 4 8 --result-json PATH
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

from lab.kernels import write_json
from lab.offline import time_decode


def kept_per_round(a: float, k: int) -> float:
    """Tokens a sequence keeps from a step with k draft tokens, each kept independently at rate a."""
    return sum(a ** j for j in range(k + 1))


def break_even_acceptance(ratio: float, k: int) -> float | None:
    """The acceptance rate at which a step with k draft tokens, costing `ratio` decode steps, pays for
    its time (None: not even at 100%)."""
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if kept_per_round(a, k) < ratio else (lo, a)
    return round(hi, 3)


def measure(llm, batch: int, k: int, input_len: int, output_len: int) -> dict:
    from serve import SamplingParams

    sched = llm.engine.core.scheduler
    before = (sched.num_accepted_tokens, sched.num_draft_tokens)
    if sched.proposer is not None:
        sched.proposer.propose = lambda seq_id, tokens, limit: [tokens[-1]] * min(limit, k)
    rng = random.Random(batch * 100 + k)
    vocab = min(30000, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    time_decode(llm, prompts[:1], params)  # warm
    n, elapsed, steps = time_decode(llm, prompts, params)
    return {"batch": batch, "drafts": k, "steps": steps, "tokens": n, "step_ms": 1e3 * elapsed / steps,
            "tok_s": n / elapsed, "accepted": sched.num_accepted_tokens - before[0],
            "drafted": sched.num_draft_tokens - before[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    import torch

    from serve import LLM

    rows = []
    for spec in (False, True):
        kw = dict(load_format="dummy", max_num_seqs=max(args.batch))
        if spec:
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": max(args.drafts)}
        with LLM(args.model, **kw) as llm:
            for b in args.batch:
                for k in (([0] + args.drafts) if spec else [0]):
                    row = {"engine": "speculative" if spec else "default", **measure(llm, b, k, args.input_len,
                                                                                     args.output_len)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del llm  # the next engine sizes its KV cache from the memory this one leaves
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["batch"]: r["step_ms"] for r in rows if r["engine"] == "default"}
    for r in rows:
        if r["engine"] == "speculative" and not r["drafts"]:  # what the n-gram engine costs where it finds none
            r["step_vs_decode"] = r["step_ms"] / base[r["batch"]]
            print(f"B={r['batch']} no drafts on the n-gram engine: {r['step_ms']:.2f} ms = {r['step_vs_decode']:.2f}x",
                  flush=True)
        if r["engine"] == "speculative" and r["drafts"]:
            r["step_vs_decode"] = r["step_ms"] / base[r["batch"]]
            ratio = r["step_vs_decode"]
            r["break_even_acceptance"] = break_even_acceptance(ratio, r["drafts"])
            print(f"B={r['batch']} k={r['drafts']}: step {r['step_ms']:.2f} ms = {ratio:.2f}x a decode step; "
                  f"pays from acceptance {r['break_even_acceptance']}", flush=True)
    if args.result_json:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        write_json(args.result_json, {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "model": args.model,
                                      "input_len": args.input_len, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
