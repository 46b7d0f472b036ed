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


def init_kv_pages(n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                  dtype) -> list[LayerKV]:
    shape = (n_kv_heads, num_blocks, block_size, head_dim)
    return [LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(n_layers)]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype) -> int:
    """K and V of one token in all layers: 2 * bytes * n_layers * n_kv_heads * head_dim."""
    return 2 * jnp.dtype(dtype).itemsize * n_layers * n_kv_heads * head_dim


def write_kv(layer: LayerKV, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter this step's k, v [T, n_kv_heads, head_dim] into their slots (in place when donated)."""
    hkv, nb, bs, hd = layer.k.shape
    k_flat = layer.k.reshape(hkv, nb * bs, hd)
    v_flat = layer.v.reshape(hkv, nb * bs, hd)
    k_flat = k_flat.at[:, slot_mapping].set(k.transpose(1, 0, 2).astype(k_flat.dtype), mode="drop")
    v_flat = v_flat.at[:, slot_mapping].set(v.transpose(1, 0, 2).astype(v_flat.dtype), mode="drop")
    return LayerKV(k_flat.reshape(hkv, nb, bs, hd), v_flat.reshape(hkv, nb, bs, hd))
