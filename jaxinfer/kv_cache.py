"""The device side of the paged KV cache: the pages pytree and the attention metadata.

Layout (chosen for the paged-attention kernels and for sharding kv heads over `tensor`):
    k, v: [n_kv_heads, num_blocks, block_size, head_dim]  one pair per layer
    flat slot of (block b, offset o) = b * block_size + o
Shared-value pages (latent attention, whose key vector is also its value): v and v_scale are empty
(last axis 0 wide); attention() reads the values from the K pages (value_view).
Block 0 is never handed out by the host's BlockManager: it is the "null" block that padding
rows of a block table point at, so a padded gather always reads valid memory.

AttentionMetadata describes one ragged step: T tokens (prefill chunks and decode tokens of
S sequences, flattened, each sequence's tokens contiguous). The host builds it in numpy with
`build_attention_metadata`, padded to a bucket of `attention_buckets`; padding tokens write to
PAD_SLOT, which is out of range and dropped by the scatter.

The XLA attention reads the pages as a flat list of work items, one per (query tile, KEYS_PER_ITEM
keys of the blocks the tile can see), built here on the host (jaxinfer/attention.py uses them):
  decode_tokens [S]          the one token of each single-token row (T: the row is not one)
  decode_items  [ND, 2 + KB] (row, first logical block j, the physical blocks j .. j + KB - 1)
                             covering every block of those rows, KB = blocks_per_item(block_size)
                             (past the end of the table: 0, the null block)
  chunk_tiles   [NT, TQ]     the tokens of each QUERY_TILE-token tile of a multi-token row (T: none)
  chunk_items   [NC, 2 + KB] (tile, j, blocks) covering every block a tile can see
  num_items     [2]          how many of decode_items / chunk_items are real (the rest: padding)
Their sizes are fixed by (T, S, the block-table width), so they add no bucket dimension: the
device loops over the real items only. This module never imports anything above jax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import perf
from jaxinfer.quant import symmetric_codes

PAD_SLOT = 2**30  # out of range for any cache: scatters to it are dropped
TREE_NONE = 2**30  # AttentionMetadata.tree's first node slot of a token outside any tree


@jax.tree_util.register_dataclass
@dataclass
class LayerKV:
    """One layer's pages. k_scale/v_scale [n_kv_heads, num_blocks, block_size] only for scaled
    (int8 or fp8) KV."""
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


@jax.tree_util.register_dataclass
@dataclass
class ConvState:
    """One short-convolution layer's state (LFM2; models/decoder.py ShortConv): u [num_slots, L - 1, D],
    per state slot the conv inputs of its sequence's last L - 1 positions, position p at row p % (L - 1).
    A sequence holds one slot while it has blocks (host/block_manager.py; slot 0 is never handed out)."""
    u: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class DeltaState:
    """One Gated DeltaNet layer's state (Qwen3-Next, Qwen3.5; models/deltanet.py GatedDeltaNet), or a Mamba-2
    layer's (Granite 4.0-H; models/mamba2.py: Hv heads, dk its state size, dv its head's features), per state
    slot: u [num_slots, L - 1, C], the convolution's inputs of its sequence's last L - 1 positions
    (position p at row p % (L - 1)), and h [num_slots, Hv, dk, dv] float32, each value head's
    recurrent state after the sequence's last cached token."""
    u: jax.Array
    h: jax.Array


def with_states(pages: list, cfg, num_slots: int, dtype) -> list:
    """The attention layers' pages (in layer order) with a zeroed state at each state layer of the
    ModelConfig cfg: a ConvState at each conv layer, a DeltaState at each Gated DeltaNet or Mamba-2 layer
    (its convolution's inputs in dtype, its recurrent state float32)."""
    it, taps = iter(pages), cfg.conv_kernel
    out = []
    for i in range(cfg.n_layers):
        if cfg.is_conv_layer(i):
            out.append(ConvState(jnp.zeros((num_slots, taps - 1, cfg.d_model), dtype)))
        elif not cfg.has_mixer(i):   # an MLP block: nothing
            out.append(None)
        elif cfg.has_state_matrix(i):
            out.append(DeltaState(jnp.zeros((num_slots, taps - 1, cfg.linear_conv_dim), dtype),
                                  jnp.zeros((num_slots, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim),
                                            jnp.float32)))
        else:
            out.append(next(it))
    return out


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    seq_ids: jax.Array        # [T] int32: the row of block_tables each token belongs to
    slot_mapping: jax.Array   # [T] int32: flat slot this token's K/V is written to (PAD_SLOT: padding)
    block_tables: jax.Array   # [S, max_blocks] int32: logical block -> physical block (0 = null)
    context_lens: jax.Array   # [S] int32: tokens of each sequence in the cache after this step
    query_start_loc: jax.Array  # [S+1] int32: offset of each sequence's first token in this step
    # the XLA attention's work items (module docstring); None in hand-built metadata (Pallas only)
    decode_tokens: jax.Array | None = None   # [S] int32
    decode_items: jax.Array | None = None    # [ND, 2 + KB] int32
    chunk_tiles: jax.Array | None = None     # [NT, QUERY_TILE] int32
    chunk_items: jax.Array | None = None     # [NC, 2 + KB] int32
    num_items: jax.Array | None = None       # [2] int32
    # Medusa tree verification (jaxinfer/spec_decode/medusa.py), else None: per token (its slot index in its
    # sequence, which the causal mask compares keys with; the first tree-node slot of its row, or
    # TREE_NONE; the bitmask of the nodes it sees, bit j: slot first + j)
    tree: jax.Array | None = None            # [T, 3] int32
    # models with conv layers (ConvState), else None: each row's state slot (padding rows: 0)
    state_slots: jax.Array | None = None     # [S] int32


# Scaled KV formats: their storage dtypes. A token's K (or V) in one KV head is stored as x / scale
# with scale = max|x| / qmax (quant.symmetric_codes), and read back as stored * scale. int8 rounds
# to nearest in [-127, 127]; fp8 is OCP e4m3 ("fn": finite, max 448, 3 mantissa bits, as vLLM's
# kv_cache_dtype="fp8"), rounded to nearest even by the cast.
SCALED_KV = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


def kv_storage_dtype(name: str):
    """A kv_dtype name (EngineConfig.kv_dtype: int8 | fp8 | float16 | bfloat16 | float32) -> the pages' dtype."""
    return SCALED_KV[name] if name in SCALED_KV else jnp.dtype(name)


def kv_dtype_name(dtype) -> str:
    """The inverse of kv_storage_dtype."""
    d = jnp.dtype(dtype)
    return next((n for n, sd in SCALED_KV.items() if sd == d), d.name)


def is_scaled_kv(dtype) -> bool:
    return kv_dtype_name(dtype) in SCALED_KV


def init_kv_pages(n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                  dtype, value_dim: int | None = None) -> list[LayerKV]:
    """int8 and fp8 pages carry float32 scales per (kv head, token): value = stored * scale.
    value_dim 0 (ModelConfig.kv_value_dim of latent attention): shared-value pages, whose V (and V
    scales) are empty, their last axis 0 wide; attention() reads the values from the K pages."""
    shape = (n_kv_heads, num_blocks, block_size, head_dim)
    v_shape = shape[:3] + (head_dim if value_dim is None else value_dim,)
    v_scales = shape[:3] if v_shape[-1] else shape[:2] + (0,)
    if is_scaled_kv(dtype):
        d = jnp.dtype(dtype)
        return [LayerKV(jnp.zeros(shape, d), jnp.zeros(v_shape, d),
                        jnp.ones(shape[:3], jnp.float32), jnp.ones(v_scales, jnp.float32)) for _ in range(n_layers)]
    return [LayerKV(jnp.zeros(shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(n_layers)]


def shared_values(layer: LayerKV) -> bool:
    """Whether the layer's values are read from its K pages (init_kv_pages' value_dim 0)."""
    return layer.v.shape[-1] == 0


def value_view(layer: LayerKV) -> LayerKV:
    """The pages as the attention reads them: shared-value pages with their K pages (and K scales) in
    V's place, others as they are."""
    return LayerKV(layer.k, layer.k, layer.k_scale, layer.k_scale) if shared_values(layer) else layer


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype, value_dim: int | None = None) -> int:
    """K and V of one token in all layers: 2 * bytes * n_layers * n_kv_heads * head_dim
    (+ the two float32 scales per kv head of int8 and fp8 pages); value_dim 0: K alone."""
    return perf.kv_bytes_per_token(n_layers, n_kv_heads, head_dim, kv_dtype_name(dtype), value_dim)


def quantize_kv(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> values in `dtype` (int8 or fp8) and float32 scales [...] (symmetric, per
    token per head): scale = max|x| / qmax; int8 rounds x / scale to nearest, fp8 casts it."""
    return symmetric_codes(x, dtype, axis=-1)


def write_kv(layer: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k, v [T, n_kv_heads, head_dim] into their slots (in place when donated);
    shared-value pages take k only (v is k there)."""
    hkv, nb, bs, hd = layer.k.shape
    shared = shared_values(layer)
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)                     # (Hkv, T, hd)

    def put(pages, new):
        flat = pages.reshape(hkv, nb * bs, *pages.shape[3:])
        return flat.at[:, slot_mapping].set(new.astype(flat.dtype), mode="drop").reshape(pages.shape)
    if layer.k_scale is None:
        return LayerKV(put(layer.k, k), layer.v if shared else put(layer.v, v))
    kq, ks = quantize_kv(k, layer.k.dtype)
    if shared:
        return LayerKV(put(layer.k, kq), layer.v, put(layer.k_scale, ks), layer.v_scale)
    vq, vs = quantize_kv(v, layer.v.dtype)
    return LayerKV(put(layer.k, kq), put(layer.v, vq), put(layer.k_scale, ks), put(layer.v_scale, vs))


# ---------------------------------------------------------------------------- host: metadata

QUERY_TILE = 16   # query tokens per work item of a multi-token chunk
KEYS_PER_ITEM = 64   # keys per work item: blocks_per_item(block_size) = KEYS_PER_ITEM // block_size blocks
# work items the XLA attention processes per loop iteration (bench/attention_xla.py: a decode item
# is G queries x 64 keys, a chunk item QUERY_TILE x G queries x 64 keys, so chunk groups are smaller)
DECODE_GROUP = 16
CHUNK_GROUP = 8


@dataclass(frozen=True)
class StepRow:
    """One sequence in a step: `start` tokens cached before it (num_computed_tokens), `num_tokens`
    computed now, its block table (covering start + num_tokens + lookahead)."""
    start: int
    num_tokens: int
    block_table: Sequence[int]
    # multi-step decoding (step.py): positions later iterations of the same call add; their keys are
    # read through this call's items, so the items (and the table) cover them too
    lookahead: int = 0
    state_slot: int = 0   # its conv layers' state slot (models with conv layers)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def blocks_per_item(block_size: int, keys_per_item: int = KEYS_PER_ITEM) -> int:
    return max(1, keys_per_item // block_size)


def work_item_capacity(num_tokens: int, num_seqs: int, max_blocks: int, block_size: int,
                       keys_per_item: int = KEYS_PER_ITEM) -> tuple[int, int, int]:
    """Static (ND, NT, NC) of a (T, S, B) bucket: the most decode items, chunk tiles and chunk
    items any step of that bucket can have (S rows of <= B blocks; T tokens in >= 2-token rows
    make at most T // QUERY_TILE + min(S, T // 2) tiles)."""
    tiles = num_tokens // QUERY_TILE + min(num_seqs, num_tokens // 2)
    per_row = -(-max_blocks // blocks_per_item(block_size, keys_per_item))
    return (_round_up(max(num_seqs * per_row, 1), DECODE_GROUP), max(tiles, 1),
            _round_up(max(tiles * per_row, 1), CHUNK_GROUP))


def attention_buckets(token_buckets: Sequence[int], block_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (T, B) shape a runner compiles at warm-up: block_buckets is [max_blocks] for the XLA
    attention (its work grows with the items, not with B) and powers of 4 for the Pallas kernel."""
    return [(t, b) for t in token_buckets for b in block_buckets]


def build_attention_metadata(rows: Sequence[StepRow], block_size: int, num_tokens_bucket: int,
                             num_seqs_bucket: int, num_blocks_bucket: int,
                             keys_per_item: int = KEYS_PER_ITEM, with_state: bool = False) -> AttentionMetadata:
    """Numpy metadata of one step, padded to (T, S, B) = the buckets: tokens of row i at
    [query_start_loc[i], query_start_loc[i+1]), padding tokens to PAD_SLOT, padding rows empty.
    B must cover every row's blocks up to start + num_tokens. `rows=[]` gives warm-up's dummy.
    keys_per_item: the width of a work item (bench/attention_xla.py compares widths). with_state: the
    rows' state slots too (a model with conv layers)."""
    t, s, b, bs = num_tokens_bucket, num_seqs_bucket, num_blocks_bucket, block_size
    assert len(rows) <= s and sum(r.num_tokens for r in rows) <= t, (len(rows), s, t)
    seq_ids = np.zeros(t, np.int32)
    slots = np.full(t, PAD_SLOT, np.int32)
    block_tables = np.zeros((s, b), np.int32)
    context_lens = np.zeros(s, np.int32)
    query_start = np.zeros(s + 1, np.int32)
    decode_tokens = np.full(s, t, np.int32)
    decode_items, chunk_tiles, chunk_items = [], [], []   # numpy pieces, joined below
    kb = blocks_per_item(bs, keys_per_item)
    cursor = 0
    for i, row in enumerate(rows):
        n, end = row.num_tokens, row.start + row.num_tokens
        used = -(-(end + row.lookahead) // bs)
        assert used <= min(b, len(row.block_table)), (used, b, len(row.block_table))
        table = np.asarray(row.block_table[:used], np.int32)
        pos = np.arange(row.start, end)
        seq_ids[cursor: cursor + n] = i
        slots[cursor: cursor + n] = table[pos // bs] * bs + pos % bs
        block_tables[i, :used] = table
        context_lens[i] = end
        items = np.zeros((-(-used // kb), 2 + kb), np.int32)   # (tile, j, blocks j .. j + kb - 1)
        items[:, 1] = np.arange(0, used, kb)
        blocks = np.zeros(len(items) * kb, np.int32)
        blocks[:used] = table
        items[:, 2:] = blocks.reshape(-1, kb)
        if n == 1:
            decode_tokens[i] = cursor
            items[:, 0] = i
            decode_items.append(items)
        elif n > 1:
            for first in range(0, n, QUERY_TILE):   # a tile sees the blocks up to its last token
                last = min(first + QUERY_TILE, n) - 1
                tile = np.full(QUERY_TILE, t, np.int32)
                tile[: last - first + 1] = np.arange(cursor + first, cursor + last + 1)
                # multi-round speculation moves the chunk forward by up to `lookahead` positions
                seen = items[: (row.start + last + row.lookahead) // bs // kb + 1].copy()
                seen[:, 0] = len(chunk_tiles)
                chunk_tiles.append(tile)
                chunk_items.append(seen)
        cursor += n
        query_start[i + 1] = cursor
    query_start[len(rows) + 1:] = cursor
    nd, nt, nc = work_item_capacity(t, s, b, bs, keys_per_item)
    num_items = np.asarray([sum(map(len, decode_items)), sum(map(len, chunk_items))], np.int32)
    assert len(chunk_tiles) <= nt and num_items[0] <= nd and num_items[1] <= nc, (num_items, nd, nc)
    tiles = np.full((nt, QUERY_TILE), t, np.int32)
    if chunk_tiles:
        tiles[: len(chunk_tiles)] = chunk_tiles
    return AttentionMetadata(seq_ids, slots, block_tables, context_lens, query_start,
                             decode_tokens=decode_tokens, decode_items=_padded(decode_items, nd, s, kb),
                             chunk_tiles=tiles, chunk_items=_padded(chunk_items, nc, nt, kb),
                             num_items=num_items,
                             state_slots=np.asarray([r.state_slot for r in rows] + [0] * (s - len(rows)), np.int32)
                             if with_state else None)


def _padded(pieces: list[np.ndarray], size: int, dummy_tile: int, kb: int) -> np.ndarray:
    """[size, 2 + kb] int32; padding items name the dummy tile (one past the last) and the null block."""
    out = np.zeros((size, 2 + kb), np.int32)
    out[:, 0] = dummy_tile
    if pieces:
        items = np.concatenate(pieces)
        out[: len(items)] = items
    return out


def move_kv(pages: list[LayerKV], src: jax.Array, dst: jax.Array) -> list[LayerKV]:
    """Copy every layer's K/V (and int8/fp8 scales) from flat slots src [M] to dst [M] (dst PAD_SLOT:
    nothing): all sources are read before any destination is written, so the moves may overlap.
    Shared-value pages' empty V leaves stay as they are."""
    def move(x):
        if x.size == 0:
            return x
        hkv, nb, bs = x.shape[:3]
        flat = x.reshape(hkv, nb * bs, *x.shape[3:])
        vals = flat.at[:, src].get(mode="clip")
        return flat.at[:, dst].set(vals, mode="drop").reshape(x.shape)
    return [LayerKV(move(p.k), move(p.v), None if p.k_scale is None else move(p.k_scale),
                    None if p.v_scale is None else move(p.v_scale)) for p in pages]
