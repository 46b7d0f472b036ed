"""The bytes of the prefix cache's host tier: KV blocks copied between the device pool and host memory.
The block manager (host/host_tier.py) decides which blocks go where; this module moves them, a
step's copies batched: one gather of every offloaded block and one scatter of every restored block
(per bucket of TRANSFER_BUCKETS blocks), each program making its own copies between the devices and
pinned host memory.

Every leaf of the KV pages pytree moves: each layer's K and V, the draft model's pages, int8/fp8
scales; every leaf has the blocks on axis 1 ([n_kv_heads, num_blocks, block_size, ...]).

Host layout: a block is one contiguous row of bytes per distinct device shard, in pinned host memory.
Leaves placed alike (the same sharding of the heads) form a group; a group's row of a block holds
every leaf's bytes of that block (that device shard's, a part), leaf after leaf, each in its own
dtype's bytes: every layer's K and V in one row, so a block moves as one copy per part,
not one per layer and per K/V. The transfer programs pack and unpack the rows on the device (a
bitcast and a transpose per leaf, run per device shard under jax.shard_map).
The tier's rows are jax arrays in memory_kind="pinned_host", one per block and group (a replicated
group's: one per part, on the part's first device): the offload's gather writes them there itself (its outputs' sharding has that memory kind:
page-locked buffers the device's DMA engines copy into on a GPU) and the tier keeps those very
arrays; a restore hands them to the scatter program, which copies them to the device itself
(jax.device_put to jax.memory.Space.Device inside the program, as jax's parameter offloading does:
page-locked to device, the DMA engines again), so no host CPU copies a byte either way. Where a
platform cannot compile that, warm-up falls back to copying them with jax.device_put before the
program (copy_in_program=False). XLA:CPU has the same memory kinds, so CPU runs this same path. (Before 2026-12-03 the rows lived in numpy buffers [num_slots, row bytes]: an
offload copied the gathered bytes into them and a restore gathered rows from them into a pageable
array, two host copies each way; on a GPU a pageable host-to-device copy is also staged through a
pinned buffer.)
Under tensor parallelism each device's shard of a block goes to (and comes back from) its own row,
never gathered across devices; a replicated group (the draft model's pages, or KV heads fewer than
the devices) is kept once, on its first device, and copied from there to the others on a restore.
Order: the previous step's gathers are checked (a failed one loses its slots), the restores' rows are
looked up, this step's offloads are gathered (dispatched before the restores' scatter, which donates
the pages: a restore may write a block evicted in the same step), then the restores are copied and
scattered. Never imported by host/.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxinfer.host.host_tier import KVTransfers

log = logging.getLogger(__name__)

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
    """One distinct device shard of a group: the devices holding it (its host copy is the first one's,
    put back on all of them) and its place on the rows' first axis."""
    devices: list
    index: int


@dataclass
class _Group:
    """Leaves placed alike: their indexes in jax.tree.leaves(pages), their PartitionSpec (None: one
    device, no mesh), a block's rows' sharding ([parts, row bytes], split over the parts, in device
    memory), the bytes of one block's shard of the group, and its parts."""
    leaves: list[int]
    spec: PartitionSpec | None
    row_sharding: jax.sharding.Sharding
    row_bytes: int
    parts: list[_Part]
    # whether a restore hands this group's host rows to the scatter program, which copies them to the
    # devices itself (HostKVStore's copy_in_program, and whole_rows); else they are copied to the
    # devices before the program
    copied_in_program: bool = True

    @property
    def row_shape(self) -> tuple[int, int]:
        return (len(self.parts), self.row_bytes)

    @property
    def whole_rows(self) -> bool:
        """Every part on one device: a block's gathered [parts, row bytes] array is kept as it is (no
        shard held twice); else (a replicated part) each part's row is kept once, on its first device."""
        return all(len(p.devices) == 1 for p in self.parts)

    @property
    def staged_sharding(self) -> jax.sharding.Sharding:
        """A block's rows as the scatter program takes them: in pinned host memory, or on the devices."""
        return self.row_sharding.with_memory_kind("pinned_host") if self.copied_in_program else self.row_sharding

    def per_shard(self, fn, n_in_leaves: int, leaves_out: bool):
        """fn over each device's shard of the group's leaves (jax.shard_map over the rows' mesh:
        the leaves and the rows split alike, along their first axis), or fn itself on one device.
        fn(leaves, blocks[, rows]) -> rows (gather) or leaves (scatter)."""
        if self.spec is None:
            return fn
        leaf_specs = [self.spec] * n_in_leaves
        in_specs = (leaf_specs, PartitionSpec(), self.spec) if leaves_out else (leaf_specs, PartitionSpec())
        return jax.shard_map(fn, mesh=self.row_sharding.mesh, in_specs=in_specs,
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


def _groups(leaves: list) -> list[_Group]:
    """The leaves grouped by placement (one device; heads split over a mesh axis; replicated), each
    with its parts; empty leaves (shared-value pages' V: nothing to move) in none."""
    keyed: dict = {}
    for i, x in enumerate(leaves):
        if x.size == 0:
            continue
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
            rows = NamedSharding(mesh, spec)
        else:
            spec, n_parts, rows = None, 1, SingleDeviceSharding(key[1])
        row = sum(_leaf_row_bytes((leaves[i].shape[0] // n_parts, *leaves[i].shape[1:]), leaves[i].dtype) for i in idx)
        holders: dict[int, list] = {}
        for dev, index in rows.devices_indices_map((n_parts, row)).items():
            holders.setdefault(index[0].start or 0, []).append(dev)
        parts = [_Part(devs, p) for p, devs in sorted(holders.items())]
        groups.append(_Group(idx, spec, rows, row, parts))
    return groups


class HostKVStore:
    """The host tier's rows and the two transfer programs (module docstring). copy_in_program=False
    copies every restored row to the devices before the scatter program (jax.device_put), which
    warm-up also falls back to if a platform cannot compile the program's own host-to-device copies."""

    def __init__(self, kv_pages, num_slots: int, copy_in_program: bool = True):
        leaves = jax.tree.leaves(kv_pages)
        self.num_slots = num_slots
        self.num_blocks = leaves[0].shape[1]
        self.treedef = jax.tree.structure(kv_pages)
        self.block_bytes = sum(x.nbytes // x.shape[1] for x in leaves)
        self.groups = groups = _groups(leaves)
        for g in groups:
            g.copied_in_program = copy_in_program and g.whole_rows
        # slot -> its block's rows in pinned host memory, per group: the [parts, row bytes] array the
        # gather wrote (whole_rows), else per part one [1, row bytes] array on the part's first device
        # (None: nothing held)
        self.rows: list[list | None] = [None] * num_slots
        gathers = [g.per_shard(_pack, len(g.leaves), leaves_out=False) for g in groups]
        scatters = [g.per_shard(_unpack_scatter, len(g.leaves), leaves_out=True) for g in groups]

        def gather(pages, blocks):
            """Per group, per block: its rows [parts, row bytes], each an output of its own."""
            xs = jax.tree.leaves(pages)
            flats = [f([xs[i] for i in g.leaves], blocks) for f, g in zip(gathers, groups)]
            return [[flat[:, j] for j in range(blocks.shape[0])] for flat in flats]

        def scatter(pages, blocks, rows):
            """rows: per group, per block, its rows [parts, row bytes]: in pinned host memory, copied to
            the devices here (jax.memory.Space.Device: the program's own host-to-device copies, as
            jax's parameter offloading does), or already on the devices (a replicated group's)."""
            xs = jax.tree.leaves(pages)
            for f, g, per_block in zip(scatters, groups, rows):
                flat = jnp.stack([jax.device_put(r, jax.memory.Space.Device) for r in per_block], axis=1)
                for i, x in zip(g.leaves, f([xs[i] for i in g.leaves], blocks, flat)):
                    xs[i] = x
            return jax.tree.unflatten(self.treedef, xs)

        # the gather's outputs are written by XLA straight into pinned host memory (the devices' DMA
        # engines copy into page-locked buffers on a GPU), one array per block, which the tier keeps
        self._gathers = {m: jax.jit(gather, out_shardings=[[g.row_sharding.with_memory_kind("pinned_host")] * m
                                                           for g in groups]) for m in TRANSFER_BUCKETS}
        self._scatter = jax.jit(scatter, donate_argnums=0)
        self._place_padding()
        self._pending: list = []       # the last step's offloads: (host slots, their rows)
        self.bytes_offloaded = self.bytes_restored = 0
        # host time: restores (the copies to the devices, dispatching the scatter); offloads (checking
        # the previous step's copies, dispatching this step's gather)
        self.restore_time_s = 0.0
        self.offload_time_s = 0.0

    # ---------------------------------------------------------------- programs
    def _place_padding(self) -> None:
        """A padding block's rows (restores are padded to a bucket; the scatter drops them), placed as
        the restored rows are (so the programs warm-up compiles are the ones serving runs)."""
        self._padding = [jax.device_put(np.zeros(g.row_shape, np.uint8), g.staged_sharding) for g in self.groups]

    def warmup(self, kv_pages):
        """Compile both programs at every bucket (serving then compiles nothing); returns the pages.
        A scatter program whose own host-to-device copies do not compile here is replaced by copies
        before it (copy_in_program=False), with a warning."""
        for m in TRANSFER_BUCKETS:
            jax.block_until_ready(self._gathers[m](kv_pages, np.zeros(m, np.int32)))
            idx = np.full(m, self.num_blocks, np.int32)                        # all padding: nothing written
            try:
                kv_pages = self._scatter(kv_pages, idx, [[pad] * m for pad in self._padding])
                continue
            except Exception as e:   # noqa: BLE001 -- it failed to compile (nothing ran, nothing donated)
                if not any(g.copied_in_program for g in self.groups):
                    raise
                log.warning("the host tier's restore program cannot copy from pinned host memory itself on "
                            "%s (%s: %s); its rows are copied to the devices before it", jax.default_backend(),
                            type(e).__name__, (str(e).splitlines() or [""])[0][:200])
            for g in self.groups:
                g.copied_in_program = False
            self._place_padding()
            return self.warmup(kv_pages)
        return kv_pages

    def _stage(self, rows: list) -> list:
        """The restored blocks' rows (per block, self.rows' entry) as the scatter takes them: per group,
        per block, [parts, row bytes], the held array itself where the program copies it; else copied
        to the devices first (one batched copy for every such row), a replicated part's row to its
        first device and from there to its others."""
        srcs, dsts = [], []
        for r in rows:
            for g, held in zip(self.groups, r):
                if g.copied_in_program:
                    continue
                if g.whole_rows:
                    srcs.append(held)
                    dsts.append(g.row_sharding)
                else:
                    srcs += held
                    dsts += [SingleDeviceSharding(part.devices[0]) for part in g.parts]
        moved = iter(jax.device_put(srcs, dsts) if srcs else [])
        out: list[list] = [[] for _ in self.groups]
        for r in rows:
            for gi, (g, held) in enumerate(zip(self.groups, r)):
                if g.copied_in_program:
                    out[gi].append(held)
                elif g.whole_rows:
                    out[gi].append(next(moved))
                else:
                    shards = []
                    for part in g.parts:
                        first = next(moved)
                        shards.append(first)
                        if len(part.devices) > 1:     # device to device
                            shards += jax.device_put([first] * (len(part.devices) - 1),
                                                     [SingleDeviceSharding(d) for d in part.devices[1:]])
                    out[gi].append(jax.make_array_from_single_device_arrays(g.row_shape, g.row_sharding, shards))
        return out

    # ---------------------------------------------------------------- a step's copies
    def run(self, kv_pages, transfers: KVTransfers) -> tuple:
        """Run a step's copies: the previous step's offloads are checked (their gather was dispatched
        then; waiting for it here, not there, keeps async scheduling's overlap), the restores' rows are
        looked up (before this step's offloads take their slots), this step's offloads are gathered
        (dispatched before the restores' scatter, which donates the pages, so they read the blocks
        first), then the restores are copied to the devices and scattered. Returns the new pages and
        a TransferResult; a failed copy loses what it moved, never the pages."""
        result = TransferResult()
        t0 = time.perf_counter()
        self._flush(result)
        restores = [(chunk, [self.rows[slot] for slot, _ in chunk]) for chunk in _chunks(transfers.restore)]
        pending = []
        for chunk in _chunks(transfers.offload):
            blocks, slots = zip(*chunk)
            try:
                per_block = self._gather_blocks(kv_pages, list(blocks))
            except Exception:   # noqa: BLE001 -- any failure: the entries go, the request recomputes
                result.failed_slots += slots
                for slot in slots:
                    self.rows[slot] = None
                continue
            for slot, r in zip(slots, per_block):
                self.rows[slot] = r
            pending.append((list(slots), per_block))
            self.bytes_offloaded += len(chunk) * self.block_bytes
        t1 = time.perf_counter()
        for chunk, rows in restores:
            slots, blocks = zip(*chunk)
            m = _bucket(len(chunk))
            try:
                if any(r is None for r in rows):
                    raise RuntimeError("the offload that filled these host slots failed")
                values = self._stage(rows)
            except Exception:   # noqa: BLE001
                result.failed_blocks += blocks
                result.failed_slots += slots
                continue
            idx = np.full(m, self.num_blocks, np.int32)
            idx[: len(chunk)] = blocks
            kv_pages = self._scatter(kv_pages, idx, [v + [pad] * (m - len(chunk))
                                                     for v, pad in zip(values, self._padding)])
            self.bytes_restored += len(chunk) * self.block_bytes
        self._pending = pending
        self.offload_time_s += t1 - t0
        self.restore_time_s += time.perf_counter() - t1
        return kv_pages, result

    def _gather_blocks(self, kv_pages, blocks: list[int]) -> list:
        """Dispatch the gather of these blocks (padded to a bucket) into pinned host memory; per block,
        per group, what self.rows holds (a replicated part's other copies are let go)."""
        idx = np.zeros(_bucket(len(blocks)), np.int32)
        idx[: len(blocks)] = blocks
        out = self._gathers[len(idx)](kv_pages, idx)
        return [[x[j] if g.whole_rows else [_shard_on(x[j], part.devices[0]) for part in g.parts]
                 for g, x in zip(self.groups, out)] for j in range(len(blocks))]

    def _flush(self, result: TransferResult) -> None:
        """Wait for the last step's gathers; the slots of one that failed are reported in result
        (their entries are dropped) and hold nothing (a restore from them fails)."""
        for slots, per_block in self._pending:
            try:
                jax.block_until_ready(per_block)
            except Exception:   # noqa: BLE001
                result.failed_slots += slots
                self.bytes_offloaded -= len(slots) * self.block_bytes
                for slot, r in zip(slots, per_block):
                    if self.rows[slot] is r:
                        self.rows[slot] = None
        self._pending = []


def _shard_on(x: jax.Array, device) -> jax.Array:
    """x's shard on `device`, as an array of its own (the same buffer: nothing copied)."""
    return next(s.data for s in x.addressable_shards if s.device == device)


def _chunks(pairs: list, size: int = TRANSFER_BUCKETS[-1]):
    for i in range(0, len(pairs), size):
        yield pairs[i: i + size]
