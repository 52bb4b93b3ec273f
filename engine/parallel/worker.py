"""A follower rank: it builds its ModelRunner (the same start-up as rank 0's, with the same
collectives in the same order), then runs every step rank 0 sends it and drops the results.

Messages (Comm.broadcast_object over the control group):
    ("launch", step, prev step or None, wire.Message, sync)  ("stop",)
The follower launches the step on prev's samples, as rank 0 does, then collects the steps before it
(rank 0 does the same right after); sync: collect this one too (rank 0 ran execute())."""
from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.comm import Comm
from engine.parallel.group import TPGroup, connect_store, destroy_group, init_group
from engine.parallel.wire import BatchDecoder
from engine.runner import ModelRunner, resolve_device

log = logging.getLogger("pagedserve")


def follow(runner: ModelRunner, comm: Comm) -> None:
    """Run rank 0's steps until it says stop."""
    decoder = BatchDecoder()
    handles: dict[int, object] = {}
    while True:
        msg = comm.broadcast_object(None)
        if msg[0] == "stop":
            return
        _, step, prev, payload, sync = msg
        batch = decoder.decode(payload)
        handle = runner.launch(batch, handles.get(prev) if prev is not None else None)
        for old in list(handles):
            runner.collect(handles.pop(old))
        if sync:
            runner.collect(handle)
        else:
            handles[step] = handle


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
    group: TPGroup | None = None
    try:
        device_type = resolve_device(cfg.device).type
        if device_type == "cpu":
            cpu_threads(int(env["WORLD_SIZE"]))
        conn.send(("arrived", None))  # rank 0 joins once every rank is here (watching them until then)
        group = init_group(env, device_type, store=connect_store(env))
        runner = ModelRunner(model_cfg, model_path, cfg, max_model_len, show_progress=False, tp=group)
    except Exception as e:
        log.exception("tensor-parallel rank %s failed to start", env["RANK"])
        conn.send(("error", one_line(e)))
        raise SystemExit(1)
    try:
        follow(runner, Comm(group))
    except Exception as e:
        log.exception("tensor-parallel rank %d failed", group.rank)
        conn.send(("error", one_line(e)))
        raise SystemExit(1)
    destroy_group(group)


def follow_from_env(model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig, max_model_len: int) -> None:
    """A rank other than 0 that a launcher (torchrun) started: join the group from the environment,
    build this rank's runner, follow rank 0's steps until it stops."""
    device_type = resolve_device(cfg.device).type
    group = init_group(os.environ, device_type)
    try:
        runner = ModelRunner(model_cfg, model_path, cfg, max_model_len, show_progress=False, tp=group)
        follow(runner, Comm(group))
    finally:
        destroy_group(group)
