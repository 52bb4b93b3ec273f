"""Where a tensor-parallel engine's GPU memory goes at start-up: free memory after each phase, the
graphs captured, and what is left of the --gpu-memory-utilization budget (negative: past it), with
the one-shot all-reduce or with every all-reduce through NCCL (NCCL keeps memory for each collective
a CUDA graph captures: engine/parallel/graph_memory.py).

    python -m lab.tp_memory --model .models/llama3-8b --tp 2 [--nccl-only]
"""
from __future__ import annotations

import argparse
import json


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tp_memory")
    p.add_argument("--model", required=True, help="a model folder or preset (dummy weights)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--nccl-only", action="store_true", help="--disable-custom-all-reduce")
    a = p.parse_args()
    import torch

    from serve.llm import LLM

    llm = LLM(a.model, load_format="dummy", tensor_parallel_size=a.tp, disable_custom_all_reduce=a.nccl_only)
    r = llm.engine.runner  # rank 0's
    free, total = torch.cuda.mem_get_info(r.device)
    graphs = {"decode": len(r.graphs.graphs) if r.graphs else 0,
              "piecewise_pieces": sum(len(v) for v in r.piecewise.graphs.values()) if r.piecewise else 0,
              "step": len(r.steps.graphs) if r.steps else 0}
    print(json.dumps({"tp": a.tp, "nccl_only": a.nccl_only, "graphs": graphs, "blocks": r.num_blocks,
                      "graph_bytes_reserved": r.graph_bytes_reserved(),
                      "unused_budget_bytes": free - int(total * (1 - r.cfg.gpu_memory_utilization)),
                      "free_after_phase_gb": {k: round(v / 1e9, 3) for k, v in r.free_bytes_after_phase.items()},
                      "peer_all_reduce": r.comm.peer is not None}), flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
