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

from jaxinfer.kv_cache import AttentionMetadata, LayerKV, quantize_kv, write_kv
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
    return paged_attention_xla(q, k, v, kv, positions, meta, scale=scale, window=window, alibi=alibi), kv


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


def _gather_context(kv: LayerKV, block_tables: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Each sequence's pages in logical order: (Hkv, S, max_blocks * bs, D), dequantized if int8."""
    hkv, _, bs, d = kv.k.shape
    s, max_blocks = block_tables.shape
    k_seq = kv.k[:, block_tables].reshape(hkv, s, max_blocks * bs, d)
    v_seq = kv.v[:, block_tables].reshape(hkv, s, max_blocks * bs, d)
    if kv.k_scale is not None:
        k_seq = (k_seq * kv.k_scale[:, block_tables].reshape(hkv, s, -1)[..., None]).astype(dtype)
        v_seq = (v_seq * kv.v_scale[:, block_tables].reshape(hkv, s, -1)[..., None]).astype(dtype)
    return k_seq, v_seq


def paged_attention_reference(q: jax.Array, kv: LayerKV, positions: jax.Array, meta: AttentionMetadata, *,
                              scale: float, window: int | None = None,
                              alibi: jax.Array | None = None) -> jax.Array:
    """The plain definition, after this step's K/V were written: every token gathers its own
    sequence's whole context from the pages. Memory O(T * max_context * D): a reference only."""
    t, h, d = q.shape
    hkv, _, bs, _ = kv.k.shape
    k_seq, v_seq = _gather_context(kv, meta.block_tables, q.dtype)
    k_tok, v_tok = k_seq[:, meta.seq_ids], v_seq[:, meta.seq_ids]             # (Hkv, T, L, D)
    qg = q.reshape(t, hkv, h // hkv, d)
    scores = jnp.einsum("tkgd,ktld->kgtl", qg, k_tok, preferred_element_type=jnp.float32) * scale
    k_pos = jnp.arange(k_seq.shape[2], dtype=jnp.int32)
    in_context = k_pos[None, :] < meta.context_lens[meta.seq_ids][:, None]
    valid, bias = _mask_and_bias(positions, k_pos, window, alibi, extra_valid=in_context)
    out = _softmax_attend(scores, valid, bias, v_tok, "ktld")
    return out.reshape(t, h, d).astype(q.dtype)


def _partial_attend(scores: jax.Array, valid: jax.Array, bias: jax.Array | None, v: jax.Array,
                    v_spec: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised softmax pieces over one set of keys: scores [Hkv, G, Q, L] f32 ->
    (row max [Hkv,G,Q], sum of exp [Hkv,G,Q], exp-weighted sum of v [Hkv,G,Q,D]); empty rows: (-inf, 0, 0)."""
    hkv, g = scores.shape[:2]
    if bias is not None:
        scores = scores + bias.reshape(hkv, g, *bias.shape[1:])
    scores = jnp.where(valid[None, None], scores, NEG_INF)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(valid[None, None], jnp.exp(scores - m[..., None]), 0.0)
    acc = jnp.einsum(f"kgql,{v_spec}->kgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1), acc


def _decode_rows(q: jax.Array, k_seq: jax.Array, v_seq: jax.Array, valid: jax.Array, bias: jax.Array | None,
                 scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One query per sequence against its gathered context: q [S, Hkv, G, D], k/v_seq [Hkv, S, L, D],
    valid [S, L], bias [H, S, L] -> _partial_attend's pieces ([Hkv, G, S], [Hkv, G, S], [Hkv, G, S, D]).
    Scores are laid out [Hkv, S, L, G] so that both dots read the gathered pages in their stored
    [L, D] order with (Hkv, S) as leading batch axes: on XLA:CPU that is 2.5x faster for Q.K and
    8x for P.V than the [Hkv, G, S, L] layout of _partial_attend (bench at S=64, L=256).
    float32 operands: XLA:CPU has no bf16 x bf16 -> f32 kernel for these batched dots."""
    s, hkv, g, _ = q.shape
    qk = q.transpose(1, 0, 2, 3).astype(jnp.float32)                     # (Hkv, S, G, D)
    sc = jnp.einsum("ksld,ksgd->kslg", k_seq.astype(jnp.float32), qk) * scale
    if bias is not None:
        sc = sc + bias.reshape(hkv, g, s, -1).transpose(0, 2, 3, 1)
    mask = valid[None, :, :, None]
    sc = jnp.where(mask, sc, NEG_INF)
    m = jnp.max(sc, axis=2)                                               # (Hkv, S, G)
    p = jnp.where(mask, jnp.exp(sc - m[:, :, None]), 0.0)
    acc = jnp.einsum("kslg,ksld->ksgd", p, v_seq.astype(jnp.float32))
    return m.transpose(0, 2, 1), jnp.sum(p, axis=2).transpose(0, 2, 1), acc.transpose(0, 2, 1, 3)


def _merge(parts: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Combine softmax pieces over disjoint key sets (flash-attention's merge) -> [Hkv, G, Q, D]."""
    m = parts[0][0]
    for pm, _, _ in parts[1:]:
        m = jnp.maximum(m, pm)
    num = sum(acc * jnp.exp(pm - m)[..., None] for pm, _, acc in parts)
    den = sum(pl * jnp.exp(pm - m) for pm, pl, _ in parts)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def paged_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV, positions: jax.Array,
                        meta: AttentionMetadata, *, scale: float, window: int | None = None,
                        alibi: jax.Array | None = None) -> jax.Array:
    """Ragged paged attention without a per-token context gather. q [T,H,D], this step's k/v
    [T,Hkv,D] (already written to kv) -> [T,H,D].

    A token's keys are split into disjoint sets whose softmax pieces are merged:
      1. this step's tokens of its own sequence (dense [T, T], causal by position): every prefill
         chunk and every decode token's own key;
      2. the context cached before this step, for sequences with one token this step (decode):
         one query per sequence against its gathered pages, [S, L]; skipped (lax.cond) in a step
         with no such row;
      3. the same for the few multi-token chunks that continue a cached context (a chunked
         prefill's later chunks, n > 1 samples after their fork): meta.prior_rows, each gathering
         its own row's pages, [T, L], and skipped when its slot is empty (-1). The scheduler caps
         them per step.
    A first prefill chunk has no cached context, so sets 2 and 3 are empty for it. The pages are
    read once per sequence (S x L), not once per token (T x L), and only up to the cached context:
    the block tables need to cover the tokens before this step (ModelRunner.prepare sizes them so).
    """
    t, h, d = q.shape
    hkv = kv.k.shape[0]
    g = h // hkv
    qsl = meta.query_start_loc
    qlen = qsl[1:] - qsl[:-1]                                            # [S]
    cached = meta.context_lens - qlen                                    # [S] before this step
    tok_valid = jnp.arange(t) < qsl[-1]
    qg = q.reshape(t, hkv, g, d)
    if kv.k_scale is not None:   # this step's keys as the int8 pages hold them
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        k, v = (kq * ks[..., None]).astype(q.dtype), (vq * vs[..., None]).astype(q.dtype)

    # 1. within this step
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    same = (meta.seq_ids[:, None] == meta.seq_ids[None, :]) & tok_valid[:, None] & tok_valid[None, :]
    valid, bias = _mask_and_bias(positions, positions, window, alibi, extra_valid=same)
    parts = [_partial_attend(scores, valid, bias, v.astype(q.dtype), "lkd")]

    # 2. decode rows: the row's one query against its cached context (skipped, lax.cond, in a step
    #    without any: the gather and the [S, L] dots are most of a prefill step's attention otherwise)
    k_pos = jnp.arange(meta.block_tables.shape[1] * kv.k.shape[2], dtype=jnp.int32)
    single = (qlen == 1)[meta.seq_ids] & tok_valid                     # [T]
    first = jnp.minimum(qsl[:-1], t - 1)

    def decode_rows(_):
        k_seq, v_seq = _gather_context(kv, meta.block_tables, jnp.float32)  # (Hkv, S, L, D); int8: dequantized
        valid_r, bias_r = _mask_and_bias(positions[first], k_pos, window, alibi,
                                         extra_valid=k_pos[None, :] < cached[:, None])
        m_r, l_r, acc_r = _decode_rows(qg[first], k_seq, v_seq, valid_r, bias_r, scale)
        return (jnp.where(single, m_r[:, :, meta.seq_ids], NEG_INF),
                jnp.where(single, l_r[:, :, meta.seq_ids], 0.0),
                jnp.where(single[:, None], acc_r[:, :, meta.seq_ids], 0.0))

    empty = (jnp.full((hkv, g, t), NEG_INF, jnp.float32), jnp.zeros((hkv, g, t), jnp.float32),
             jnp.zeros((hkv, g, t, d), jnp.float32))
    parts.append(jax.lax.cond(jnp.any((qlen == 1) & (cached > 0)), decode_rows, lambda _: empty, None))

    # 3. multi-token chunks that continue a cached context: each gathers its own row's pages
    if meta.prior_rows is not None:
        def continued(row):
            k_row, v_row = _gather_context(kv, meta.block_tables[row][None], q.dtype)
            extra = (meta.seq_ids == row)[:, None] & tok_valid[:, None] & (k_pos[None, :] < cached[row])
            sc = jnp.einsum("tkgd,kld->kgtl", qg, k_row[:, 0], preferred_element_type=jnp.float32) * scale
            vmask, vbias = _mask_and_bias(positions, k_pos, window, alibi, extra_valid=extra)
            return _partial_attend(sc, vmask, vbias, v_row[:, 0], "kld")

        for slot in range(meta.prior_rows.shape[0]):
            row = meta.prior_rows[slot]
            parts.append(jax.lax.cond(row >= 0, continued, lambda _: empty, jnp.maximum(row, 0)))

    out = _merge(parts)                                                  # (Hkv, G, T, D)
    return out.transpose(2, 0, 1, 3).reshape(t, h, d).astype(q.dtype)
