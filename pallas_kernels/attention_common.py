"""What the attention kernels share: masking conventions, tile math, validators, reference math.

Imports jax only. pallas_kernels/flash_attention.py (one contiguous sequence) and
pallas_kernels/ragged_paged_attention.py (a serving step's chunks over the paged KV cache) build
their kernels and their pure-jnp references from these pieces, so both follow one definition:

Masking: a query at position p sees key position l iff l <= p (causal), p - W < l (sliding window
W) and, for paged attention, l < context_len. With a soft cap C (Gemma 2) each scaled score s
becomes C * tanh(s / C); then ALiBi adds slope_h * (l - p) to the score. Attention sinks (gpt-oss;
sinks [H] f32) add e^(sink_h) to each softmax denominator, a key of value 0: the online softmax
starts each row from (max, sum) = (sink_h, 1) instead of (-inf, 0). Scores and softmax are float32
(float32 operands are multiplied in float32, never TF32); a row that sees nothing outputs 0.

Tree mask (Medusa's tree verification, paged attention only): each query token carries (slot,
first, bits). slot replaces its position in every rule above (causal, window, ALiBi): a tree node's
K/V sits at slot p_root + 1 + j while its RoPE position is p_root + depth(j). On top of them it sees
key slot l iff l < first (the context and the root: the causal rule still applies) or bit l - first
of bits is set (the node itself and its ancestors); a token outside every tree has first = 2^30, so
it sees what it would without the mask (`tree_visible`, the one definition jaxinfer's XLA attention
also uses).

GQA: H = Hkv * G and query head h reads kv head h // G. Both kernels put the G query heads of one
kv head into the rows of a tile: a query tile of block_q tokens becomes [block_q * Gp, D] rows
(Gp = G padded to a power of two), so GQA costs no repeat of K/V and the dot has block_q * Gp rows.
The Triton lowering needs power-of-two tile dimensions and dots of >= 16 rows / keys / head_dim
(check_triton_shapes); Pallas interpret mode, the default on CPU, has neither limit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30          # finite mask value: fully masked rows never produce NaN
MIN_DOT_ROWS = 16        # Triton's tl.dot needs M, N, K >= 16


def default_interpret() -> bool:
    """Pallas interpret mode is the only way to run these Triton-style kernels on CPU."""
    return jax.default_backend() == "cpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else bool(interpret)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_triton_shapes(**dims: int) -> None:
    """Triton needs every in-kernel array dimension to be a power of two."""
    bad = {k: v for k, v in dims.items() if not is_pow2(int(v))}
    if bad:
        raise ValueError(f"the Triton lowering needs power-of-two sizes, got {bad}; "
                         "pick other block sizes (or pad head_dim)")
    if dims.get("head_dim", MIN_DOT_ROWS) < MIN_DOT_ROWS:
        raise ValueError(f"the Triton dot needs head_dim >= {MIN_DOT_ROWS}, got {dims}")


def group_queries(q: jax.Array, n_kv_heads: int) -> tuple[jax.Array, int, int]:
    """q [T, H, D] -> [T, Hkv, Gp, D] with the G heads of each kv head padded to a power of two."""
    t, h, d = q.shape
    if h % n_kv_heads:
        raise ValueError(f"{h} query heads are not a multiple of {n_kv_heads} kv heads")
    g = h // n_kv_heads
    gp = next_pow2(g)
    qg = q.reshape(t, n_kv_heads, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    return qg, g, gp


def ungroup_output(o: jax.Array, g: int) -> jax.Array:
    """[T, Hkv, Gp, D] -> [T, Hkv * G, D]."""
    t, hkv, gp, d = o.shape
    if gp != g:
        o = o[:, :, :g]
    return o.reshape(t, hkv * g, d)


def group_slopes(alibi_slopes: jax.Array | None, n_kv_heads: int, g: int, gp: int):
    """Per-head values (ALiBi slopes, sinks) [H] -> [Hkv, Gp] f32 (padded heads get 0)."""
    if alibi_slopes is None:
        return None
    s = jnp.asarray(alibi_slopes, jnp.float32).reshape(n_kv_heads, g)
    if gp != g:
        s = jnp.pad(s, ((0, 0), (0, gp - g)))
    return s


def tile_rows(vec: jax.Array, gp: int) -> jax.Array:
    """[bq] per token -> [bq * Gp] per (token, head) row."""
    return jnp.broadcast_to(vec[:, None], (vec.shape[0], gp)).reshape(vec.shape[0] * gp)


def head_rows(ref, block_q: int, gp: int) -> jax.Array | None:
    """A kv head's per-query-head values [Gp] (slopes, sinks) -> one per row of a tile [block_q * Gp]."""
    return None if ref is None else jnp.broadcast_to(ref[...][None, :], (block_q, gp)).reshape(block_q * gp)


def dot_precision(dtype) -> lax.Precision:
    """float32 operands are multiplied in float32: HIGHEST, because DEFAULT lets a GPU round them to
    TF32 (10-bit mantissa: XLA's cuBLAS dots and Triton's tl.dot both do) and the kernels and their
    references must agree to float32's precision on every backend. Narrower dtypes keep DEFAULT."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot_f32(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) with float32 accumulation; f32 inputs use IEEE f32 (not TF32) on GPU."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=dot_precision(a.dtype), preferred_element_type=jnp.float32)


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")


def soft_cap(s: jax.Array, softcap: float | None) -> jax.Array:
    """softcap * tanh(s / softcap): Gemma 2's attention-logit soft-capping of scaled scores."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def tree_visible(k_idx: jax.Array, first: jax.Array, bits: jax.Array) -> jax.Array:
    """Whether a query sees key slot k_idx under the tree mask (int32, broadcasting; module
    docstring): slots before its row's first node slot always (the causal mask applies as usual),
    node slots first + j where bit j of its bits is set (an int32 holds bits 0..30: at most 31 nodes;
    slots past a node's own are cut by the causal rule)."""
    off = k_idx - first
    return (off < 0) | ((jnp.right_shift(bits, jnp.clip(off, 0, 31)) & 1) == 1)


def attend_block(carry, q, k, v, k_scale, v_scale, kpos, q_pos, row_ok, kv_len, slopes, *,
                 scale: float, causal: bool, window: int | None, softcap: float | None = None,
                 tree: tuple[jax.Array, jax.Array] | None = None):
    """One online-softmax step of rows q [M, D] over one tile of keys.

    k, v [BK, D] (storage dtype; int8 with k_scale/v_scale [BK] f32), kpos [BK] int32 absolute key
    positions, q_pos [M] int32, row_ok [M] bool or None, kv_len: keys at kpos >= kv_len are
    invalid, slopes [M] f32 or None, softcap: the scaled scores' soft cap or None, tree: each
    row's (first node slot, ancestor bits) [M] int32 under the tree mask (q_pos then holds slots).
    carry = (acc [M, D] f32, m [M] f32, l [M] f32).
    """
    acc, m_prev, l_prev = carry
    cdt = q.dtype
    if k.dtype != cdt:
        k = k.astype(cdt)
    s = dot_f32(q, k, trans_b=True)                           # [M, BK] f32
    if k_scale is not None:
        s = s * k_scale[None, :]
    s = soft_cap(s * scale, softcap)
    rel = kpos[None, :] - q_pos[:, None]                      # l - p
    valid = (kpos < kv_len)[None, :]
    if row_ok is not None:
        valid = valid & row_ok[:, None]
    if causal:
        valid = valid & (rel <= 0)
    if window is not None:
        valid = valid & (rel > -window)
    if tree is not None:
        valid = valid & tree_visible(kpos[None, :], tree[0][:, None], tree[1][:, None])
    if slopes is not None:
        s = s + slopes[:, None] * rel.astype(jnp.float32)
    s = jnp.where(valid, s, NEG_INF)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    if v.dtype != cdt:
        v = v.astype(cdt)
    if v_scale is None:
        return acc * correction[:, None] + dot_f32(p.astype(cdt), v), m_next, l_next
    # p * v_scale is rounded to the compute dtype for the dot: relative to the largest scale of the
    # block's visible keys it stays in p's range, where float16 keeps its relative precision (p * v_scale itself fell into
    # float16's subnormals for small V, and the output's error grew as V shrank)
    vmax = jnp.max(jnp.where(valid, v_scale[None, :], 0.0))   # over the keys seen (p = 0 elsewhere; a
    # max, not any(): Pallas' Triton lowering has no reduce_or)
    vmax = jnp.where(vmax > 0, vmax, 1.0)
    pv = dot_f32((p * (v_scale / vmax)[None, :]).astype(cdt), v) * vmax
    return acc * correction[:, None] + pv, m_next, l_next


def init_carry(rows: int, head_dim: int, sinks: jax.Array | None = None):
    """(acc, max, sum) before any key; sinks [rows] f32: each row's sink logit as a key of value 0."""
    if sinks is not None:
        return (jnp.zeros((rows, head_dim), jnp.float32), sinks.astype(jnp.float32),
                jnp.ones((rows,), jnp.float32))
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def check_sinks(sinks, n_heads: int) -> None:
    if sinks is not None and tuple(sinks.shape) != (n_heads,):
        raise ValueError(f"sinks needs one logit per query head, shape ({n_heads},), got {tuple(sinks.shape)}")


def normalize(acc: jax.Array, l: jax.Array) -> jax.Array:
    """acc / l, and 0 for rows that saw nothing (their acc is 0 and l is 0)."""
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def masked_softmax_attention(q, k, v, q_pos, k_pos, k_valid, *, scale, window, alibi_slopes,
                             causal=True, softcap=None, sinks=None):
    """The reference math. q [T, H, D]; k, v [Hkv, T, L, D] (each token's keys); q_pos [T];
    k_pos [T, L] or [L]; k_valid [T, L] bool (in context); sinks [H] or None: the softmax runs over
    the keys and one more logit per head whose value is 0 (HF gpt-oss's concatenated column).
    Returns [T, H, D] in q.dtype."""
    t, h, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    qg = q.reshape(t, hkv, g, d)
    prec = dot_precision(q.dtype)
    scores = soft_cap(jnp.einsum("tkgd,ktld->kgtl", qg, k, preferred_element_type=jnp.float32, precision=prec)
                      * scale, softcap)
    k_pos = jnp.broadcast_to(k_pos, k_valid.shape)
    rel = k_pos - q_pos[:, None]
    valid = k_valid
    if causal:
        valid = valid & (rel <= 0)
    if window is not None:
        valid = valid & (rel > -window)
    if alibi_slopes is not None:
        sl = jnp.asarray(alibi_slopes, jnp.float32).reshape(hkv, g)
        scores = scores + sl[:, :, None, None] * rel[None, None].astype(jnp.float32)
    scores = jnp.where(valid[None, None], scores, NEG_INF)
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(hkv, g, 1, 1), scores.shape[:3] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(valid[None, None], probs, 0.0)
    out = jnp.einsum("kgtl,ktld->tkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(t, h, d).astype(q.dtype)
