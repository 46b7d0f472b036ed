"""The device side of the paged KV cache: the pages pytree and the attention metadata.

Layout (chosen for the paged-attention kernels and for sharding kv heads over `tensor`):
    k, v: [n_kv_heads, num_blocks, block_size, head_dim]  one pair per layer
    flat slot of (block b, offset o) = b * block_size + o
Block 0 is never handed out by the host's BlockManager: it is the "null" block that padding
rows of a block table point at, so a padded gather always reads valid memory.

AttentionMetadata describes one ragged step: T tokens (prefill chunks and decode tokens of
S sequences, flattened, each sequence's tokens contiguous). The host builds it as numpy; the
runner pads it to bucketed shapes. Padding tokens write to PAD_SLOT, which is out of range
and dropped by the scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

PAD_SLOT = 2**30  # out of range for any cache: scatters to it are dropped


@jax.tree_util.register_dataclass
@dataclass
class LayerKV:
    """One layer's pages. k_scale/v_scale [n_kv_heads, num_blocks, block_size] only for int8 KV."""
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
class AttentionMetadata:
    seq_ids: jax.Array        # [T] int32: the row of block_tables each token belongs to
    slot_mapping: jax.Array   # [T] int32: flat slot this token's K/V is written to (PAD_SLOT: padding)
    block_tables: jax.Array   # [S, max_blocks] int32: logical block -> physical block (0 = null)
    context_lens: jax.Array   # [S] int32: tokens of each sequence in the cache after this step
    query_start_loc: jax.Array  # [S+1] int32: offset of each sequence's first token in this step
    # [P] int32: rows whose chunk has several tokens AND continues a cached context (-1: empty
    # slot). The XLA attention handles these P rows separately; None means there are none.
    prior_rows: jax.Array | None = None


def init_kv_pages(n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                  dtype) -> list[LayerKV]:
    """int8 pages carry float32 scales per (kv head, token): value = int8 * scale."""
    shape = (n_kv_heads, num_blocks, block_size, head_dim)
    if jnp.dtype(dtype) == jnp.int8:
        return [LayerKV(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8),
                        jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32)) for _ in range(n_layers)]
    return [LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(n_layers)]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype) -> int:
    """K and V of one token in all layers: 2 * bytes * n_layers * n_kv_heads * head_dim
    (+ the two float32 scales per kv head of int8 pages)."""
    scales = 2 * 4 * n_layers * n_kv_heads if jnp.dtype(dtype) == jnp.int8 else 0
    return 2 * jnp.dtype(dtype).itemsize * n_layers * n_kv_heads * head_dim + scales


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> int8 values and float32 scales [...] (symmetric, per token per head)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def write_kv(layer: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k, v [T, n_kv_heads, head_dim] into their slots (in place when donated)."""
    hkv, nb, bs, hd = layer.k.shape
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)                     # (Hkv, T, hd)

    def put(pages, new):
        flat = pages.reshape(hkv, nb * bs, *pages.shape[3:])
        return flat.at[:, slot_mapping].set(new.astype(flat.dtype), mode="drop").reshape(pages.shape)
    if layer.k_scale is None:
        return LayerKV(put(layer.k, k), put(layer.v, v))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return LayerKV(put(layer.k, kq), put(layer.v, vq), put(layer.k_scale, ks), put(layer.v_scale, vs))
