"""Flash attention for one contiguous sequence and ragged paged (chunked-prefill) attention.

Pallas, Triton-style (pass interpret=True, the default on CPU, to run them anywhere); imports jax
only. Masking, soft-capping, ALiBi, attention sinks, int8 KV and GQA follow
pallas_kernels/paged_attention.py: a query at position p sees key position l iff l <= p (causal),
p - W < l (sliding window W) and, for paged attention, l < context_len; a soft cap C maps each scaled
score s to C * tanh(s / C); ALiBi adds slope_h * (l - p); a sink logit per head joins each
softmax's denominator; softmax in f32; a row that sees nothing outputs 0.

Both kernels put the G query heads of one kv head into the rows of a tile: a query tile of
block_q tokens becomes [block_q * Gp, D] rows (Gp = G padded to a power of two), so GQA costs no
repeat of K/V and the dot has block_q * Gp rows.

flash_attention: grid (cdiv(T, block_q), Hkv). Query tile i loops over KV tiles of block_k
tokens, only those that can be visible: [max(0, i*block_q - W + 1) // block_k,
cdiv(min(T, (i+1)*block_q), block_k)) when causal. Partial tiles use masked loads and stores.

ragged_paged_attention: the sequences' chunks of this step (query_start_loc) are cut into query
tiles of at most block_q tokens that never straddle two sequences; grid (num_tiles, Hkv) with
num_tiles = min(T, T // block_q + S), a static bound (unused tiles do nothing). A small int32
table built with jnp gives each tile its sequence, first token, length and context length. Each
tile loops over the compute blocks (pages_per_compute_block pages) that hold keys it can see,
gathering pages straight from the cache through the block table. Tokens outside every chunk
(bucket padding) output 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .paged_attention import (MIN_DOT_ROWS, attend_block, check_sinks, check_softcap, check_triton_shapes,
                              compiler_params,
                              group_queries, group_slopes, init_carry, load_pages,
                              masked_softmax_attention, next_pow2, normalize, pad_block_tables,
                              paged_reference_core, resolve_interpret, ungroup_output)


def _tile_rows(vec: jax.Array, gp: int) -> jax.Array:
    """[bq] per token -> [bq * Gp] per (token, head) row."""
    return jnp.broadcast_to(vec[:, None], (vec.shape[0], gp)).reshape(vec.shape[0] * gp)


# ----------------------------------------------------------------------------------------------
# Flash attention over one contiguous sequence
# ----------------------------------------------------------------------------------------------

def _head_rows(ref, block_q: int, gp: int) -> jax.Array | None:
    """A kv head's per-query-head values [Gp] (slopes, sinks) -> one per row of a tile [block_q * Gp]."""
    return None if ref is None else jnp.broadcast_to(ref[...][None, :], (block_q, gp)).reshape(block_q * gp)


def _flash_kernel(*refs, has_alibi: bool, has_sinks: bool, causal: bool, window: int | None, block_q: int,
                  block_k: int, seq_len: int, scale: float, softcap: float | None):
    refs = list(refs)
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    al_ref = refs.pop(0) if has_alibi else None
    sk_ref = refs.pop(0) if has_sinks else None
    o_ref = refs.pop(0)
    _, gp, d = q_ref.shape                                    # q_ref [T, Gp, D] of one kv head

    q_start = pl.program_id(0) * block_q
    tok = q_start + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    tok_ok = tok < seq_len
    q = plgpu.load(q_ref.at[pl.ds(q_start, block_q)], mask=tok_ok[:, None, None], other=0)
    q = q.reshape(block_q * gp, d)
    q_pos = _tile_rows(tok, gp)
    row_ok = _tile_rows(tok_ok, gp)
    slopes = _head_rows(al_ref, block_q, gp)

    q_last = jnp.minimum(q_start + block_q, seq_len)          # exclusive
    kb_hi = lax.div(q_last + (block_k - 1), block_k) if causal else pl.cdiv(seq_len, block_k)
    if window is None:
        kb_lo = jnp.int32(0)
    else:
        kb_lo = lax.div(jnp.maximum(q_start - (window - 1), 0), block_k)

    def body(kb, carry):
        k_start = kb * block_k
        kpos = k_start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        k_ok = (kpos < seq_len)[:, None]
        k = plgpu.load(k_ref.at[pl.ds(k_start, block_k)], mask=k_ok, other=0)
        v = plgpu.load(v_ref.at[pl.ds(k_start, block_k)], mask=k_ok, other=0)
        return attend_block(carry, q, k, v, None, None, kpos, q_pos, row_ok, seq_len, slopes,
                            scale=scale, causal=causal, window=window, softcap=softcap)

    init = init_carry(block_q * gp, d, _head_rows(sk_ref, block_q, gp))
    acc, _, l = lax.fori_loop(kb_lo, kb_hi, body, init)
    o = normalize(acc, l).astype(o_ref.dtype).reshape(block_q, gp, d)
    plgpu.store(o_ref.at[pl.ds(q_start, block_q)], o, mask=tok_ok[:, None, None])


@functools.partial(jax.jit, static_argnames=(
    "scale", "causal", "window", "softcap", "block_q", "block_k", "interpret", "num_warps", "num_stages"))
def _flash_attention_impl(q, k, v, alibi_slopes, sinks, *, scale, causal, window, softcap, block_q, block_k,
                          interpret, num_warps, num_stages):
    t, h, d = q.shape
    hkv = k.shape[1]
    qg, g, gp = group_queries(q, hkv)
    slopes = group_slopes(alibi_slopes, hkv, g, gp)
    sinks = group_slopes(sinks, hkv, g, gp)
    in_specs = [pl.BlockSpec((t, None, gp, d), lambda i, j: (0, j, 0, 0)),
                pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0)),
                pl.BlockSpec((t, None, d), lambda i, j: (0, j, 0))]
    args = [qg, k, v]
    for per_head in (slopes, sinks):
        if per_head is not None:
            in_specs.append(pl.BlockSpec((None, gp), lambda i, j: (j, 0)))
            args.append(per_head)
    kernel = functools.partial(_flash_kernel, has_alibi=slopes is not None, has_sinks=sinks is not None, causal=causal,
                               window=window, block_q=block_q, block_k=block_k, seq_len=t,
                               scale=scale, softcap=softcap)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(t, block_q), hkv), in_specs=in_specs,
        out_specs=pl.BlockSpec((t, None, gp, d), lambda i, j: (0, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((t, hkv, gp, d), q.dtype), interpret=interpret,
        compiler_params=compiler_params(num_warps, num_stages),
        name=f"flash_attention_bq{block_q}_bk{block_k}",
    )(*args)
    return ungroup_output(out, g)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool = True,
                    window: int | None = None, alibi_slopes: jax.Array | None = None,
                    softcap: float | None = None, sinks: jax.Array | None = None,
                    block_q: int | None = None, block_k: int = 64, num_warps: int | None = None,
                    num_stages: int | None = 2, interpret: bool | None = None) -> jax.Array:
    """Attention of one sequence (positions 0..T-1): q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    causal=False drops l <= p only: a window still requires p - W < l and ALiBi still adds
    slope_h * (l - p). block_q: query tokens per tile (default: 64 // Gp, at least 16), each tile
    holding block_q * Gp rows; block_k: keys per tile. interpret=None means "interpret on CPU".
    """
    interpret = resolve_interpret(interpret)
    t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or h % k.shape[1]:
        raise ValueError(f"bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_softcap(softcap)
    check_sinks(sinks, h)
    gp = next_pow2(h // k.shape[1])
    block_q = block_q or max(16, 64 // gp)
    block_q = max(1, min(block_q, next_pow2(t)))
    block_k = max(1, min(block_k, next_pow2(t)))
    if not interpret:                                   # tl.dot needs M, N >= 16
        block_q = max(block_q, -(-MIN_DOT_ROWS // gp))
        block_k = max(block_k, MIN_DOT_ROWS)
        check_triton_shapes(head_dim=d, block_q=block_q, block_k=block_k)
    return _flash_attention_impl(q, k, v, alibi_slopes, sinks, scale=float(scale), causal=bool(causal),
                                 window=window, softcap=None if softcap is None else float(softcap),
                                 block_q=block_q, block_k=block_k,
                                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap"))
def flash_attention_reference(q, k, v, *, scale, causal=True, window=None, alibi_slopes=None, softcap=None,
                              sinks=None):
    """Dense reference of flash_attention (positions 0..T-1; O(T^2 * D) memory)."""
    t = q.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    kk = jnp.broadcast_to(k.transpose(1, 0, 2)[:, None], (k.shape[1], t, t, k.shape[2]))
    vv = jnp.broadcast_to(v.transpose(1, 0, 2)[:, None], (v.shape[1], t, t, v.shape[2]))
    return masked_softmax_attention(q, kk, vv, pos, pos, jnp.ones((t, t), bool), scale=scale,
                                    window=window, alibi_slopes=alibi_slopes, causal=causal, softcap=softcap,
                                    sinks=sinks)


# ----------------------------------------------------------------------------------------------
# Ragged paged attention (chunked prefill + decode tokens in one call)
# ----------------------------------------------------------------------------------------------

def _ragged_kernel(*refs, quant: bool, has_alibi: bool, has_sinks: bool, block_q: int, ppcb: int,
                   block_size: int, scale: float, window: int | None, softcap: float | None):
    refs = list(refs)
    info_ref, q_ref, pos_ref, k_ref, v_ref = (refs.pop(0) for _ in range(5))
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quant else (None, None)
    bt_ref = refs.pop(0)
    al_ref = refs.pop(0) if has_alibi else None
    sk_ref = refs.pop(0) if has_sinks else None
    _o_init_ref, o_ref = refs                                  # o_init is aliased to o
    _, gp, d = q_ref.shape                                     # q_ref [T, Gp, D] of one kv head
    block_k = ppcb * block_size

    seq, q_start, q_len, ctx = info_ref[0], info_ref[1], info_ref[2], info_ref[3]
    tok_ok = lax.broadcasted_iota(jnp.int32, (block_q,), 0) < q_len
    pos = plgpu.load(pos_ref.at[pl.ds(q_start, block_q)], mask=tok_ok, other=0)
    q = plgpu.load(q_ref.at[pl.ds(q_start, block_q)], mask=tok_ok[:, None, None], other=0)
    q = q.reshape(block_q * gp, d)
    q_pos = _tile_rows(pos, gp)
    row_ok = _tile_rows(tok_ok, gp)
    slopes = _head_rows(al_ref, block_q, gp)

    # Keys any row of the tile can see: [min_pos - W + 1, min(max_pos + 1, ctx)).
    max_pos = jnp.max(jnp.where(tok_ok, pos, -1))
    kb_hi = lax.div(jnp.maximum(jnp.minimum(max_pos + 1, ctx), 0) + (block_k - 1), block_k)
    if window is None:
        kb_lo = jnp.int32(0)
    else:
        min_pos = jnp.min(jnp.where(tok_ok, pos, jnp.iinfo(jnp.int32).max - window))
        kb_lo = lax.div(jnp.maximum(min_pos - (window - 1), 0), block_k)

    def body(kb, carry):
        k, v, ks, vs = load_pages(lambda sl: bt_ref[seq, sl], kb, ppcb, k_ref, v_ref, ks_ref,
                                  vs_ref)
        kpos = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return attend_block(carry, q, k, v, ks, vs, kpos, q_pos, row_ok, ctx, slopes,
                            scale=scale, causal=True, window=window, softcap=softcap)

    init = init_carry(block_q * gp, d, _head_rows(sk_ref, block_q, gp))
    acc, _, l = lax.fori_loop(kb_lo, kb_hi, body, init)
    o = normalize(acc, l).astype(o_ref.dtype).reshape(block_q, gp, d)
    plgpu.store(o_ref.at[pl.ds(q_start, block_q)], o, mask=tok_ok[:, None, None])


def ragged_tile_table(query_start_loc: jax.Array, context_lens: jax.Array, num_tokens: int,
                      block_q: int) -> jax.Array:
    """[num_tiles, 4] int32 rows (seq, first token, tokens in tile, context_len) for query tiles
    of at most block_q tokens that never straddle two sequences. num_tiles = min(T, T//bq + S) is
    a static upper bound; unused rows have 0 tokens."""
    qsl = query_start_loc.astype(jnp.int32)
    s = qsl.shape[0] - 1
    num_tiles = max(1, min(num_tokens, num_tokens // block_q + s))
    lens = jnp.maximum(qsl[1:] - qsl[:-1], 0)
    tiles = (lens + (block_q - 1)) // block_q
    first_tile = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles, dtype=jnp.int32)])
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(first_tile[1:], j, side="right").astype(jnp.int32)
    used = seq < s
    seq = jnp.minimum(seq, s - 1)
    start = qsl[seq] + (j - first_tile[seq]) * block_q
    n = jnp.clip(qsl[seq + 1] - start, 0, block_q)
    return jnp.stack([seq, jnp.where(used, start, 0), jnp.where(used, n, 0),
                      context_lens.astype(jnp.int32)[seq]], axis=1)


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "softcap", "block_q", "pages_per_compute_block", "interpret", "num_warps",
    "num_stages"))
def _ragged_impl(q, k_pages, v_pages, positions, query_start_loc, block_tables, context_lens,
                 alibi_slopes, sinks, k_scale, v_scale, *, scale, window, softcap, block_q, pages_per_compute_block,
                 interpret, num_warps, num_stages):
    t, h, d = q.shape
    hkv, nb, bs, _ = k_pages.shape
    quant = k_scale is not None
    ppcb = pages_per_compute_block
    qg, g, gp = group_queries(q, hkv)
    slopes = group_slopes(alibi_slopes, hkv, g, gp)
    sinks = group_slopes(sinks, hkv, g, gp)
    bt = pad_block_tables(block_tables, ppcb)
    info = ragged_tile_table(query_start_loc, context_lens, t, block_q)
    num_tiles = info.shape[0]

    q_spec = pl.BlockSpec((t, None, gp, d), lambda i, j: (0, j, 0, 0))
    page_spec = pl.BlockSpec((None, nb, bs, d), lambda i, j: (j, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, nb, bs), lambda i, j: (j, 0, 0))
    in_specs = [pl.BlockSpec((None, 4), lambda i, j: (i, 0)), q_spec,
                pl.BlockSpec((t,), lambda i, j: (0,)), page_spec, page_spec]
    args = [info, qg, positions.astype(jnp.int32), k_pages, v_pages]
    if quant:
        in_specs += [scale_spec, scale_spec]
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    in_specs.append(pl.BlockSpec(bt.shape, lambda i, j: (0, 0)))
    args.append(bt)
    for per_head in (slopes, sinks):
        if per_head is not None:
            in_specs.append(pl.BlockSpec((None, gp), lambda i, j: (j, 0)))
            args.append(per_head)
    in_specs.append(q_spec)                      # zeros, aliased to the output: untouched rows = 0
    args.append(jnp.zeros(qg.shape, q.dtype))

    kernel = functools.partial(_ragged_kernel, quant=quant, has_alibi=slopes is not None,
                               has_sinks=sinks is not None,
                               block_q=block_q, ppcb=ppcb, block_size=bs, scale=scale,
                               window=window, softcap=softcap)
    out = pl.pallas_call(
        kernel, grid=(num_tiles, hkv), in_specs=in_specs, out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        input_output_aliases={len(args) - 1: 0}, interpret=interpret,
        compiler_params=compiler_params(num_warps, num_stages),
        name=f"ragged_paged_attention_bq{block_q}_ppcb{ppcb}",
    )(*args)
    return ungroup_output(out, g)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           positions: jax.Array, seq_ids: jax.Array, query_start_loc: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array, *, scale: float,
                           window: int | None = None, alibi_slopes: jax.Array | None = None,
                           softcap: float | None = None, sinks: jax.Array | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           block_q: int | None = None, pages_per_compute_block: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = 2,
                           interpret: bool | None = None) -> jax.Array:
    """Ragged paged attention of a step's chunks: q [T, H, D] -> [T, H, D].

    Sequence s owns tokens [query_start_loc[s], query_start_loc[s+1]) of q (contiguous; each at
    its absolute positions[t]) and attends to its cache through block_tables[s] (this step's K/V
    already written), up to context_lens[s]. Decode tokens are chunks of length 1. seq_ids is
    accepted for interface parity with the metadata (the kernel takes each tile's sequence from
    query_start_loc; they must agree). Tokens outside every chunk output 0.
    block_q: query tokens per tile (default: 64 // Gp, at least 16); pages_per_compute_block:
    pages per KV tile (default: about 64 tokens). interpret=None means "interpret on CPU".
    """
    del seq_ids
    interpret = resolve_interpret(interpret)
    t, h, d = q.shape
    hkv, _, bs, dk = k_pages.shape
    if dk != d or v_pages.shape != k_pages.shape or h % hkv:
        raise ValueError(f"q {q.shape} and pages {k_pages.shape}/{v_pages.shape} disagree")
    if positions.shape != (t,):
        raise ValueError("positions needs one entry per token of q")
    if query_start_loc.shape != (block_tables.shape[0] + 1,) or context_lens.shape != (
            block_tables.shape[0],):
        raise ValueError("query_start_loc [S+1], block_tables [S, B], context_lens [S] disagree")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale (int8 pages) or neither")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_softcap(softcap)
    check_sinks(sinks, h)
    gp = next_pow2(h // hkv)
    block_q = block_q or max(16, 64 // gp)
    block_q = max(1, min(block_q, next_pow2(t)))
    ppcb = pages_per_compute_block or max(1, 64 // bs)
    ppcb = max(1, min(ppcb, next_pow2(block_tables.shape[1])))
    if not interpret:                                   # tl.dot needs M, N >= 16
        block_q = max(block_q, -(-MIN_DOT_ROWS // gp))
        ppcb = max(ppcb, MIN_DOT_ROWS // bs)
        check_triton_shapes(head_dim=d, block_q=block_q, block_size=bs,
                            pages_per_compute_block=ppcb)
    return _ragged_impl(q, k_pages, v_pages, positions, query_start_loc, block_tables,
                        context_lens, alibi_slopes, sinks, k_scale, v_scale, scale=float(scale),
                        window=window, softcap=None if softcap is None else float(softcap),
                        block_q=block_q, pages_per_compute_block=ppcb,
                        interpret=interpret, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def ragged_paged_attention_reference(q, k_pages, v_pages, positions, seq_ids, query_start_loc,
                                     block_tables, context_lens, *, scale, window=None,
                                     alibi_slopes=None, softcap=None, sinks=None, k_scale=None, v_scale=None):
    """Gather-based reference of ragged_paged_attention (tokens outside every chunk -> 0)."""
    out = paged_reference_core(q, k_pages, v_pages, positions, seq_ids, block_tables,
                               context_lens, scale=scale, window=window,
                               alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, k_scale=k_scale,
                               v_scale=v_scale)
    tok = jnp.arange(q.shape[0], dtype=jnp.int32)
    covered = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    return jnp.where(covered[:, None, None], out, 0).astype(q.dtype)
