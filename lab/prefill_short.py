"""Prefill attention for the short chunks of serving's mixed steps: kernels/prefill_ws.py's Hopper
kernel ({"ws": True}; the default plan from prefill_attention.WS_MIN_QUERY_LEN tokens for 128-wide heads,
from WS_NARROW_MIN_QUERY_LEN for 64-wide ones) against kernels/prefill_attention.py's Triton kernel
({"ws": False}), each with the default plan's choice, timed in CUDA graphs (8 calls a replay,
causal, this step's k/v passed as the engine does; some chunks after a cached prefix), for Qwen2.5-0.5B's
and Llama-3-8B's heads.

    python -m lab.prefill_short --out prefill-short.json
"""
from __future__ import annotations

import argparse
import sys

# (chunks, tokens each, cached prefix tokens each)
CASES = ((1, 128, 0), (1, 256, 0), (1, 448, 0), (1, 512, 0), (2, 512, 0), (4, 512, 0), (8, 512, 0), (1, 768, 0),
         (1, 1024, 0), (2, 1024, 0), (1, 1536, 0), (1, 2048, 0), (1, 4096, 0), (1, 448, 64), (1, 512, 512),
         (1, 256, 1024), (1, 1024, 1024), (1, 2048, 2048))
HEADS = (("qwen2.5-0.5b", 14, 2, 64), ("llama3-8b", 32, 8, 128))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.prefill_short", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from kernels.prefill_attention import prefill_plan
    from lab.kernels import gpu_and_date, graph_us, prefill_call, prefill_inputs, write_json

    rows = []
    for model, hq, hkv, d in HEADS:
        for nseq, n, prefix in CASES:
            x = prefill_inputs(nseq, n, prefix, hq, hkv, d, 16)
            row: dict = {"model": model, "chunks": nseq, "tokens": n, "prefix": prefix}
            row["default_ws"] = prefill_plan(x["q"], x["kc"], n, None, x["k"], x["v"])["ws"]
            for name, cfg in (("hopper", {"ws": True}), ("triton", {"ws": False})):
                row[f"{name}_ws"] = prefill_plan(x["q"], x["kc"], n, cfg, x["k"], x["v"])["ws"]
                calls = lambda cfg=cfg, x=x, n=n, d=d: [prefill_call(x, n, d, cfg) for _ in range(8)]  # noqa: E731
                row[f"{name}_us"] = round(graph_us(calls, per=8), 2)
            diff = prefill_call(x, n, d, {"ws": True}).float() - prefill_call(x, n, d, {"ws": False}).float()
            row["max_abs_diff"] = float(diff.abs().max())
            print(row, flush=True)
            rows.append(row)
            del x
    write_json(a.out, gpu_and_date() | {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
