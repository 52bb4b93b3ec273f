"""A token id -> UTF-8 bytes table for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM).

With it, incremental detokenization is a bytes append and an incremental UTF-8 decode per token
instead of two calls into the tokenizer. Built once per tokenizer; None when the tokenizer is not
plain byte-level (then the detokenizer decodes through the tokenizer). A tokenizer may also bring
its own table (token_bytes_table(), as serve/build.py's TokenIdTokenizer does).
"""
from __future__ import annotations

import json
from typing import Any


def _byte_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's printable-character alphabet for the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes_table(tokenizer: Any, skip_special_tokens: bool = True) -> list[bytes] | None:
    own = getattr(tokenizer, "token_bytes_table", None)
    if callable(own):  # a tokenizer that knows its own table (serve/build.py's TokenIdTokenizer)
        return own(skip_special_tokens)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    byte_of = _byte_decoder()
    vocab = backend.get_vocab(with_added_tokens=True)
    added = {t["content"]: t.get("special", False) for t in spec.get("added_tokens", [])}
    table = [b""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        if piece in added:
            table[i] = b"" if (added[piece] and skip_special_tokens) else piece.encode()
        elif all(ch in byte_of for ch in piece):
            table[i] = bytes(byte_of[ch] for ch in piece)
        else:
            return None  # not a byte-level vocabulary after all
    return table
