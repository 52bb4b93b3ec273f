"""What an embedding costs against the prefill it is: the same prompts as embedding requests
(LLM.embed, last-token and mean pooling) and as one-token generations (the prefill and one sampled
token, which embeddings also pay), on one engine in the same call; tokens a second of each and
their ratio, with the GPU's name and the date.

python -m lab.embed_cost --model .models/llama3-8b --prompts 256 --length 512 --result-json PATH
"""
from __future__ import annotations

import argparse
import datetime
import random
import sys
import time

from lab.kernels import write_json


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """The median seconds of each fn() over repeats rounds, the fns taking turns within a round
    (so drift and clocks fall on all alike), after a warm-up round."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                runs[name].append(time.perf_counter() - t0)
    return {name: sorted(v)[len(v) // 2] for name, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)

    import torch

    from serve import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, load_format=args.load_format, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.length)] for _ in range(args.prompts)]
    tokens = args.prompts * args.length
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds = timed({"prefill_one_token": lambda: llm.generate(prompts, one),
                     "embed_last": lambda: llm.embed(prompts, pooling="last"),
                     "embed_mean": lambda: llm.embed(prompts, pooling="mean")}, args.repeats)
    base = seconds["prefill_one_token"]
    result = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": datetime.date.today().isoformat(),
        "model": args.model, "prompts": args.prompts, "length": args.length,
        "prompt_tokens_per_s": {k: tokens / v for k, v in seconds.items()},
        "speed_vs_prefill": {k: base / v for k, v in seconds.items()},
    }
    print(result, file=sys.stderr)
    write_json(args.result_json, result)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
