"""What a draft model's speculative round costs against a decode step, in one call: B sequences
decoding (greedy, dummy weights) on an engine without speculation, on one whose draft model is a
smaller model (dummy weights: its drafts are almost never kept, so a round there costs the draft's
k + 1 steps and the verifying step for one token a sequence), and on one whose draft model is the
target itself (the same dummy weights: every draft kept, k + 1 tokens a round; it checks the
mechanism end to end, not a useful setting). From the small draft's round time, the tokens a round
must keep to pay, and with drafts kept independently at rate a ((1 - a^(k+1)) / (1 - a) tokens a
round) the speed a real draft of that size would give: projected, not measured.

Each engine with drafts runs twice: drafting every step ("forced", what a round costs), and as the
scheduler chooses ("gated": drafts while the tokens they keep pay for the round's cost, estimated
from the cost model and the draft's rounds timed at start-up; scheduler/policy.py _drafts_pay).

python -m lab.spec_draft --model .models/llama3-8b --draft .models/qwen2.5-0.5b --batch 1 8 32 --drafts 4 \
    --result-json PATH
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time

from lab.kernels import write_json
from lab.offline import time_decode
from lab.spec_steps import break_even_acceptance, kept_per_round


def measure(llm, batch: int, input_len: int, output_len: int) -> dict:
    from serve import SamplingParams

    sched = llm.engine.core.scheduler
    before = (sched.num_accepted_tokens, sched.num_draft_tokens)
    rng = random.Random(batch)
    vocab = min(30000, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    time_decode(llm, prompts[:1], params)  # warm
    n, elapsed, steps = time_decode(llm, prompts, params)
    return {"batch": batch, "steps": steps, "tokens": n, "step_ms": 1e3 * elapsed / steps, "tok_s": n / elapsed,
            "tokens_per_seq_step": n / steps / batch, "accepted": sched.num_accepted_tokens - before[0],
            "drafted": sched.num_draft_tokens - before[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    import torch

    from serve import LLM

    k = args.drafts
    rows = []
    for engine, draft in (("default", None), ("small draft", args.draft), ("self draft", args.model)):
        kw = dict(load_format="dummy", max_num_seqs=max(args.batch))
        if draft is not None:
            kw["speculative_config"] = {"model": draft, "num_speculative_tokens": k}
        t0 = time.perf_counter()
        with LLM(args.model, **kw) as llm:
            print(f"{engine}: started in {time.perf_counter() - t0:.1f} s", flush=True)
            sched = llm.engine.core.scheduler
            gate = sched.config.speculation_ratio
            # "forced": drafts in every step (the round's cost); "gated": where the scheduler finds they pay
            for mode in (("forced", "gated") if draft is not None else ("",)):
                sched.config = dataclasses.replace(sched.config, speculation_ratio=gate if mode == "gated" else None)
                for b in args.batch:
                    sched.kept_per_draft = float(k + 1)  # each measurement starts as an engine does
                    row = {"engine": f"{engine} {mode}".strip(), **measure(llm, b, args.input_len, args.output_len)}
                    if mode == "gated" and gate is not None:
                        row["ratio_estimate"] = gate(b)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del llm  # the next engine sizes its KV cache from the memory this one leaves
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["batch"]: r for r in rows if r["engine"] == "default"}
    for r in rows:
        if r["engine"] == "default":
            continue
        b = base[r["batch"]]
        r["round_vs_decode_step"] = r["step_ms"] / b["step_ms"]
        r["tok_s_vs_default"] = r["tok_s"] / b["tok_s"]
        if r["engine"] == "small draft forced":
            ratio = r["round_vs_decode_step"]
            r["break_even_acceptance"] = break_even_acceptance(ratio, k)
            r["projected_vs_default"] = {str(a): round(kept_per_round(a, k) / ratio, 3) for a in (0.5, 0.6, 0.7, 0.8, 0.9)}
        print(f"B={r['batch']} {r['engine']}: a round {r['step_ms']:.2f} ms = {r['round_vs_decode_step']:.2f}x a decode "
              f"step, {r['tokens_per_seq_step']:.2f} tokens a sequence, {r['tok_s_vs_default']:.2f}x the default's tok/s"
              + (f"; pays from acceptance {r['break_even_acceptance']}, projected {r['projected_vs_default']}"
                 if "projected_vs_default" in r else ""), flush=True)
    if args.result_json:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        write_json(args.result_json, {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "model": args.model,
                                      "draft": args.draft, "num_speculative_tokens": k, "input_len": args.input_len,
                                      "output_len": args.output_len, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
