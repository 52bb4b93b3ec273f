"""The paged KV cache's allocator. Torch-free: it hands out block ids, the pool holds the tensors.

A block is owned by the sequences whose block tables list it; ref_count counts them. Free blocks
wait in a FIFO. Out of blocks is not an error: allocation answers None and the scheduler decides
whom to preempt.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and nothing taken) when fewer are free."""
        if n > len(self.free_blocks):
            return None
        out = [self.free_blocks.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def append(self, block_table: list[int], num_tokens: int) -> list[int] | None:
        """Grow block_table in place so it covers num_tokens tokens. Returns the blocks added
        (possibly none), or None when there are not enough free blocks (the table is unchanged)."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return []
        new = self.allocate(need)
        if new is not None:
            block_table.extend(new)
        return new

    def share(self, block: int) -> None:
        """Another owner takes a reference to an allocated block."""
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def free(self, block_table: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for b in block_table:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def check_integrity(self, block_tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless every block is free XOR owned, and ref counts equal the
        number of owning tables. block_tables: the tables of every live sequence."""
        owners = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                owners[b] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert owners[b] == self.ref_counts[b], f"block {b}: ref count {self.ref_counts[b]} but {owners[b]} owners"
            assert (b in free) == (owners[b] == 0), f"block {b}: free={b in free} with {owners[b]} owners"
