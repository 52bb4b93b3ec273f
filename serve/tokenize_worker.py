"""A tokenizing process of serve/tokenize_pool.py, run as `python serve/tokenize_worker.py`: it
imports nothing of the project, so it starts in a fraction of a second.

Over stdin and stdout, in multiprocessing Connection frames of pickles: first the Rust tokenizer's
JSON, then (id, texts, add_special_tokens) in and (id, ok, token ids or the error) out, until stdin
closes. It runs in a process group of its own, which a terminal's Ctrl-C does not reach: the server
decides, and closes stdin when it stops.
"""
from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    commands = Connection(os.dup(sys.stdin.fileno()), writable=False)
    results = Connection(os.dup(sys.stdout.fileno()), readable=False)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(commands.recv())
    except (EOFError, OSError):
        return 0
    while True:
        try:
            req_id, texts, add = commands.recv()
        except (EOFError, OSError):
            return 0
        try:
            out: Any = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=add)]
            ok = True
        except Exception as e:  # noqa: BLE001 - the request fails, the worker stays
            out, ok = f"{type(e).__name__}: {e}", False
        try:
            results.send((req_id, ok, out))
        except OSError:
            return 0


if __name__ == "__main__":
    sys.exit(main())
