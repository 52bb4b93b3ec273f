"""Where a warm start's host time goes: the engine built in this process under cProfile, after a
first build in a child process has filled the Triton and cost-model caches.

    python -m lab.startup_profile --model .models/llama3-8b [--top 60] [--out profile.txt] [--imports]

Prints (and writes to --out) the phases and the functions with the most cumulative and own time.
--imports: instead of profiling, both builds report which thread first imported each of a few heavy
modules (torch._dynamo, sympy, ...), from where, and how long the import took.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time


HEAVY = ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes", "sklearn", "transformers",
         "torch.distributed.fsdp", "torch._inductor")


def trace_imports() -> None:
    """Print, at each HEAVY module's first import, the importing thread, the seconds it took and
    the caller's frames (ours and torch's, the last 8)."""
    import builtins
    import threading
    import traceback

    original = builtins.__import__
    started: set[str] = set()

    def hooked(name, *args, **kwargs):
        root = next((h for h in HEAVY if name == h or name.startswith(h + ".")), None)
        if root is None or root in started or root in sys.modules:
            return original(name, *args, **kwargs)
        started.add(root)
        stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename][-8:]
        t0 = time.perf_counter()
        try:
            return original(name, *args, **kwargs)
        finally:
            print(f"import {root}: {time.perf_counter() - t0:.2f} s on {threading.current_thread().name}\n    "
                  + "\n    ".join(stack), flush=True)

    builtins.__import__ = hooked


def build(model: str) -> float:
    from engine.config import EngineConfig
    from serve.build import build_engine

    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(model=model, load_format="dummy"), show_progress=False)
    seconds = time.perf_counter() - t0
    print("phases:", {k: round(v, 2) for k, v in engine.runner.startup_s.items()}, flush=True)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m lab.startup_profile")
    p.add_argument("--model", required=True)
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--out", default=None)
    p.add_argument("--imports", action="store_true", help="trace the first imports of heavy modules instead")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.imports:
        trace_imports()
    if args.child:
        print(f"first build: {build(args.model):.1f} s", flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "triton"))
        os.environ.setdefault("PAGEDSERVE_CACHE", os.path.join(tmp, "pagedserve"))
        subprocess.run([sys.executable, "-m", "lab.startup_profile", "--model", args.model, "--child",
                        *(["--imports"] if args.imports else [])], check=True)
        t0 = time.perf_counter()
        import torch  # noqa: F401  (the imports are timed apart from the build)

        import engine.runner  # noqa: F401
        imports = time.perf_counter() - t0
        if args.imports:
            print(f"warm build: {build(args.model):.1f} s", flush=True)
            return 0
        prof = cProfile.Profile()
        prof.enable()
        seconds = build(args.model)
        prof.disable()
    text = io.StringIO()
    text.write(f"imports {imports:.2f} s; warm build {seconds:.2f} s (under cProfile)\n")
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(args.top)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
