"""KV-cache blocks on the host: a free queue, reference counts, per-request block tables, and the
prefix cache. Never imports jax.

Block 0 is reserved as the null block (padding rows of device block tables point at it), so
`num_blocks` pages hold `num_blocks - 1` usable blocks. Blocks are reference counted: n > 1
samples share their prompt's full blocks, and with prefix caching any request shares the cached
full blocks of its longest cached prefix. A shared block is never written: sharing is
block-aligned and every request writes only past its shared prefix.

Prefix caching (vLLM's automatic prefix caching, in outline):
  - A full block's content hash is chained: hash(parent block's hash, the block's token ids), and
    the first block's parent is the request's cache salt, so the same tokens behind a different
    prefix, or under another salt, never match. The hash is SHA-256 (truncated to 128 bits):
    tenants cannot forge a collision to read each other's blocks.
  - `register` gives a request's full, written blocks their hashes; `lookup` returns the longest
    chain of cached blocks for a list of hashes; `allocate(..., prefix=hits)` takes them.
  - A block whose reference count drops to zero keeps its hash and K/V and joins the free queue's
    tail (least recently used first). A request frees its blocks deepest first, so the deepest
    blocks of a prefix sit nearer the head and are evicted before the shared roots. Blocks with no
    hash (partial blocks, duplicates) go to the head: they hold nothing worth keeping.
  - Allocation takes the free queue's head; if that block is cached its hash is dropped (an
    eviction). A cache hit on a free block takes it out of the queue.
  - Invariant: every usable block is either in a table (reference count > 0) or in the free queue
    (reference count 0, cached or not); cached blocks are exactly the blocks that carry a hash.

A draft model's pages (speculative_method="draft") use the same blocks. Decode steps that do not
speculate skip the draft, so a block can hold the target's K/V but not the draft's: `draft_stale`
marks such blocks, and a request that starts from cached blocks trusts the draft's pages only up
to the first stale one (`draft_valid_blocks`); the draft recomputes the rest (scheduler.py).

With a host tier (host_tier.py, EngineConfig.kv_offload_bytes) an evicted cached block is offloaded
to host memory rather than forgotten, and `lookup` goes on past the device's cached prefix into the
tier: its hits (HostHit) are restored into fresh blocks by `allocate`. The block manager only
decides: `take_transfers` hands the step's copies to the runner, which moves the bytes.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .host_tier import HostHit, HostTier, KVTransfers


def block_hash(parent: bytes | None, token_ids, salt: str | None = None) -> bytes:
    """Content hash of a full block: chained from its parent's hash (None for the first block, whose
    parent is the request's salt)."""
    h = hashlib.sha256()
    if parent is None:
        h.update(b"root:" + (salt or "").encode("utf-8", "surrogatepass") + b"\x00")
    else:
        h.update(parent)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()[:16]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 host_tier: HostTier | None = None, state_slots: int = 0):
        """host_tier: the prefix cache's host tier (only with enable_caching). state_slots: a model with
        conv layers keeps each sequence's conv state in one of this many slots (1 .. state_slots; the
        device's slot 0 is never handed out): a request takes one with its first blocks and gives it
        back with them (the engine passes max_num_seqs, so every running sequence has one; an
        allocation that found none free would fail like one short of blocks). No prefix caching nor
        forks then: a shared block holds no conv state."""
        assert not (state_slots and enable_caching), "a conv state is not in any block: no prefix caching"
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self.host = host_tier if enable_caching else None
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        # the free queue: head = next to allocate (an OrderedDict gives O(1) removal on a cache hit)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.tables: dict[str, list[int]] = {}
        self.hashes: list[bytes | None] = [None] * num_blocks   # the hash a cached block carries
        self.cached: dict[bytes, int] = {}                      # hash -> block
        self._registered: dict[str, int] = {}                   # request -> table blocks registered
        self.draft_stale = np.zeros(num_blocks, np.bool_)       # the draft's K/V lags the target's here
        self._draft_marks: dict[str, tuple[int, int, int]] = {}  # request -> (lo, hi, table length) marked
        self.num_evictions = 0
        self._needs_state = state_slots > 0
        self.state_free: list[int] = list(range(state_slots, 0, -1))   # popped from the end: 1 first
        self.state_of: dict[str, int] = {}                            # request -> its state slot

    @property
    def free_blocks(self) -> list[int]:
        """The free queue, head first."""
        return list(self.free_queue)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones, cached-and-evictable ones included."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.table(request_id)))

    def _take(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.hashes[b]
        if h is not None:                       # evict: the block is about to be overwritten
            self.hashes[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.host is not None:       # its K/V is still in the block until this step runs
                    self.host.offload(h, b, bool(self.draft_stale[b]))
            self.num_evictions += 1
        self.ref_counts[b] = 1
        self.draft_stale[b] = False     # nothing in it yet: its owner's counters say what is written
        return b

    def allocate(self, request_id: str, num_tokens: int, prefix: list[int] | tuple[int, ...] = ()) -> bool:
        """Grow the request's table to hold num_tokens; False (and no change) if blocks run out.
        prefix: cached blocks (from `lookup`) the request starts with; only for an empty table. Its
        HostHits take fresh blocks that the step's transfers restore (and cache) before the step runs."""
        if prefix:
            assert not self.table(request_id), "a cached prefix starts an empty table"
            on_device = [b for b in prefix if not isinstance(b, HostHit)]
            reclaimed = sum(1 for b in on_device if self.ref_counts[b] == 0)
            need = max(0, self.blocks_for(num_tokens) - len(prefix)) + len(prefix) - len(on_device)
            if need + reclaimed > len(self.free_queue):
                return False
            for b in on_device:         # first: taking blocks for the restores must not evict these
                if self.ref_counts[b] == 0:
                    del self.free_queue[b]
                self.ref_counts[b] += 1
            for hit in prefix:          # pinned before any take: an offload must not reuse their slots
                if isinstance(hit, HostHit):
                    self.host.busy.add(hit.slot)
            self.tables[request_id] = [self._restore(b) if isinstance(b, HostHit) else b for b in prefix]
            self._registered[request_id] = len(prefix)
        need = self.num_new_blocks(request_id, num_tokens)
        if need > len(self.free_queue):
            return False
        if self._needs_state and request_id not in self.state_of:
            if not self.state_free:
                return False
            self.state_of[request_id] = self.state_free.pop()
        table = self.tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._take())
        return True

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the table's blocks past num_tokens: taken by this schedule for tokens it then left
        to a later step (Scheduler._fit_bucket), so never written nor cached; they are reused first."""
        table = self.tables.get(request_id, [])
        while len(table) > self.blocks_for(num_tokens):
            b = table.pop()
            assert self.ref_counts[b] == 1 and self.hashes[b] is None, "shrink past a written block"
            self.ref_counts[b] = 0
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def fork(self, src_id: str, dst_id: str, num_blocks: int) -> None:
        """dst shares the first num_blocks blocks of src (reference counted, read only)."""
        assert not self._needs_state, "a fork would share no conv state (engine.py forks at 0 then)"
        assert dst_id not in self.tables or not self.tables[dst_id], "fork into a non-empty table"
        shared = self.tables[src_id][:num_blocks]
        assert len(shared) == num_blocks
        for b in shared:
            self.ref_counts[b] += 1
        self.tables[dst_id] = list(shared)
        self._registered[dst_id] = min(num_blocks, self._registered.get(src_id, 0))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, deepest first; cached ones stay cached (LRU tail)."""
        self._registered.pop(request_id, None)
        self._draft_marks.pop(request_id, None)
        if request_id in self.state_of:
            self.state_free.append(self.state_of.pop(request_id))
        for b in reversed(self.tables.pop(request_id, [])):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.hashes[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def _restore(self, hit: HostHit) -> int:
        """A fresh block that this step's transfers fill from the host tier; cached from now on (a
        later lookup in this step finds it on the device: the copy runs before the step)."""
        b = self._take()
        self.host.claim(hit, b)
        self.hashes[b] = hit.block_hash
        self.cached[hit.block_hash] = b
        self.draft_stale[b] = hit.draft_stale
        return b

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: list[bytes]) -> list[int | HostHit]:
        """The cached blocks of the longest cached prefix of a chain of block hashes (no change): a
        device block, or with a host tier a HostHit where only the tier holds it."""
        hits = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None and self.host is not None:
                b = self.host.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def take_transfers(self) -> KVTransfers:
        """The copies between the device pool and the host tier that the blocks allocated since the
        last call need, to run before the step that uses them (host_tier.py: their order)."""
        return self.host.take_transfers() if self.host is not None else KVTransfers()

    def restore_failed(self, blocks) -> None:
        """The restore copies into these blocks failed: their contents are not the cached K/V. They
        stop being cached (the requests holding them must recompute: Scheduler.recompute)."""
        for b in blocks:
            h = self.hashes[b]
            if h is not None:
                self.hashes[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]

    def register(self, request_id: str, hashes: list[bytes], num_full: int) -> None:
        """The request's first num_full table blocks are full and their K/V written (or being
        written by a step already dispatched, which runs before any later step that reads them):
        cache those not yet cached. A hash already cached elsewhere keeps its block; this copy
        stays private and is freed as usual."""
        if not self.enable_caching:
            return
        table = self.tables.get(request_id)
        if table is None:
            return
        start = self._registered.get(request_id, 0)
        num_full = min(num_full, len(table), len(hashes))
        for i in range(start, num_full):
            b, h = table[i], hashes[i]
            if self.hashes[b] is None and h not in self.cached:
                self.hashes[b] = h
                self.cached[h] = b
        self._registered[request_id] = max(start, num_full)

    def mark_draft(self, request_id: str, draft_tokens: int, computed_tokens: int) -> None:
        """The request's target K/V covers its first computed_tokens positions, the draft's its first
        draft_tokens: blocks holding positions in between are draft-stale, those below are not."""
        table = self.tables.get(request_id)
        if not table:
            return
        lo = min(draft_tokens // self.block_size, len(table))
        hi = min(self.blocks_for(computed_tokens), len(table)) if computed_tokens > draft_tokens else lo
        if self._draft_marks.get(request_id) == (lo, hi, len(table)):
            return      # (a lagging row's range moves once a block: most steps change nothing)
        self._draft_marks[request_id] = (lo, hi, len(table))
        self.draft_stale[table[:lo]] = False
        self.draft_stale[table[lo:hi]] = True

    def draft_valid_blocks(self, blocks: list[int | HostHit]) -> int:
        """How many leading blocks of a cached prefix hold the draft's K/V too."""
        stale = [b.draft_stale if isinstance(b, HostHit) else bool(self.draft_stale[b]) for b in blocks]
        return stale.index(True) if True in stale else len(blocks)

    def reset_cache(self) -> int:
        """Forget every cached hash (the blocks stay where they are); returns how many were dropped.
        Blocks in use keep their K/V; free ones become plain free blocks, in their queue places."""
        dropped = len(self.cached)
        for b in self.cached.values():
            self.hashes[b] = None
        self.cached.clear()
        if self.host is not None:
            dropped += self.host.clear()
        return dropped

    def slot(self, request_id: str, position: int) -> int:
        """Flat KV slot of a token position: block * block_size + offset."""
        return self.tables[request_id][position // self.block_size] * self.block_size + position % self.block_size
