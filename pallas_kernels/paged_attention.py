"""Paged decode attention (Pallas, Triton-style) and its pure-jnp reference.

Layouts (those of jaxinfer/kv_cache.py; this module imports jax only):
    q             [S, H, D]      one query token per sequence, at position context_lens[s] - 1
    k/v_pages     [Hkv, num_blocks, block_size, D]   block 0 is the null block
    k/v_scale     [Hkv, num_blocks, block_size] f32  only for int8 pages: value = int8 * scale
    block_tables  [S, max_blocks] int32              logical -> physical block, padded with 0
    context_lens  [S] int32                          tokens in the cache (this step's included)
GQA: H = Hkv * G and query head h reads kv head h // G.

Masking (shared with flash_attention.py): a query at position p sees cache position l iff
l <= p, l < context_len and, with a sliding window W, p - W < l. With a soft cap C (Gemma 2) each
scaled score s becomes C * tanh(s / C); then ALiBi adds slope_h * (l - p) to the score. Attention
sinks (gpt-oss; sinks [H] f32) add e^(sink_h) to each softmax denominator, a key of value 0: the
online softmax starts each row from (max, sum) = (sink_h, 1) instead of (-inf, 0). Scores and
softmax are float32; a row that sees nothing outputs 0.

The decode kernel runs on grid (S, Hkv, num_splits). One program holds the G query heads of one
kv head (padded to a power of two >= 16 rows, the smallest Triton dot) and walks its share of the
sequence's visible compute blocks (pages_per_compute_block pages each) through the block table,
gathering pages straight from the cache with an online softmax in f32. With num_splits > 1 the
visible range of each sequence is divided evenly among the splits (long contexts keep more SMs
busy) and the partial results are merged with a log-sum-exp combine.

The helpers used by both kernel files (interpret default, compiler params, the masked online
softmax step) live here so flash_attention.py can import them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30          # finite mask value: fully masked rows never produce NaN
MIN_DOT_ROWS = 16        # Triton's tl.dot needs M, N, K >= 16


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------

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


def group_queries(q: jax.Array, n_kv_heads: int, min_group: int = 1) -> tuple[jax.Array, int, int]:
    """q [T, H, D] -> [T, Hkv, Gp, D] with the G heads of each kv head padded to a power of two."""
    t, h, d = q.shape
    if h % n_kv_heads:
        raise ValueError(f"{h} query heads are not a multiple of {n_kv_heads} kv heads")
    g = h // n_kv_heads
    gp = max(next_pow2(g), min_group)
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


def pad_block_tables(block_tables: jax.Array, pages_per_compute_block: int) -> jax.Array:
    """Pad the columns to a multiple of pages_per_compute_block with the null block 0."""
    mb = block_tables.shape[1]
    cols = -(-mb // pages_per_compute_block) * pages_per_compute_block
    bt = block_tables.astype(jnp.int32)
    if cols != mb:
        bt = jnp.pad(bt, ((0, 0), (0, cols - mb)))
    return bt


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


def attend_block(carry, q, k, v, k_scale, v_scale, kpos, q_pos, row_ok, kv_len, slopes, *,
                 scale: float, causal: bool, window: int | None, softcap: float | None = None):
    """One online-softmax step of rows q [M, D] over one tile of keys.

    k, v [BK, D] (storage dtype; int8 with k_scale/v_scale [BK] f32), kpos [BK] int32 absolute key
    positions, q_pos [M] int32, row_ok [M] bool or None, kv_len: keys at kpos >= kv_len are
    invalid, slopes [M] f32 or None, softcap: the scaled scores' soft cap or None.
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
    if slopes is not None:
        s = s + slopes[:, None] * rel.astype(jnp.float32)
    s = jnp.where(valid, s, NEG_INF)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    if v_scale is not None:
        p = p * v_scale[None, :]
    if v.dtype != cdt:
        v = v.astype(cdt)
    acc = acc * correction[:, None] + dot_f32(p.astype(cdt), v)
    return acc, m_next, l_next


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


def load_pages(bt_ref_row, kb, ppcb, k_ref, v_ref, ks_ref, vs_ref):
    """Gather compute block kb (ppcb pages) of one kv head straight from the pages."""
    pages = bt_ref_row(pl.ds(kb * ppcb, ppcb))                 # [ppcb] physical block ids
    k = k_ref[pages]                                           # [ppcb, bs, D]
    v = v_ref[pages]
    ppcb_, bs, d = k.shape
    k = k.reshape(ppcb_ * bs, d)
    v = v.reshape(ppcb_ * bs, d)
    ks = None if ks_ref is None else ks_ref[pages].reshape(ppcb_ * bs)
    vs = None if vs_ref is None else vs_ref[pages].reshape(ppcb_ * bs)
    return k, v, ks, vs


# ----------------------------------------------------------------------------------------------
# Decode kernel
# ----------------------------------------------------------------------------------------------

def _decode_kernel(*refs, quant: bool, has_alibi: bool, has_sinks: bool, num_splits: int, ppcb: int,
                   block_size: int, scale: float, window: int | None, softcap: float | None):
    refs = list(refs)
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quant else (None, None)
    bt_ref, len_ref = refs.pop(0), refs.pop(0)
    al_ref = refs.pop(0) if has_alibi else None
    sk_ref = refs.pop(0) if has_sinks else None
    o_ref = refs.pop(0)
    lse_ref = refs.pop(0) if num_splits > 1 else None

    gp, d = q_ref.shape
    block_k = ppcb * block_size
    ctx = len_ref[0]
    pos = ctx - 1                                   # the query token's own position

    # Visible compute blocks [kb_lo, kb_hi): keys [max(0, pos - W + 1), ctx).
    kb_hi = lax.div(ctx + (block_k - 1), block_k)
    if window is None:
        kb_lo = jnp.int32(0)
    else:
        kb_lo = lax.div(jnp.maximum(pos - (window - 1), 0), block_k)
    if num_splits > 1:
        per_split = lax.div(kb_hi - kb_lo + (num_splits - 1), num_splits)
        lo = kb_lo + pl.program_id(2) * per_split
        hi = jnp.minimum(lo + per_split, kb_hi)
    else:
        lo, hi = kb_lo, kb_hi

    q = q_ref[...]
    q_pos = jnp.full((gp,), pos, jnp.int32)
    slopes = al_ref[...] if has_alibi else None

    def body(kb, carry):
        k, v, ks, vs = load_pages(lambda sl: bt_ref[sl], kb, ppcb, k_ref, v_ref, ks_ref, vs_ref)
        kpos = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return attend_block(carry, q, k, v, ks, vs, kpos, q_pos, None, ctx, slopes,
                            scale=scale, causal=True, window=window, softcap=softcap)

    carry = init_carry(gp, d)
    if sk_ref is not None:   # the sink counts once: in split 0's partial softmax, merged by log-sum-exp
        first = jnp.full((gp,), pl.program_id(2), jnp.int32) == 0
        carry = (carry[0], jnp.where(first, sk_ref[...], NEG_INF), jnp.where(first, 1.0, 0.0).astype(jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, body, carry)
    o_ref[...] = normalize(acc, l).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "pages_per_compute_block", "num_splits", "interpret", "num_warps",
    "num_stages"))
def _paged_attention_impl(q, k_pages, v_pages, block_tables, context_lens, alibi_slopes, sinks, k_scale,
                          v_scale, *, scale, window, softcap, pages_per_compute_block, num_splits,
                          interpret, num_warps, num_stages):
    s, h, d = q.shape
    hkv, nb, bs, _ = k_pages.shape
    quant = k_scale is not None
    ppcb = pages_per_compute_block
    qg, g, gp = group_queries(q, hkv, MIN_DOT_ROWS)
    slopes = group_slopes(alibi_slopes, hkv, g, gp)
    sinks = group_slopes(sinks, hkv, g, gp)
    bt = pad_block_tables(block_tables, ppcb)
    cols = bt.shape[1]
    lens = context_lens.astype(jnp.int32)

    page_spec = pl.BlockSpec((None, nb, bs, d), lambda i, j, p: (j, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, nb, bs), lambda i, j, p: (j, 0, 0))
    q_spec = pl.BlockSpec((None, None, gp, d), lambda i, j, p: (i, j, 0, 0))
    in_specs = [q_spec, page_spec, page_spec]
    args = [qg, k_pages, v_pages]
    if quant:
        in_specs += [scale_spec, scale_spec]
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    in_specs += [pl.BlockSpec((None, cols), lambda i, j, p: (i, 0)),
                 pl.BlockSpec((1,), lambda i, j, p: (i,))]
    args += [bt, lens]
    for per_head in (slopes, sinks):
        if per_head is not None:
            in_specs.append(pl.BlockSpec((None, gp), lambda i, j, p: (j, 0)))
            args.append(per_head)

    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((s, hkv, gp, d), q.dtype)
        out_specs = pl.BlockSpec((None, None, gp, d), lambda i, j, p: (i, j, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, s, hkv, gp, d), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, s, hkv, gp), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, gp, d), lambda i, j, p: (p, i, j, 0, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, j, p: (p, i, j, 0)))

    kernel = functools.partial(
        _decode_kernel, quant=quant, has_alibi=slopes is not None, has_sinks=sinks is not None, num_splits=num_splits,
        ppcb=ppcb, block_size=bs, scale=scale, window=window, softcap=softcap)
    out = pl.pallas_call(
        kernel, grid=(s, hkv, num_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=compiler_params(num_warps, num_stages),
        name=f"paged_decode_ppcb{ppcb}_splits{num_splits}",
    )(*args)

    if num_splits > 1:
        o_parts, lse = out                                   # [P, S, Hkv, Gp, D], [P, S, Hkv, Gp]
        w = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))   # the max split has weight 1
        out = jnp.sum(o_parts * w[..., None], axis=0) / jnp.sum(w, axis=0)[..., None]
    return ungroup_output(out.astype(q.dtype), g)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    context_lens: jax.Array, *, scale: float, window: int | None = None,
                    alibi_slopes: jax.Array | None = None, softcap: float | None = None,
                    sinks: jax.Array | None = None, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None, pages_per_compute_block: int | None = None,
                    num_splits: int = 1, num_warps: int | None = None, num_stages: int | None = 2,
                    interpret: bool | None = None) -> jax.Array:
    """Paged decode attention: q [S, H, D] (the token at position context_lens[s]-1) -> [S, H, D].

    pages_per_compute_block: pages per KV tile (default: about 128 tokens); num_splits: partitions
    of each sequence's visible context merged by log-sum-exp (use > 1 for long contexts and small
    batches). interpret=None means "interpret on CPU".
    """
    interpret = resolve_interpret(interpret)
    s, h, d = q.shape
    hkv, _, bs, dk = k_pages.shape
    if dk != d or v_pages.shape != k_pages.shape:
        raise ValueError(f"q {q.shape} and pages {k_pages.shape}/{v_pages.shape} disagree")
    if block_tables.shape[0] != s or context_lens.shape != (s,):
        raise ValueError("block_tables / context_lens need one row per sequence of q")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (int8 pages) or neither")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_softcap(softcap)
    check_sinks(sinks, h)
    ppcb = pages_per_compute_block or max(1, 128 // bs)
    ppcb = max(1, min(ppcb, next_pow2(block_tables.shape[1])))
    if not interpret:
        ppcb = max(ppcb, MIN_DOT_ROWS // bs)        # a KV tile of >= 16 keys for tl.dot
        check_triton_shapes(head_dim=d, block_size=bs, pages_per_compute_block=ppcb)
    return _paged_attention_impl(
        q, k_pages, v_pages, block_tables, context_lens, alibi_slopes, sinks, k_scale, v_scale,
        scale=float(scale), window=window, softcap=None if softcap is None else float(softcap),
        pages_per_compute_block=ppcb, num_splits=num_splits,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------------------
# Pure-jnp references
# ----------------------------------------------------------------------------------------------

def dequantize_pages(pages: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """int8 pages * per-token scale (in f32) -> dtype; float pages pass through."""
    if scales is None:
        return pages
    return (pages.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


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


def paged_reference_core(q, k_pages, v_pages, positions, seq_ids, block_tables, context_lens, *,
                         scale, window=None, alibi_slopes=None, softcap=None, sinks=None, k_scale=None,
                         v_scale=None):
    """Each token gathers its sequence's pages in logical order and attends (O(T * max_len))."""
    hkv, _, bs, d = k_pages.shape
    s, mb = block_tables.shape
    k = dequantize_pages(k_pages, k_scale, q.dtype)[:, block_tables].reshape(hkv, s, mb * bs, d)
    v = dequantize_pages(v_pages, v_scale, q.dtype)[:, block_tables].reshape(hkv, s, mb * bs, d)
    k_pos = jnp.arange(mb * bs, dtype=jnp.int32)
    in_ctx = k_pos[None, :] < context_lens.astype(jnp.int32)[seq_ids][:, None]
    return masked_softmax_attention(q, k[:, seq_ids], v[:, seq_ids], positions.astype(jnp.int32),
                                    k_pos, in_ctx, scale=scale, window=window,
                                    alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def paged_attention_reference(q, k_pages, v_pages, block_tables, context_lens, *, scale,
                              window=None, alibi_slopes=None, softcap=None, sinks=None, k_scale=None,
                              v_scale=None):
    """Reference of paged_attention: one token per sequence at position context_lens - 1."""
    s = q.shape[0]
    lens = context_lens.astype(jnp.int32)
    return paged_reference_core(q, k_pages, v_pages, lens - 1, jnp.arange(s, dtype=jnp.int32),
                                block_tables, lens, scale=scale, window=window,
                                alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, k_scale=k_scale,
                                v_scale=v_scale)
