"""How long a tensor/pipeline-parallel engine takes to stop: builds LLM(tensor_parallel_size=T,
pipeline_parallel_size=P) on dummy weights, generates a little, then times shutdown() and the
process's own exit (the parent times the child).

    python -m lab.tp_stop --model .models/qwen2.5-0.5b --tp 2 [--pp 1]
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time


def child(model: str, tp: int, pp: int) -> None:
    from scheduler.request import SamplingParams
    from serve.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    llm.generate([[1, 2, 3, 4]] * 8, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    llm.shutdown()
    print(json.dumps({"shutdown_s": time.perf_counter() - t0}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tp_stop")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.model, a.tp, a.pp)
        return 0
    cmd = [sys.executable, "-m", "lab.tp_stop", "--model", a.model, "--tp", str(a.tp), "--pp", str(a.pp), "--child"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # printed after shutdown() returned
    t0 = time.perf_counter()
    code = proc.wait(120)
    out = json.loads(line) if line.strip() else {}
    out.update(tp=a.tp, pp=a.pp, exit_after_shutdown_s=time.perf_counter() - t0, exit_code=code)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
