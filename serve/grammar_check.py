"""The server's check that a request's grammars compile for the model, before the request reaches
the engine: on worker threads (the event loop keeps streaming), cached by grammar text, within a
time limit. A grammar that fails or runs out of time is a 400."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.grammar import GrammarCompiler, GrammarError, GrammarTokenizer
from serve.errors import APIError


class GrammarChecker:
    def __init__(self, engine: Any, timeout_s: float, threads: int = 2) -> None:
        self.unsupported = GrammarTokenizer.supported(engine.tokenizer)
        self.timeout_s = timeout_s
        self.compiler: GrammarCompiler | None = None
        self.pool: ThreadPoolExecutor | None = None
        if self.unsupported is None:
            # the engine's own vocabulary index where it runs in this process, else one of ours
            masks = getattr(getattr(engine, "runner", None), "grammar", None)
            tokenizer = getattr(masks, "tokenizer", None)
            if tokenizer is None:
                eos = engine.tokenizer.eos_token_id
                tokenizer = GrammarTokenizer(engine.tokenizer, engine.model_config.vocab_size, [eos])
            self.compiler = GrammarCompiler(tokenizer)
            # two threads: a grammar that hangs past its time limit leaves the other one working
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedserve-grammar")

    def warm(self) -> None:
        """Build the vocabulary index now (~0.6 s), not on the first request."""
        if self.pool is not None and self.compiler is not None:
            self.pool.submit(self.compiler.tokenizer.get)

    async def check(self, grammars: list[tuple[str, str, bool]]) -> None:
        """grammars: (grammar, the request field it comes from, named in the error, whether decoding
        needs it); one not needed only checks the tools' schemas, skipped where grammars are not
        available."""
        if not grammars:
            return
        if self.compiler is None or self.pool is None:
            needed = [g for g in grammars if g[2]]  # tool_choice "auto" needs no grammar
            if not needed:
                return
            raise APIError(400, f"structured output and forced tool calls are not available here: {self.unsupported}",
                           param=needed[0][1])
        loop = asyncio.get_running_loop()
        for grammar, param, _ in grammars:
            try:
                await asyncio.wait_for(loop.run_in_executor(self.pool, self.compiler.compile, grammar), self.timeout_s)
            except GrammarError as e:
                raise APIError(400, f"the schema or grammar cannot be used: {e}", param=param,
                               code="invalid_grammar") from None
            except TimeoutError:
                raise APIError(400, f"the schema or grammar did not compile within {self.timeout_s:g} s; simplify it",
                               param=param, code="grammar_timeout") from None

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
