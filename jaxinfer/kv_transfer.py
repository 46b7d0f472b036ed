"""The bytes of the prefix cache's host tier: KV blocks copied between the device pool and host memory.
The block manager (host/host_tier.py) decides which blocks go where; this module moves them, a
step's copies batched: one gather of every offloaded block and one device-to-host copy, one scatter
of every restored block (per bucket of TRANSFER_BUCKETS blocks).

Every leaf of the KV pages pytree moves: each layer's K and V, the draft model's pages, int8/fp8
scales; every leaf has the blocks on axis 1 ([n_kv_heads, num_blocks, block_size, ...]).

Host layout: a block is one contiguous row of bytes. Leaves placed alike (the same sharding of the
heads) form a group, and a group's host copy is one uint8 buffer [num_slots, row bytes] per distinct
device shard (a part): a row holds that shard of the block of every leaf of the group, leaf after
leaf, each in its own dtype's bytes. So a step's restore is one numpy row gather and one
host-to-device copy per part (one in all on one device), not one per layer and per K/V, and an
offload lands with one row store per part. The transfer programs pack and unpack the rows on the
device (a bitcast and a transpose per leaf, run per device shard under jax.shard_map). Under tensor
parallelism each device's shard of a block goes to (and comes back from) its own part's buffer,
never gathered across devices; a replicated group (the draft model's pages, or KV heads fewer than
the devices) is kept once and put back on every device.
The gather writes its result straight to host memory: its output sharding has memory_kind=
"pinned_host" (page-locked buffers the device's DMA engines copy into on a GPU; XLA:CPU has the same
memory kind, so CPU runs this same path).
Order (host_tier.py): offloads are read from the device first, restores written next, the offloaded
bytes stored into their host slots last (at the next step's transfers: the gather's device-to-host
copy runs behind the step, and restores from those slots wait for it). Never imported by host/.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

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


@dataclass
class _Part:
    """One distinct device shard of a group: the devices holding it, its place on the flat rows'
    first axis, and its host buffer [num_slots, row bytes] (uint8)."""
    devices: list
    index: int
    buffer: np.ndarray


@dataclass
class _Group:
    """Leaves placed alike: their indexes in jax.tree.leaves(pages), their PartitionSpec (None: one
    device, no mesh), the flat rows' sharding ([parts, blocks, row bytes], split over the parts), the
    bytes of one block's shard of the group, and its parts."""
    leaves: list[int]
    spec: PartitionSpec | None
    flat_sharding: jax.sharding.Sharding
    row_bytes: int
    parts: list[_Part]

    def flat_shape(self, m: int) -> tuple[int, int, int]:
        return (len(self.parts), m, self.row_bytes)

    def per_shard(self, fn, n_in_leaves: int, leaves_out: bool):
        """fn over each device's shard of the group's leaves (jax.shard_map over the flat rows' mesh:
        the leaves and the rows split alike, along their first axis), or fn itself on one device.
        fn(leaves, blocks[, rows]) -> rows (gather) or leaves (scatter)."""
        if self.spec is None:
            return fn
        leaf_specs = [self.spec] * n_in_leaves
        in_specs = (leaf_specs, PartitionSpec(), self.spec) if leaves_out else (leaf_specs, PartitionSpec())
        return jax.shard_map(fn, mesh=self.flat_sharding.mesh, in_specs=in_specs,
                             out_specs=leaf_specs if leaves_out else self.spec)


def _leaf_row_bytes(shape: tuple, dtype) -> int:
    """Bytes of one block of a (local) leaf [heads, num_blocks, block_size, ...]."""
    return shape[0] * math.prod(shape[2:]) * np.dtype(dtype).itemsize


def _pack(leaves: list, blocks) -> jax.Array:
    """(local) leaves' blocks -> [1, M, row bytes] uint8: per block, every leaf's bytes in turn."""
    m = blocks.shape[0]
    pieces = []
    for x in leaves:
        v = jnp.moveaxis(x[:, blocks], 1, 0).reshape(m, -1)             # (M, heads * block_size * ...)
        pieces.append(jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(m, -1))
    return jnp.concatenate(pieces, axis=1)[None]


def _unpack_scatter(leaves: list, blocks, flat) -> list:
    """Write rows [1, M, row bytes] (_pack's layout) into the (local) leaves at `blocks`; blocks past
    the pool (padding) are dropped."""
    rows, out, off = flat[0], [], 0
    m = rows.shape[0]
    for x in leaves:
        size = jnp.dtype(x.dtype).itemsize
        n = _leaf_row_bytes(x.shape, x.dtype)
        piece = rows[:, off: off + n]
        if size > 1:
            piece = piece.reshape(m, n // size, size)
        v = jax.lax.bitcast_convert_type(piece, x.dtype).reshape(m, x.shape[0], *x.shape[2:])
        out.append(x.at[:, blocks].set(jnp.moveaxis(v, 0, 1), mode="drop"))
        off += n
    return out


def _groups(leaves: list, num_slots: int) -> list[_Group]:
    """The leaves grouped by placement (one device; heads split over a mesh axis; replicated), each
    group's parts with their zeroed host buffers."""
    keyed: dict = {}
    for i, x in enumerate(leaves):
        s = x.sharding
        if isinstance(s, NamedSharding):
            spec = tuple(s.spec) + (None,) * (x.ndim - len(s.spec))
            if any(a is not None for a in spec[1:]):
                raise ValueError(f"the host tier moves KV pages split over their heads only; a leaf is "
                                 f"placed with {s.spec}")
            key = ("mesh", s.mesh, spec[0])
        elif isinstance(s, SingleDeviceSharding):
            key = ("device", next(iter(s.device_set)))
        else:
            raise ValueError(f"the host tier cannot move KV pages placed with {type(s).__name__}")
        keyed.setdefault(key, []).append(i)
    groups = []
    for key, idx in keyed.items():
        if key[0] == "mesh":
            mesh, axis = key[1], key[2]
            spec = PartitionSpec(axis)
            n_parts = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ()))
            flat = NamedSharding(mesh, spec)
        else:
            spec, n_parts, flat = None, 1, SingleDeviceSharding(key[1])
        row = sum(_leaf_row_bytes((leaves[i].shape[0] // n_parts, *leaves[i].shape[1:]), leaves[i].dtype) for i in idx)
        holders: dict[int, list] = {}
        for dev, index in flat.devices_indices_map((n_parts, 1, row)).items():
            holders.setdefault(index[0].start or 0, []).append(dev)
        parts = [_Part(devs, p, np.zeros((num_slots, row), np.uint8)) for p, devs in sorted(holders.items())]
        groups.append(_Group(idx, spec, flat, row, parts))
    return groups


class HostKVStore:
    """The host tier's buffers and the two transfer programs (module docstring)."""

    def __init__(self, kv_pages, num_slots: int):
        leaves = jax.tree.leaves(kv_pages)
        self.num_slots = num_slots
        self.num_blocks = leaves[0].shape[1]
        self.treedef = jax.tree.structure(kv_pages)
        self.block_bytes = sum(x.nbytes // x.shape[1] for x in leaves)
        self.groups = _groups(leaves, num_slots)
        gathers = [g.per_shard(_pack, len(g.leaves), leaves_out=False) for g in self.groups]
        scatters = [g.per_shard(_unpack_scatter, len(g.leaves), leaves_out=True) for g in self.groups]
        groups = self.groups

        def gather(pages, blocks):
            xs = jax.tree.leaves(pages)
            return [f([xs[i] for i in g.leaves], blocks) for f, g in zip(gathers, groups)]

        def scatter(pages, blocks, flats):
            xs = jax.tree.leaves(pages)
            for f, g, rows in zip(scatters, groups, flats):
                for i, x in zip(g.leaves, f([xs[i] for i in g.leaves], blocks, rows)):
                    xs[i] = x
            return jax.tree.unflatten(self.treedef, xs)

        self._gather = jax.jit(gather, out_shardings=[g.flat_sharding.with_memory_kind("pinned_host")
                                                      for g in groups])
        self._scatter = jax.jit(scatter, donate_argnums=0)
        self._pending: list = []       # the last step's offloads: (host slots, gathered rows per group)
        self.bytes_offloaded = self.bytes_restored = 0
        # host time: restores (staging the slots, the copies to the devices, dispatching the scatter);
        # offloads (storing the previous step's gathered bytes, dispatching this step's gather)
        self.restore_time_s = 0.0
        self.offload_time_s = 0.0

    # ---------------------------------------------------------------- programs
    def warmup(self, kv_pages):
        """Compile both programs at every bucket (serving then compiles nothing); returns the pages."""
        for m in TRANSFER_BUCKETS:
            jax.block_until_ready(self._gather(kv_pages, np.zeros(m, np.int32)))
            kv_pages = self._scatter(kv_pages, np.full(m, self.num_blocks, np.int32),
                                     self._stage([0] * m))     # all padding: nothing written
        return kv_pages

    def _stage(self, slots: list[int]) -> list:
        """The restored blocks' rows as device arrays, one per group ([parts, M, row bytes], each
        device holding its part's rows): one numpy row gather per part, every part's rows to its
        devices in one batched host-to-device copy, then each group's array assembled."""
        rows, devices, group_of = [], [], []
        for gi, g in enumerate(self.groups):
            for part in g.parts:
                r = part.buffer[slots][None]                    # (1, M, row bytes), a copy
                rows += [r] * len(part.devices)
                devices += part.devices
                group_of += [gi] * len(part.devices)
        per_group: list[list] = [[] for _ in self.groups]
        for gi, arr in zip(group_of, jax.device_put(rows, devices)):
            per_group[gi].append(arr)
        return [jax.make_array_from_single_device_arrays(g.flat_shape(len(slots)), g.flat_sharding, arrs)
                for g, arrs in zip(self.groups, per_group)]

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
        """Dispatch the gather of these blocks (padded to a bucket) into pinned host memory: one
        array of rows per group."""
        idx = np.zeros(_bucket(len(blocks)), np.int32)
        idx[: len(blocks)] = blocks
        return self._gather(kv_pages, idx)

    def _flush(self, result: TransferResult) -> set[int]:
        """Store the last step's gathered blocks into their host slots; returns the slots whose
        gather failed (reported in result: their entries are dropped, and restores from them fail)."""
        lost: set[int] = set()
        for slots, gathered in self._pending:
            try:
                rows = [[np.asarray(_part_shard(x, part.index)) for part in g.parts]
                        for g, x in zip(self.groups, gathered)]
            except Exception:   # noqa: BLE001
                result.failed_slots += slots
                lost.update(slots)
                self.bytes_offloaded -= len(slots) * self.block_bytes
                continue
            for g, per_part in zip(self.groups, rows):
                for part, r in zip(g.parts, per_part):
                    part.buffer[slots] = r[0, : len(slots)]    # in order: a later write to a slot wins
        self._pending = []
        return lost


def _part_shard(x: jax.Array, index: int) -> jax.Array:
    """The data of x's shard at `index` on the flat rows' first axis."""
    return next(s.data for s in x.addressable_shards if (s.index[0].start or 0) == index)


def _chunks(pairs: list, size: int = TRANSFER_BUCKETS[-1]):
    for i in range(0, len(pairs), size):
        yield pairs[i: i + size]
