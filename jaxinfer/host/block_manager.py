"""KV-cache blocks on the host: a free list, reference counts and per-request block tables.

Block 0 is reserved as the null block (padding rows of device block tables point at it), so
`num_blocks` pages hold `num_blocks - 1` usable blocks. Blocks are reference counted so that
several requests can share a prefix (n > 1 samples share their prompt's full blocks; prefix
caching can build on the same mechanism). A shared block is never written: sharing is
block-aligned and every request writes only past its shared prefix. Never imports jax.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.table(request_id)))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold num_tokens; False (and no change) if blocks run out."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > len(self.free_blocks):
            return False
        table = self.tables.setdefault(request_id, [])
        for _ in range(need):
            b = self.free_blocks.popleft()
            self.ref_counts[b] = 1
            table.append(b)
        return True

    def fork(self, src_id: str, dst_id: str, num_blocks: int) -> None:
        """dst shares the first num_blocks blocks of src (reference counted, read only)."""
        assert dst_id not in self.tables or not self.tables[dst_id], "fork into a non-empty table"
        shared = self.tables[src_id][:num_blocks]
        assert len(shared) == num_blocks
        for b in shared:
            self.ref_counts[b] += 1
        self.tables[dst_id] = list(shared)

    def free(self, request_id: str) -> None:
        for b in self.tables.pop(request_id, []):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def slot(self, request_id: str, position: int) -> int:
        """Flat KV slot of a token position: block * block_size + offset."""
        return self.tables[request_id][position // self.block_size] * self.block_size + position % self.block_size
