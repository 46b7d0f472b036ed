"""The bytes of the prefix cache's host tier: KV blocks copied between the device pool and host memory.
The block manager (host/host_tier.py) decides which blocks go where; this module moves them, a
step's copies batched: one gather of every offloaded block and one device-to-host copy, one scatter
of every restored block (per bucket of TRANSFER_BUCKETS blocks).

Every leaf of the KV pages pytree moves: each layer's K and V, the draft model's pages, int8/fp8
scales; every leaf has the blocks on axis 1 ([n_kv_heads, num_blocks, block_size, ...]). The host
copy of a leaf is one numpy buffer per distinct device shard, [heads of the shard, num_slots,
block_size, ...]: under tensor parallelism each device's shard of a block goes to (and comes back
from) its own buffer, never gathered across devices; a replicated leaf (the draft's pages, or KV
heads fewer than the devices) is kept once and put back on every device.
The gather writes its result straight to host memory: its output sharding is the pages' with
memory_kind="pinned_host" (page-locked buffers the device's DMA engines copy into on a GPU; XLA:CPU
has the same memory kind, so CPU runs this same path).
Order (host_tier.py): offloads are read from the device first, restores written next, the offloaded
bytes stored into their host slots last (at the next step's transfers: the gather's device-to-host
copy runs behind the step, and restores from those slots wait for it). Never imported by host/.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxinfer.host.host_tier import KVTransfers

# blocks one transfer program moves: a step's copies run as the fewest calls of these sizes (each
# size compiles once, at warm-up). Close together, since a padding block costs a whole block's copy:
# with (8, 64), bench/multiturn.py at concurrency 1 staged 64 blocks for ~8.5 restored per request
TRANSFER_BUCKETS = (8, 16, 32, 64)


def _bucket(n: int) -> int:
    return next((b for b in TRANSFER_BUCKETS if n <= b), TRANSFER_BUCKETS[-1])


@dataclass
class TransferResult:
    """What a step's transfers did: the host slots whose offload failed (their entries must be
    dropped) and the device blocks whose restore failed (not the cached K/V: recompute)."""
    failed_slots: list[int] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)


def _gather(pages, blocks):
    return jax.tree.map(lambda x: x[:, blocks], pages)        # each leaf: (H, M, bs, ...)


def _scatter(pages, blocks, values):
    # blocks past the pool (padding) are dropped
    return jax.tree.map(lambda x, v: x.at[:, blocks].set(v, mode="drop"), pages, values)


class HostKVStore:
    """The host tier's buffers and the two transfer programs (module docstring)."""

    def __init__(self, kv_pages, num_slots: int):
        leaves = jax.tree.leaves(kv_pages)
        self.num_slots = num_slots
        self.num_blocks = leaves[0].shape[1]
        self.treedef = jax.tree.structure(kv_pages)
        self.block_bytes = sum(x.nbytes // x.shape[1] for x in leaves)
        # per leaf: [(shard index, the devices holding it, numpy buffer)], one entry per distinct shard
        self.buffers = [self._buffers(x) for x in leaves]
        self._like = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        host = [x.sharding.with_memory_kind("pinned_host") for x in leaves]
        self._gather = jax.jit(_gather, out_shardings=jax.tree.unflatten(self.treedef, host))
        self._scatter = jax.jit(_scatter, donate_argnums=0)
        self._pending: list = []       # the last step's offloads: (host slots, gathered leaves)
        self.bytes_offloaded = self.bytes_restored = 0
        # host time: restores (staging the slots, the copies to the devices, dispatching the scatter);
        # offloads (storing the previous step's gathered bytes, dispatching this step's gather)
        self.restore_time_s = 0.0
        self.offload_time_s = 0.0

    def _buffers(self, x: jax.Array) -> list:
        shards: dict = {}
        for s in x.addressable_shards:
            key = _key(s.index)
            if key not in shards:
                shards[key] = ([], np.zeros((s.data.shape[0], self.num_slots, *s.data.shape[2:]), s.data.dtype))
            shards[key][0].append(s.device)
        return [(key, devices, buf) for key, (devices, buf) in shards.items()]

    # ---------------------------------------------------------------- programs
    def warmup(self, kv_pages):
        """Compile both programs at every bucket (serving then compiles nothing); returns the pages."""
        for m in TRANSFER_BUCKETS:
            jax.block_until_ready(self._gather(kv_pages, np.zeros(m, np.int32)))
            kv_pages = self._scatter(kv_pages, np.full(m, self.num_blocks, np.int32),
                                     self._stage([0] * m))     # all padding: nothing written
        return kv_pages

    def _stage(self, slots: list[int]) -> list:
        """The restored blocks' values as device arrays with the pages' shardings (one per leaf):
        each device gets its shard's rows of its own host buffer, every leaf's in one batched
        host-to-device copy, then each leaf's shards are assembled."""
        rows, devices, leaf_of = [], [], []
        for i, leaf_buffers in enumerate(self.buffers):
            for _, devs, buf in leaf_buffers:
                shard = buf[:, slots]                                  # (h, M, bs, ...), a copy
                rows += [shard] * len(devs)
                devices += devs
                leaf_of += [i] * len(devs)
        per_leaf: list[list] = [[] for _ in self._like]
        for i, arr in zip(leaf_of, jax.device_put(rows, devices)):
            per_leaf[i].append(arr)
        return jax.tree.unflatten(self.treedef, [
            jax.make_array_from_single_device_arrays((x.shape[0], len(slots), *x.shape[2:]), x.sharding, arrs)
            for x, arrs in zip(self._like, per_leaf)])

    # ---------------------------------------------------------------- a step's copies
    def run(self, kv_pages, transfers: KVTransfers) -> tuple:
        """Run a step's copies: the previous step's offloaded bytes land in their host slots (their
        gather was dispatched then; waiting for it here, not there, keeps async scheduling's overlap),
        this step's offloads are gathered (dispatched before the restores' scatter, which donates the
        pages, so they read the blocks first), then its restores are staged from the slots and
        scattered. Returns the new pages and a TransferResult; a failed copy loses what it moved,
        never the pages."""
        result = TransferResult()
        t0 = time.perf_counter()
        lost = self._flush(result)
        pending = []
        for chunk in _chunks(transfers.offload):
            blocks, slots = zip(*chunk)
            try:
                pending.append((list(slots), self._gather_blocks(kv_pages, list(blocks))))
                self.bytes_offloaded += len(chunk) * self.block_bytes
            except Exception:   # noqa: BLE001 -- any failure: the entries go, the request recomputes
                result.failed_slots += slots
        t1 = time.perf_counter()
        for chunk in _chunks(transfers.restore):
            slots, blocks = zip(*chunk)
            m = _bucket(len(chunk))
            try:
                if lost & set(slots):
                    raise RuntimeError("the offload that filled these host slots failed")
                values = self._stage(list(slots) + [0] * (m - len(chunk)))
            except Exception:   # noqa: BLE001
                result.failed_blocks += blocks
                result.failed_slots += slots
                continue
            idx = np.full(m, self.num_blocks, np.int32)
            idx[: len(chunk)] = blocks
            kv_pages = self._scatter(kv_pages, idx, values)
            self.bytes_restored += len(chunk) * self.block_bytes
        self._pending = pending
        self.offload_time_s += t1 - t0
        self.restore_time_s += time.perf_counter() - t1
        return kv_pages, result

    def _gather_blocks(self, kv_pages, blocks: list[int]) -> list:
        """Dispatch the gather of these blocks (padded to a bucket) into pinned host memory."""
        idx = np.zeros(_bucket(len(blocks)), np.int32)
        idx[: len(blocks)] = blocks
        return jax.tree.leaves(self._gather(kv_pages, idx))

    def _flush(self, result: TransferResult) -> set[int]:
        """Store the last step's gathered blocks into their host slots; returns the slots whose
        gather failed (reported in result: their entries are dropped, and restores from them fail)."""
        lost: set[int] = set()
        for slots, gathered in self._pending:
            try:
                leaves = [[np.asarray(by_key[key].data) for key, _, _ in leaf_buffers]
                          for leaf_buffers, by_key in zip(self.buffers, map(_shards_by_key, gathered))]
            except Exception:   # noqa: BLE001
                result.failed_slots += slots
                lost.update(slots)
                self.bytes_offloaded -= len(slots) * self.block_bytes
                continue
            for leaf_buffers, shards in zip(self.buffers, leaves):
                for (_, _, buf), rows in zip(leaf_buffers, shards):
                    buf[:, slots] = rows[:, : len(slots)]    # in order: a later write to a slot wins
        self._pending = []
        return lost


def _shards_by_key(x: jax.Array) -> dict:
    return {_key(s.index): s for s in x.addressable_shards}


def _key(index) -> tuple:
    return tuple((i.start, i.stop) for i in index)


def _chunks(pairs: list, size: int = TRANSFER_BUCKETS[-1]):
    for i in range(0, len(pairs), size):
        yield pairs[i: i + size]
