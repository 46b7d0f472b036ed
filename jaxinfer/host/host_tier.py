"""The prefix cache's second tier: cached KV blocks evicted from the device pool, kept in host memory
and copied back on a hit (vLLM's CPU offloading, SGLang's HiCache). Pure Python; never imports jax:
this module decides, the runner (jaxinfer/kv_transfer.py) moves the bytes.

  - Slots: the byte budget holds `num_slots` blocks of `block_bytes` (every layer's K and V, the
    draft model's pages and int8/fp8 scales included). An entry is keyed by the block's chained
    hash (block_manager.block_hash: salted, so tenants stay isolated exactly as on the device).
  - Offload: when the block manager evicts a cached device block (it is about to be overwritten),
    `offload` gives the hash a host slot (a free one, else the least recently used entry's) and
    queues a (device block -> host slot) copy. A hash the tier holds already costs no copy: entries
    are inclusive, a restored block keeps its host copy.
  - Restore: a lookup that misses the device but hits the tier (`get`) takes a fresh device block and
    queues a (host slot -> device block) copy; the block is cached on the device again from then on.
  - A step's copies (`take_transfers`) run before the step, in this order: offloads read their
    device blocks, then restores write theirs (a restore may write a block evicted in the same step),
    then the offloaded bytes land in their host slots (a restore may read a slot whose entry the same
    step evicted). Until then an entry being written is invisible to lookups (`pending`) and an
    entry being read is pinned (`busy`): the LRU never takes its slot.
  - Failure: a copy that fails drops its entries (`drop`); the request recomputes those tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier: its hash, its slot, and whether the draft model's
    pages in it lagged the target's when it was offloaded (block_manager.draft_stale)."""
    block_hash: bytes
    slot: int
    draft_stale: bool = False


@dataclass
class KVTransfers:
    """One step's copies between the device pool and the host tier, in the order they must run."""
    offload: list[tuple[int, int]] = field(default_factory=list)   # (device block, host slot)
    restore: list[tuple[int, int]] = field(default_factory=list)   # (host slot, device block)

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore)


class HostTier:
    """An LRU of evicted prefix blocks in `num_slots` host slots (see the module docstring)."""

    def __init__(self, budget_bytes: int, block_bytes: int):
        assert block_bytes > 0
        if budget_bytes < block_bytes:
            raise ValueError(f"kv_offload_bytes={budget_bytes} is smaller than one KV block ({block_bytes} bytes: "
                             f"every layer's K and V of block_size tokens, draft model and scales included); "
                             f"give at least {block_bytes} bytes (--kv-offload-gb {block_bytes / 2**30:.6f}), "
                             f"or 0 for no host tier")
        self.block_bytes = block_bytes
        self.num_slots = budget_bytes // block_bytes
        self.entries: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, least recently used first
        self.slot_hash: dict[int, bytes] = {}
        self.draft_stale: dict[bytes, bool] = {}
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.pending: set[bytes] = set()     # offloaded this step: the bytes are not in the slot yet
        self.busy: set[int] = set()          # read by a restore this step: the LRU must not take them
        self._transfers = KVTransfers()
        # counters (Engine.stats: kv_host_*)
        self.hits = self.misses = 0          # lookups that went on past the device's cached prefix
        self.blocks_offloaded = self.blocks_restored = self.blocks_dropped = self.offload_skipped = 0

    @property
    def num_held(self) -> int:
        return len(self.entries)

    @property
    def bytes_held(self) -> int:
        return len(self.entries) * self.block_bytes

    def get(self, h: bytes) -> HostHit | None:
        """The entry of hash h, if its bytes are in the tier (no change)."""
        slot = self.entries.get(h)
        if slot is None or h in self.pending:
            return None
        return HostHit(h, slot, self.draft_stale[h])

    def claim(self, hit: HostHit, block: int) -> None:
        """Restore hit into device block `block` before this step runs: the entry becomes the most
        recently used and its slot is pinned until the step's transfers are taken."""
        self.entries.move_to_end(hit.block_hash)
        self.busy.add(hit.slot)
        self._transfers.restore.append((hit.slot, block))
        self.blocks_restored += 1

    def offload(self, h: bytes, block: int, draft_stale: bool) -> None:
        """Device block `block`, which holds hash h, is being evicted: keep it (a copy unless the tier
        holds h already). With every slot pinned by this step's restores, it is not kept."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        slot = self._free_slot()
        if slot is None:
            self.offload_skipped += 1
            return
        self.entries[h] = slot
        self.slot_hash[slot] = h
        self.draft_stale[h] = draft_stale
        self.pending.add(h)
        self._transfers.offload.append((block, slot))
        self.blocks_offloaded += 1

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for h, slot in self.entries.items():      # the least recently used entry not pinned
            if slot not in self.busy:
                self._forget(h)
                return self.free_slots.pop()
        return None

    def _forget(self, h: bytes) -> None:
        slot = self.entries.pop(h)
        del self.slot_hash[slot], self.draft_stale[h]
        self.pending.discard(h)
        self.free_slots.append(slot)

    def count_lookup(self, hits: list, usable: int) -> None:
        """An admitted request's prefix lookup: of its `usable` full blocks, the tier restored its
        HostHits (hits) and missed those neither tier holds (misses), counted in blocks."""
        self.hits += sum(isinstance(h, HostHit) for h in hits)
        self.misses += usable - len(hits)

    def take_transfers(self) -> KVTransfers:
        """This step's copies; once taken the runner runs them before the step, so the offloaded
        entries become visible and the restored slots unpinned."""
        out, self._transfers = self._transfers, KVTransfers()
        self.pending.clear()
        self.busy.clear()
        return out

    def drop(self, slots) -> None:
        """The entries in these slots are not to be trusted (a copy failed): forget them."""
        for slot in slots:
            h = self.slot_hash.get(slot)
            if h is not None:
                self._forget(h)
                self.blocks_dropped += 1

    def clear(self) -> int:
        """Forget every entry (reset_prefix_cache); returns how many."""
        dropped = len(self.entries)
        for h in list(self.entries):
            self._forget(h)
        return dropped

    def check(self) -> None:
        """Leak check (tests, between steps): every slot is free or held by exactly one entry, and no
        transfer is left half-done."""
        assert not self._transfers and not self.pending and not self.busy, "host-tier transfers left pending"
        held = set(self.entries.values())
        assert len(held) == len(self.entries) and not held & set(self.free_slots), "a host slot is held twice"
        assert len(held) + len(self.free_slots) == self.num_slots, "a host slot leaked"
        assert self.slot_hash == {s: h for h, s in self.entries.items()}
