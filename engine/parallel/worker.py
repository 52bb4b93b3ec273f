"""A follower rank: it builds its ModelRunner (the same start-up as rank 0's, with the same
collectives in the same order), then runs every step rank 0 sends it and drops the results.

Tensor parallel (follow), messages by Comm.broadcast_object over the control group:
    ("launch", step, prev step or None, wire.Message, sync)  ("finish", step, wire.TokenUpdate)
    ("grammar", tokenizer, vocab_size, eos_token_ids)  ("lora", slot, lora_id, name, path)  ("stop",)
The follower launches the step on prev's samples, as rank 0 does, then collects the steps before it
(rank 0 does the same right after); sync: collect this one too (rank 0 ran execute()). finish: a
launched step's constrained rows sample now, their earlier tokens known (the message brings them).
grammar: constrained decoding is on (rank 0's tokenizer, pickled: each rank fills its own masks).
lora: a LoRA adapter into a slot (each rank reads its own part of the files).

Pipeline parallel (follow_stages), messages posted by rank 0 to each rank (channel.py):
    ("launch", step, wire.Message)  ("grammar", ...)  ("lora", ...)  ("stop",)
Each rank runs its stage of the step (receiving the carry from the stage before, sending it on) and
collects it; the last stage's first rank posts (step, samples) back to rank 0."""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig, ModelConfig
from engine.grammar_mask import build_grammar_masks
from engine.parallel.channel import SAMPLES_TAG, STEP_TAG, Posted, post, receive
from engine.parallel.comm import Comm
from engine.parallel.group import connect_store, destroy_group
from engine.parallel.topology import Topology, join
from engine.parallel.wire import BatchDecoder
from engine.runner import Launched, ModelRunner, resolve_device

log = logging.getLogger("pagedserve")


def follow(runner: ModelRunner, comm: Comm) -> None:
    """Run rank 0's steps until it says stop."""
    decoder = BatchDecoder()
    handles: dict[int, Launched] = {}
    while True:
        msg = comm.broadcast_object(None)
        if msg[0] == "stop":
            return
        if msg[0] == "grammar":
            _enable_grammar(runner, *msg[1:])
            continue
        if msg[0] == "lora":
            runner.load_lora(*msg[1:])
            continue
        if msg[0] == "finish":
            _, step, update = msg
            decoder.apply_tokens(update)
            runner.finish(handles[step])
            continue
        _, step, prev, payload, sync = msg
        batch = decoder.decode(payload)
        handle = runner.launch(batch, handles.get(prev) if prev is not None else None)
        for old in list(handles):
            runner.collect(handles.pop(old))
        if sync:
            runner.collect(handle)
        else:
            handles[step] = handle


def follow_stages(runner: ModelRunner, topo: Topology) -> None:
    """Run this rank's stage of rank 0's steps until it says stop."""
    assert topo.pipe is not None
    decoder = BatchDecoder()
    control = topo.world.control
    replies = topo.pipe.next is None and topo.tp.rank == 0
    posted: deque[Posted] = deque()
    while True:
        msg = receive(0, control, STEP_TAG)
        if msg[0] == "stop":
            break
        if msg[0] == "grammar":
            _enable_grammar(runner, *msg[1:])
            continue
        if msg[0] == "lora":
            runner.load_lora(*msg[1:])
            continue
        _, step, payload = msg
        samples = runner.collect(runner.launch(decoder.decode(payload)))
        if replies:
            posted.append(post((step, samples), [0], control, SAMPLES_TAG))
            while posted and posted[0].done():
                posted.popleft()
    for p in posted:
        p.wait()


def _enable_grammar(runner: ModelRunner, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
    runner.grammar = build_grammar_masks(tokenizer, vocab_size, eos_token_ids, runner.device)


def follow_any(runner: ModelRunner, topo: Topology) -> None:
    if topo.pipe is None:
        follow(runner, Comm(topo.tp))
    else:
        follow_stages(runner, topo)


def cpu_threads(size: int) -> None:
    """Ranks sharing a CPU split its cores: OpenMP threads spin-wait, and oversubscribed ones slow a
    step many times over (serve/engine_process.py measured 10x for one extra thread)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return first if isinstance(e, (ValueError, OSError, RuntimeError)) and first else f"{type(e).__name__}: {first}"


def _exit_with_parent(conn: Connection) -> None:
    """Rank 0's process holds the other end: when it is gone (EOF), so is this rank."""
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            os._exit(0)


def worker_main(env: dict[str, str], model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig,
                max_model_len: int, conn: Connection, log_level: int = logging.WARNING) -> None:
    """The target of a rank that rank 0 spawned (multiprocessing, spawn). Ctrl-C is rank 0's to
    handle (it stops this rank in order); reports a start-up error on conn before it exits 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s[rank {env['RANK']}]: %(message)s")
    os.environ.update(env)  # as torchrun would have started it
    threading.Thread(target=_exit_with_parent, args=(conn,), name="parent-watch", daemon=True).start()
    # tqdm's default lock is a multiprocessing semaphore: the os._exit below would leave it for the
    # resource tracker, which then warns of a leak when the server stops
    tqdm.set_lock(threading.RLock())
    topo: Topology | None = None
    try:
        device_type = resolve_device(cfg.device).type
        if device_type == "cpu":
            cpu_threads(int(env["WORLD_SIZE"]))
        conn.send(("arrived", None))  # rank 0 joins once every rank is here (watching them until then)
        topo = join(env, device_type, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, model_cfg.num_layers,
                    store=connect_store(env))
        runner = ModelRunner(model_cfg, model_path, cfg, max_model_len, show_progress=False, tp=topo.tp, pp=topo.pipe)
    except Exception as e:
        log.exception("rank %s failed to start", env["RANK"])
        conn.send(("error", one_line(e)))
        raise SystemExit(1)
    try:
        follow_any(runner, topo)
    except Exception as e:
        log.exception("rank %d failed", topo.world.rank)
        conn.send(("error", one_line(e)))
        raise SystemExit(1)
    runner.release_graphs()
    destroy_group(topo.world)
    # rank 0 waits for this exit: skip the interpreter's teardown (CUDA graphs, NCCL, the caching
    # allocator), which has nothing left to save
    logging.shutdown()
    os._exit(0)


def follow_from_env(model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig, max_model_len: int) -> None:
    """A rank other than 0 that a launcher (torchrun) started: join the group from the environment,
    build this rank's runner, follow rank 0's steps until it stops."""
    device_type = resolve_device(cfg.device).type
    topo = join(os.environ, device_type, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, model_cfg.num_layers)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(model_cfg, model_path, cfg, max_model_len, show_progress=False, tp=topo.tp, pp=topo.pipe)
        follow_any(runner, topo)
    finally:
        if runner is not None:
            runner.release_graphs()
        destroy_group(topo.world)
