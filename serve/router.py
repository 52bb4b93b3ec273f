"""Which data-parallel replica serves a request: the one holding the longest cached prefix of its
prompt, else the least loaded one.

The router cannot see the replicas' caches; it remembers which prompts it sent where. A prompt's
full blocks are named as the engine names them (kvcache/block_manager.py: a hash chained over the
block's tokens and its parent's hash, blocks of the engine's block size), and each replica keeps the
hashes of the blocks sent to it in an LRU table no larger than its KV pool: once a replica has had
to evict a block to make room, the router has usually forgotten it too. An approximation: the
engine may evict earlier under load, and a replica's own generated tokens are not tracked.

Rule: among the live replicas, take those with the longest match (at least one block) and, of
them, the least loaded; it wins unless it carries more than `balance_rel` x the least loaded
replica's sequences plus `balance_abs` (then a cache hit would cost more in queueing than it saves
in prefill). Otherwise, or without a match: the least loaded replica, by sequences in flight, then
prompt tokens in flight, then fewest requests routed so far (a round robin among idle replicas).

Torch-free, no I/O: tested in milliseconds.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvcache.block_manager import block_hash


@dataclass(frozen=True)
class RouterConfig:
    block_size: int
    capacity_blocks: tuple[int, ...]  # per replica: how many block hashes it remembers (its KV pool)
    balance_abs: int = 4  # sequences a cache hit may add beyond balance_rel x the least load
    balance_rel: float = 1.25

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {self.block_size}")
        if not self.capacity_blocks or any(c < 1 for c in self.capacity_blocks):
            raise ValueError(f"capacity_blocks must be one positive count per replica; got {self.capacity_blocks}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")

    @property
    def num_replicas(self) -> int:
        return len(self.capacity_blocks)


@dataclass(frozen=True)
class Load:
    """A replica's work in flight: sequences admitted and not finished, and their prompt tokens."""

    sequences: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Route:
    replica: int
    cached_tokens: int  # the prompt's tokens the router expects the replica to hold already
    reason: str  # "prefix" (a cached prefix decided) or "load"


class NoReplica(Exception):
    """Every replica has failed."""


def prompt_block_hashes(token_ids: Seq[int], block_size: int, root: int | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks, in order, from root (its LoRA adapter's:
    kvcache/block_manager.py lora_root)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        n = config.num_replicas
        self._tables: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self._alive = [True] * n
        self.routed = [0] * n  # requests sent to each replica
        self.prefix_routed = [0] * n  # of them, sent there for a cached prefix

    @property
    def alive(self) -> list[bool]:
        return list(self._alive)

    def route(self, token_ids: Seq[int], loads: Seq[Load | None], root: int | None = None) -> Route:
        """Pick the replica for a prompt and remember that it now holds the prompt's blocks.
        loads: one per replica; None for one that takes nothing now (stopping, or failing before
        remove() is called). root: the hash chain's root (the prompt's LoRA adapter's). Raises
        NoReplica when no replica can take it."""
        if len(loads) != self.config.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.config.num_replicas} replicas")
        live = [i for i, ok in enumerate(self._alive) if ok and loads[i] is not None]
        if not live:
            raise NoReplica("every replica has failed" if not any(self._alive) else "no replica is accepting requests")
        hashes = prompt_block_hashes(token_ids, self.config.block_size, root)
        load = {i: loads[i] for i in live}
        least = min(live, key=lambda i: (load[i].sequences, load[i].prompt_tokens, self.routed[i], i))
        matched = {i: self._matched_blocks(i, hashes) for i in live}
        best_match = max(matched.values())
        choice, reason = least, "load"
        if best_match > 0:
            holders = [i for i in live if matched[i] == best_match]
            best = min(holders, key=lambda i: (load[i].sequences, load[i].prompt_tokens, self.routed[i], i))
            limit = self.config.balance_rel * load[least].sequences + self.config.balance_abs
            if load[best].sequences <= limit:
                choice, reason = best, "prefix"
        self._remember(choice, hashes)
        self.routed[choice] += 1
        if reason == "prefix":
            self.prefix_routed[choice] += 1
        return Route(choice, matched[choice] * self.config.block_size, reason)

    def remove(self, replica: int) -> None:
        """The replica has failed: route nothing more to it, and forget what it held."""
        self._alive[replica] = False
        self._tables[replica].clear()

    def num_remembered(self, replica: int) -> int:
        return len(self._tables[replica])

    def _matched_blocks(self, replica: int, hashes: list[int]) -> int:
        table = self._tables[replica]
        n = 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[int]) -> None:
        table = self._tables[replica]
        # children first, so that a prefix is more recent than its continuations and outlives them
        for h in reversed(hashes):
            table[h] = None
            table.move_to_end(h)
        capacity = self.config.capacity_blocks[replica]
        while len(table) > capacity:
            table.popitem(last=False)
