"""What the lab's cost-of-a-request-field scripts share (logit_adjust_cost.py, prompt_logprobs_cost.py):
their arguments, an engine of dummy weights, fresh prompts for every run (nothing from the prefix
cache), and arms interleaved over rounds."""
from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def arm_arguments(doc: str, num_prompts: int, rounds: int) -> argparse.ArgumentParser:
    """--model, --num-prompts, --input-len, --rounds, --json; the script adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--json", default=None)
    return p


class DummyEngine:
    """LLM(model, load_format="dummy") and prompts of random tokens, new ones at each call."""

    def __init__(self, model: str, seed: int = 0) -> None:
        from serve import LLM

        self.llm = LLM(model, load_format="dummy")
        self.vocab = self.llm.engine.model_config.vocab_size
        self._rng = random.Random(seed)

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return [[self._rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def interleave(arms: dict[str, Any], rounds: int, run: Callable[[Any], T]) -> dict[str, list[T]]:
    """run(arm) for every arm in turn, `rounds` times: each arm's results, in round order."""
    results: dict[str, list[T]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            results[name].append(run(arm))
    return results
