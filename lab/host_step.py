"""Host time of the engine loop, on the CPU (no GPU needed): what one decode step costs the engine
process besides the model, and what admitting a burst of prefix-sharing requests costs schedule().

    python -m lab.host_step [--model DIR] [--num-seqs 64] [--steps 300] [--out host.json]

The model's forward is replaced by a function that returns fixed logits of the right shape (zeros
with a one-hot per row, so every row samples an ordinary token that the detokenizer has to turn
into text), so only host work is timed: scheduling, building the step's inputs, sampling on the
CPU, update, detokenization, and pickling the message the engine process sends to the server
(scheduler/engine_proc.py's _step). With async scheduling on (the default, as on a GPU), steps go
through launch/collect with pending tokens, like the GPU path; --no-async-scheduling times the
execute path instead. Without --model, a tiny random Llama is built in a temporary folder, with
its context length raised so that the long prompts fit; --tokenizer none drops its tokenizer, as
`serve bench` runs the dummy-weight presets (token ids as text). What differs from a GPU: the
sampler's argmax runs here (tens of us for 64 rows; a kernel launch there), and there are no
host-to-device copies, graph replays or kernel launches to pay for.
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from lab.profiling import cprofile_to


def build_tiny_model(root: Path, context_len: int, tokenizer: bool = True) -> Path:
    """tests/models.py's tiny Llama, with max_position_embeddings raised to context_len; without
    its tokenizer files, the engine stands in serve/build.py's TokenIdTokenizer, as for the
    dummy-weight presets that `serve bench` runs."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:  # tests/ is not installed: run from anywhere, import it from the checkout
        sys.path.append(repo)
    from tests.models import build_model

    path = build_model("llama", root / "llama")
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["max_position_embeddings"] = context_len
    cfg_file.write_text(json.dumps(cfg))
    if not tokenizer:
        from serve.build import TOKENIZER_FILES

        for name in TOKENIZER_FILES + ("special_tokens_map.json",):
            (path / name).unlink(missing_ok=True)
    return path


def patch_forward(runner: Any) -> None:
    """Make runner's model give [rows, vocab] logits at no cost: zeros with one 1 per row (its forward
    returns placeholder hidden states, of which the runner's rows go through compute_logits)."""
    import torch

    vocab = runner.model_cfg.vocab_size
    rows = runner.cfg.max_num_seqs  # at most one sampled row per sequence
    logits = torch.zeros(rows, vocab)
    logits[torch.arange(rows), 32 + torch.arange(rows) % max(1, min(vocab - 32, 200))] = 1.0

    def forward(ops: Any, ids: Any, pos: Any, caches: Any, meta: Any, logit_idx: Any, carry: Any = None) -> Any:
        return torch.zeros(len(ids), 1) if logit_idx is None else logits[:len(logit_idx)]

    def compute_logits(hidden: Any, gather: bool = True) -> Any:
        return logits[:len(hidden)]

    runner.model.forward = forward
    runner.model.compute_logits = compute_logits


def _stats(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "min_ms": min(ms)}


def _wrap(owner: Any, name: str, acc: dict[str, float]) -> Callable[[], None]:
    """Time owner.name into acc[name] (an instance attribute shadows the method); returns the undo."""
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)
    return lambda: delattr(owner, name)


def start_decode(core: Any, num_seqs: int, prompt_len: int, max_tokens: int, vocab: int, rng: random.Random) -> None:
    """Add num_seqs requests and step until every one of them is decoding."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for _ in range(num_seqs):
        core.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    for _ in range(10_000):
        if all(s.num_computed_tokens >= s.num_prompt_tokens for s in core.scheduler.running) \
                and not core.scheduler.waiting:
            break
        core.step()
    for _ in range(3):  # a few decodes: the pipeline of async steps is full
        core.step()


def time_decode(core: Any, steps: int, phases: bool) -> dict[str, Any]:
    """Time `steps` calls of the engine process's step (scheduler/engine_proc.py) + pickling."""
    from scheduler.engine_proc import _step

    per_step: list[float] = []
    cpu_s: list[float] = []  # this thread's CPU time: the wall time less any wait for a CPU
    pickle_s: list[float] = []
    acc: dict[str, float] = {}
    undo: list[Callable[[], None]] = []
    if phases:
        executor = core.executor
        owners = [(core.scheduler, "schedule"), (core, "_process")]
        owners += [(executor, "launch"), (executor, "collect")] if core.overlaps else [(executor, "execute")]
        undo = [_wrap(o, n, acc) for o, n in owners]
    outputs = 0
    try:
        for _ in range(steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            msg = _step(core)
            t1 = time.perf_counter()
            ForkingPickler.dumps(msg)
            t2 = time.perf_counter()
            cpu_s.append(time.thread_time() - c0)
            per_step.append(t2 - t0)
            pickle_s.append(t2 - t1)
            assert msg[0] == "step", msg[0]
            outputs += len(msg[1])
    finally:
        for u in undo:
            u()
    out: dict[str, Any] = {"steps": steps, "outputs": outputs, **_stats(per_step),
                           "cpu_mean_ms": statistics.fmean(cpu_s) * 1e3,
                           "pickle_median_ms": statistics.median(pickle_s) * 1e3}
    if phases:
        named = {"_process": "process"}
        out["phases_mean_ms"] = {named.get(k, k): v / steps * 1e3 for k, v in acc.items()}
        out["phases_mean_ms"]["pickle"] = statistics.fmean(pickle_s) * 1e3
        out["phases_mean_ms"]["other"] = out["mean_ms"] - sum(out["phases_mean_ms"].values())
    return out


def time_prefix_admission(core: Any, num_seqs: int, prompt_len: int, prefix_len: int, vocab: int,
                          rng: random.Random, reps: int) -> dict[str, Any]:
    """Time the schedule() call that admits num_seqs waiting requests sharing a prefix_len-token
    prefix. The first repetition finds the cache cold; later ones find the prefix (only) cached.
    The prompts come through pickle, as from the server process: every request's token ids are
    int objects of its own (vocab: a real tokenizer's size; nothing here reaches the model)."""
    from scheduler.request import SamplingParams

    sched = core.scheduler
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    times: list[float] = []
    admitted: list[int] = []
    queries, hits = sched.prefix_cache_queries, sched.prefix_cache_hits
    for _ in range(reps):
        prompts = [prefix + [rng.randrange(vocab) for _ in range(prompt_len - prefix_len)] for _ in range(num_seqs)]
        seqs = [core.add_request(ids, params) for ids in pickle.loads(pickle.dumps(prompts))]
        t0 = time.perf_counter()
        batch = sched.schedule()
        times.append(time.perf_counter() - t0)
        admitted.append(0 if batch is None else len(batch.items))
        for s in seqs:  # never executed: take the sequences (and their blocks) back
            core.abort(s.seq_id)
    return {"requests": num_seqs, "prompt_len": prompt_len, "prefix_len": prefix_len, "reps": reps,
            "admitted_min": min(admitted), "first_ms": times[0] * 1e3, **_stats(times[1:] or times),
            "hit_rate": (sched.prefix_cache_hits - hits) / max(1, sched.prefix_cache_queries - queries)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder (default: build a tiny random Llama)")
    p.add_argument("--tokenizer", choices=("bpe", "none"), default="bpe",
                   help="the tiny model's: its byte-level BPE tokenizer, or none (token ids as text, as for "
                        "the dummy-weight presets of `serve bench`)")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences in steady decode")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=300, help="timed decode steps")
    p.add_argument("--prefix-seqs", type=int, default=64, help="requests admitted at once, sharing a prefix")
    p.add_argument("--prefix-prompt-len", type=int, default=1152)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-reps", type=int, default=5)
    p.add_argument("--prefix-vocab", type=int, default=151_000, help="token ids of the prefix-sharing prompts "
                   "are drawn below this (Qwen2.5's vocabulary size): most are int objects of their own")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=16384)
    p.add_argument("--no-async-scheduling", action="store_true", help="time the execute path instead")
    p.add_argument("--no-phases", action="store_true", help="skip the second, per-phase timed pass")
    p.add_argument("--cprofile", default=None, help="write cProfile's top functions of the decode steps here")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    return p.parse_args(argv)


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import torch

    from serve.llm import LLM

    torch.set_num_threads(1)  # as the engine process on a GPU (serve/engine_process.py): host ops are tiny

    prefix_tokens = args.prefix_len + args.prefix_seqs * (args.prefix_prompt_len - args.prefix_len)
    llm = LLM(model, device="cpu", block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              max_num_seqs=max(args.num_seqs, args.prefix_seqs),
              max_num_batched_tokens=max(8192, args.num_seqs * args.prompt_len, prefix_tokens),
              async_scheduling=not args.no_async_scheduling)
    core, runner = llm.engine.core, llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    need = max(args.prompt_len + 3 * args.steps + 20, args.prefix_prompt_len + 1)
    if need > core.max_model_len:
        raise SystemExit(f"the model's context length {core.max_model_len} is too short for these sizes "
                         f"(needs {need}); lower --prompt-len/--steps/--prefix-prompt-len")
    patch_forward(runner)
    rng = random.Random(0)
    start_decode(core, args.num_seqs, args.prompt_len, 3 * args.steps + 20, vocab, rng)
    result: dict[str, Any] = {"num_seqs": args.num_seqs, "async_scheduling": core.overlaps,
                              "tokenizer": type(llm.tokenizer).__name__}
    time_decode(core, min(20, args.steps), phases=False)  # warm-up
    with cprofile_to(args.cprofile, limit=40):
        result["decode"] = time_decode(core, args.steps, phases=False)
    if not args.no_phases:
        result["decode_phases"] = time_decode(core, args.steps, phases=True)["phases_mean_ms"]
    for sid in list(core.scheduler.seqs):
        core.abort(sid)
    while core.has_unfinished():
        core.step()
    result["prefix_admission"] = time_prefix_admission(core, args.prefix_seqs, args.prefix_prompt_len,
                                                       args.prefix_len, args.prefix_vocab, rng, args.prefix_reps)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.prefix_len <= args.prefix_prompt_len:
        raise SystemExit("--prefix-len must be between 0 and --prefix-prompt-len")
    with tempfile.TemporaryDirectory(prefix="host-step-") as tmp:
        context = max(args.prompt_len + 3 * args.steps + 64, args.prefix_prompt_len + 64)
        model = args.model or str(build_tiny_model(Path(tmp), context, tokenizer=args.tokenizer == "bpe"))
        result = run(args, model)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
