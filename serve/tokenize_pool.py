"""Tokenizing processes beside the API server's event loop.

Why processes: the event loop that streams every response is busy under load, and a thread that
tokenizes needs the GIL back from it after every step of its work; a busy loop lets go of the GIL
only every `sys.getswitchinterval()` (5 ms). Text requests planned on threads then reached the
engine late and in bursts (bench/NOTES.md, 2026-11-26). A tokenizing process shares no GIL: the loop
only writes the text to a pipe and reads the ids back when they are there.

A worker (serve/tokenize_worker.py) holds a copy of the Rust tokenizer (`tokenizers.Tokenizer`,
from its JSON) and encodes a request's texts in one `encode_batch_fast` call. A worker that dies
fails the encodes it held (those requests get a 503, the server stays up); the pool goes on with
the others, and with none left the planner's own encoder takes over (serve/api.py). The chat
template is rendered on the loop before (serve/prompts.py Draft).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.engine_proc import FrameReader, settle

log = logging.getLogger("pagedserve")

MAX_WORKERS = 4
WORKER = Path(__file__).with_name("tokenize_worker.py")  # run as a script: it imports nothing of ours


class TokenizerGone(RuntimeError):
    """The tokenizing process holding an encode exited before answering."""


def pool_size(cpus: int | None = None) -> int:
    """Workers for this machine: a quarter of its CPUs, 1 to MAX_WORKERS. A 512-token prompt takes
    ~1 ms to encode, so one worker keeps up with ~1,000 such requests a second."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus // 4))


@dataclass
class _Worker:
    proc: subprocess.Popen
    writer: asyncio.WriteTransport | None = None
    reader: asyncio.BaseTransport | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    alive: bool = True


class TokenizePool:
    """start() on the event loop, then `await encode(texts, add_special_tokens)`; close() at the end."""

    def __init__(self, tokenizer_json: str, workers: int) -> None:
        self.tokenizer_json = tokenizer_json
        self.size = workers
        self._workers: list[_Worker] = []
        self._ids = itertools.count()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, workers: int | None = None) -> "TokenizePool | None":
        """A pool for a transformers fast tokenizer's Rust tokenizer, or None without one."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        to_str = getattr(backend, "to_str", None)
        if to_str is None:
            return None
        return cls(to_str(), workers or pool_size())

    @property
    def alive(self) -> bool:
        return any(w.alive for w in self._workers)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(self.size):
            # a process group of its own: a Ctrl-C in the terminal reaches the servers, not a worker that
            # may still be importing (a KeyboardInterrupt traceback); the server closes its stdin to stop it
            proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    close_fds=True, process_group=0)
            w = _Worker(proc)
            w.reader, _ = await loop.connect_read_pipe(
                lambda w=w: FrameReader(lambda msg, w=w: self._on_result(w, msg), lambda w=w: self._on_lost(w)),
                proc.stdout)
            w.writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
            self._workers.append(w)
            self._send(w, self.tokenizer_json)

    @staticmethod
    def _send(w: _Worker, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        assert w.writer is not None
        w.writer.write(struct.pack("!i", len(data)) + data)

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text. Raises ValueError where the tokenizer refused a text, and
        TokenizerGone where its worker died (or none is left)."""
        live = [w for w in self._workers if w.alive]
        if not live:
            raise TokenizerGone("no tokenizing process is running")
        w = min(live, key=lambda w: len(w.pending))
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        w.pending[req_id] = fut
        self._send(w, (req_id, texts, add_special_tokens))
        return await fut

    def _on_result(self, w: _Worker, msg: tuple) -> None:
        req_id, ok, out = msg
        settle(w.pending, req_id, ok, out if ok else ValueError(out))

    def _on_lost(self, w: _Worker) -> None:
        if not w.alive:
            return
        w.alive = False
        code = w.proc.poll()
        if self._workers:  # not while closing
            log.error("a tokenizing process exited (%s); %d left", code, sum(x.alive for x in self._workers))
        pending, w.pending = w.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(TokenizerGone("the tokenizing process exited while it held this request"))

    def close(self) -> None:
        workers, self._workers = self._workers, []
        for w in workers:  # a worker exits when its stdin closes
            w.alive = False
            for t in (w.writer, w.reader):
                if t is not None:
                    t.close()
        for w in workers:
            try:
                w.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(2.0)
