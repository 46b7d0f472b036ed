"""The one attention entry point of the model.

`attention(...)` takes this step's q, k, v for T flattened tokens and either
  - no cache: causal attention among the T tokens of one sequence (Generator.logits, training), or
  - a layer's KV pages + AttentionMetadata: write k, v into their slots, then every token attends to
    its own sequence's context (earlier chunks included) through the block table.
It dispatches to an implementation: "xla" (plain jnp, below; works on every backend) or the
Pallas kernels (pallas_kernels/), chosen per device by the caller. Masks are built from token
positions, so chunked prefill and decode are the same code: token t at position p sees context
positions l with l <= p and, with a sliding window W, p - W < l. ALiBi adds slope_h * (l - p).
Softmax is always float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kv_cache import AttentionMetadata, LayerKV, write_kv
from pallas_kernels.flash_attention import flash_attention, ragged_paged_attention

NEG_INF = -1e30  # finite, so fully-masked padding rows give zeros instead of NaN


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
              window: int | None = None, alibi: jax.Array | None = None,
              kv: LayerKV | None = None, meta: AttentionMetadata | None = None,
              impl: str = "xla") -> tuple[jax.Array, LayerKV | None]:
    """q [T, H, D], k/v [T, Hkv, D], positions [T] -> (out [T, H, D], updated pages or None)."""
    if impl not in ("xla", "pallas"):
        raise ValueError(f"unknown attention implementation {impl!r}; use 'xla' or 'pallas'")
    if kv is None:
        if impl == "pallas":
            return flash_attention(q, k, v, scale=scale, causal=True, window=window, alibi_slopes=alibi), None
        return dense_causal_attention(q, k, v, positions, scale=scale, window=window, alibi=alibi), None
    assert meta is not None, "paged attention needs AttentionMetadata"
    kv = write_kv(kv, k, v, meta.slot_mapping)
    if impl == "pallas":
        out = ragged_paged_attention(q, kv.k, kv.v, positions, meta.seq_ids, meta.query_start_loc,
                                     meta.block_tables, meta.context_lens, scale=scale, window=window,
                                     alibi_slopes=alibi, k_scale=kv.k_scale, v_scale=kv.v_scale)
        return out.astype(q.dtype), kv
    return paged_attention_xla(q, kv, positions, meta, scale=scale, window=window, alibi=alibi), kv


def resolve_impl(requested: str) -> str:
    """'auto' -> the Pallas kernels on GPU, XLA elsewhere (on CPU they only run interpreted)."""
    if requested == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return requested


def _mask_and_bias(q_pos: jax.Array, k_pos: jax.Array, window: int | None, alibi: jax.Array | None,
                   extra_valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """q_pos [T], k_pos [T, L] or [L] -> valid [T, L] and ALiBi bias [H, T, L] (or None)."""
    k_pos = jnp.broadcast_to(k_pos, (q_pos.shape[0],) + k_pos.shape[-1:])
    rel = k_pos - q_pos[:, None]                                   # (T, L), <= 0 where visible
    valid = rel <= 0
    if window is not None:
        valid &= rel > -window
    if extra_valid is not None:
        valid &= extra_valid
    bias = None if alibi is None else alibi[:, None, None] * rel[None].astype(jnp.float32)
    return valid, bias


def _softmax_attend(scores: jax.Array, valid: jax.Array, bias: jax.Array | None, v: jax.Array,
                    v_spec: str) -> jax.Array:
    """scores [Hkv, G, T, L] f32 -> weighted sum of v; v_spec is the einsum spec of v's axes."""
    hkv, g = scores.shape[:2]
    if bias is not None:
        scores = scores + bias.reshape(hkv, g, *bias.shape[1:])
    scores = jnp.where(valid[None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(valid[None, None], probs, 0.0)  # rows with no visible key -> 0
    return jnp.einsum(f"kgtl,{v_spec}->tkgd", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                           scale: float, window: int | None = None,
                           alibi: jax.Array | None = None) -> jax.Array:
    """Reference attention of one sequence's T tokens among themselves. [T,H,D],[T,Hkv,D] -> [T,H,D]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, h // hkv, d)                                # (T, Hkv, G, D)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    valid, bias = _mask_and_bias(positions, positions, window, alibi)
    out = _softmax_attend(scores, valid, bias, v, "lkd")
    return out.reshape(t, h, d).astype(q.dtype)


def paged_attention_xla(q: jax.Array, kv: LayerKV, positions: jax.Array, meta: AttentionMetadata, *,
                        scale: float, window: int | None = None,
                        alibi: jax.Array | None = None) -> jax.Array:
    """Ragged paged attention by gathering each token's sequence context. q [T,H,D] -> [T,H,D].

    Memory is O(T * max_context): fine for decode and for the bucketed prefill chunks the
    engine schedules; the Pallas kernels are the fast path on GPU.
    """
    t, h, d = q.shape
    hkv, _, bs, _ = kv.k.shape
    s, max_blocks = meta.block_tables.shape
    # Gather each sequence's pages in logical order: (Hkv, S, max_blocks, bs, D) -> (Hkv, S, L, D)
    k_seq = kv.k[:, meta.block_tables].reshape(hkv, s, max_blocks * bs, d)
    v_seq = kv.v[:, meta.block_tables].reshape(hkv, s, max_blocks * bs, d)
    if kv.k_scale is not None:   # int8 pages: dequantize what was gathered
        k_seq = k_seq * kv.k_scale[:, meta.block_tables].reshape(hkv, s, -1)[..., None]
        v_seq = v_seq * kv.v_scale[:, meta.block_tables].reshape(hkv, s, -1)[..., None]
        k_seq, v_seq = k_seq.astype(q.dtype), v_seq.astype(q.dtype)
    k_tok = k_seq[:, meta.seq_ids]                                      # (Hkv, T, L, D)
    v_tok = v_seq[:, meta.seq_ids]
    qg = q.reshape(t, hkv, h // hkv, d)
    scores = jnp.einsum("tkgd,ktld->kgtl", qg, k_tok, preferred_element_type=jnp.float32) * scale
    k_pos = jnp.arange(max_blocks * bs, dtype=jnp.int32)
    in_context = k_pos[None, :] < meta.context_lens[meta.seq_ids][:, None]
    valid, bias = _mask_and_bias(positions, k_pos, window, alibi, extra_valid=in_context)
    out = _softmax_attend(scores, valid, bias, v_tok, "ktld")
    return out.reshape(t, h, d).astype(q.dtype)
