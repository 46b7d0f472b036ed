"""Ragged paged attention, the serving kernel: a step's prefill chunks and decode tokens in one call
over the paged KV cache, and its pure-jnp reference.

Pallas, Triton-style (pass interpret=True, the default on CPU, to run it anywhere); imports jax
only. Masking, soft-capping, ALiBi, attention sinks and GQA follow
pallas_kernels/attention_common.py.

Layouts (those of jaxinfer/kv_cache.py):
    q               [T, H, D]      this step's tokens, each at its absolute positions[t]
    k/v_pages       [Hkv, num_blocks, block_size, D]   block 0 is the null block
    k/v_scale       [Hkv, num_blocks, block_size] f32  only for int8 / fp8 pages: value = page * scale
    query_start_loc [S + 1] int32                      sequence s owns tokens [qsl[s], qsl[s+1])
    block_tables    [S, max_blocks] int32              logical -> physical block, padded with 0
    context_lens    [S] int32                          tokens in the cache (this step's included)
    tree            [T, 3] int32 or None               Medusa's tree mask: (slot, first node slot,
                                                       ancestor bits) per token (attention_common)

The sequences' chunks (a decode token is a chunk of length 1) are cut into query tiles of at most
block_q tokens that never straddle two sequences; grid (num_tiles, Hkv) with
num_tiles = min(T, T // block_q + S), a static bound (unused tiles do nothing). A small int32 table
built with jnp gives each tile its sequence, first token, length and context length. Each tile
loops over the compute blocks (pages_per_compute_block pages) that hold keys it can see, gathering
pages straight from the cache through the block table, with an online softmax in f32. Tokens
outside every chunk (bucket padding) output 0. With a tree mask the slots take the positions' place
in the kernel (the tile's key range included) and each row's (first, bits) mask its keys in
attend_block; without one (tree=None) the kernel has neither input nor mask: the same program. The
sliding window is part of the program (an int) or, for a pipeline stage whose layer's window differs
between stages, an int32 input of the step (the same masks and key range, read at run time).

Split-KV ("flash-decoding", num_kv_splits = S > 1): at batch-1 decode the grid (num_tiles, Hkv) is
Hkv programs, each streaming a whole long context alone while most SMs idle. With S splits the grid
is (num_tiles, Hkv, S): split s of a tile walks the s-th contiguous share, ceil(n / S) blocks, of
the tile's n compute blocks [kb_lo, kb_hi) (computed at run time; the last splits may be short or
empty and then do nothing) and stores its unnormalized partials, acc [S, T, Hkv, Gp, D] and running
max m / sum l [S, T, Hkv, Gp] in f32; combine_splits merges them in jnp after the kernel (m* = max_s
m_s, out = sum_s e^(m_s - m*) acc_s / sum_s e^(m_s - m*) l_s). Attention sinks are not in the split
kernel: the combine counts each row's sink once, as one more partial (m, l, acc) = (sink_h, 1, 0).
Only the f32 accumulation order differs from S = 1, which is exactly the unsplit program. The gain
is a prediction until a GPU measures it (bench/gpu/attention.py's decode part times S = 4 and 16):
long contexts at few tiles x Hkv programs should gain, short ones lose the combine's extra launch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention_common import (MIN_DOT_ROWS, attend_block, check_sinks, check_softcap, check_triton_shapes,
                               compiler_params, group_queries, group_slopes, head_rows, init_carry,
                               masked_softmax_attention, next_pow2, normalize, resolve_interpret, tile_rows,
                               tree_visible, ungroup_output)


def pad_block_tables(block_tables: jax.Array, pages_per_compute_block: int) -> jax.Array:
    """Pad the columns to a multiple of pages_per_compute_block with the null block 0."""
    mb = block_tables.shape[1]
    cols = -(-mb // pages_per_compute_block) * pages_per_compute_block
    bt = block_tables.astype(jnp.int32)
    if cols != mb:
        bt = jnp.pad(bt, ((0, 0), (0, cols - mb)))
    return bt


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


def _ragged_kernel(*refs, quant: bool, has_alibi: bool, has_sinks: bool, has_tree: bool, has_traced_window: bool,
                   block_q: int, ppcb: int, block_size: int, scale: float, window: int | None,
                   softcap: float | None, num_splits: int = 1):
    refs = list(refs)
    info_ref, q_ref, pos_ref, k_ref, v_ref = (refs.pop(0) for _ in range(5))
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quant else (None, None)
    bt_ref = refs.pop(0)
    al_ref = refs.pop(0) if has_alibi else None
    sk_ref = refs.pop(0) if has_sinks else None
    first_ref, bits_ref = (refs.pop(0), refs.pop(0)) if has_tree else (None, None)
    if has_traced_window:            # a pipeline stage's window: a value of the step, not of the program
        window = refs.pop(0)[0]
    if num_splits == 1:
        _o_init_ref, o_ref = refs                              # o_init is aliased to o
    else:
        acc_ref, m_ref, l_ref = refs                           # this split's partials [T, Gp(, D)]
    _, gp, d = q_ref.shape                                     # q_ref [T, Gp, D] of one kv head
    block_k = ppcb * block_size

    seq, q_start, q_len, ctx = info_ref[0], info_ref[1], info_ref[2], info_ref[3]
    tok_ok = lax.broadcasted_iota(jnp.int32, (block_q,), 0) < q_len
    pos = plgpu.load(pos_ref.at[pl.ds(q_start, block_q)], mask=tok_ok, other=0)
    q = plgpu.load(q_ref.at[pl.ds(q_start, block_q)], mask=tok_ok[:, None, None], other=0)
    q = q.reshape(block_q * gp, d)
    q_pos = tile_rows(pos, gp)
    row_ok = tile_rows(tok_ok, gp)
    slopes = head_rows(al_ref, block_q, gp)
    tree = None
    if has_tree:      # pos holds slots; each row's first node slot and ancestor bits
        tree = tuple(tile_rows(plgpu.load(r.at[pl.ds(q_start, block_q)], mask=tok_ok, other=0), gp)
                     for r in (first_ref, bits_ref))

    # Keys any row of the tile can see: [min_pos - W + 1, min(max_pos + 1, ctx)).
    max_pos = jnp.max(jnp.where(tok_ok, pos, -1))
    kb_hi = lax.div(jnp.maximum(jnp.minimum(max_pos + 1, ctx), 0) + (block_k - 1), block_k)
    if window is None:
        kb_lo = jnp.int32(0)
    else:
        min_pos = jnp.min(jnp.where(tok_ok, pos, jnp.iinfo(jnp.int32).max - window))
        kb_lo = lax.div(jnp.maximum(min_pos - (window - 1), 0), block_k)
    if num_splits > 1:
        kb_lo, kb_hi = split_range(kb_lo, kb_hi, pl.program_id(2), num_splits)

    def body(kb, carry):
        k, v, ks, vs = load_pages(lambda sl: bt_ref[seq, sl], kb, ppcb, k_ref, v_ref, ks_ref,
                                  vs_ref)
        kpos = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return attend_block(carry, q, k, v, ks, vs, kpos, q_pos, row_ok, ctx, slopes,
                            scale=scale, causal=True, window=window, softcap=softcap, tree=tree)

    init = init_carry(block_q * gp, d, head_rows(sk_ref, block_q, gp))
    acc, m, l = lax.fori_loop(kb_lo, kb_hi, body, init)
    if num_splits > 1:                 # unnormalized: combine_splits merges the splits after the kernel
        plgpu.store(acc_ref.at[pl.ds(q_start, block_q)], acc.reshape(block_q, gp, d), mask=tok_ok[:, None, None])
        for ref, x in ((m_ref, m), (l_ref, l)):
            plgpu.store(ref.at[pl.ds(q_start, block_q)], x.reshape(block_q, gp), mask=tok_ok[:, None])
        return
    o = normalize(acc, l).astype(o_ref.dtype).reshape(block_q, gp, d)
    plgpu.store(o_ref.at[pl.ds(q_start, block_q)], o, mask=tok_ok[:, None, None])


def split_range(kb_lo, kb_hi, split, num_splits: int):
    """Split `split`'s share of the compute blocks [kb_lo, kb_hi): ceil(n / num_splits) blocks each,
    in order, so the last splits may be short or empty (lo >= hi: the loop runs no iteration)."""
    per = lax.div(jnp.maximum(kb_hi - kb_lo, 0) + (num_splits - 1), num_splits)
    lo = kb_lo + split * per
    return lo, jnp.minimum(lo + per, kb_hi)


def combine_splits(acc, m, l, sinks, covered, dtype):
    """Merge the splits' partial softmaxes: acc [S, T, Hkv, Gp, D], m, l [S, T, Hkv, Gp] f32 (each
    split's unnormalized output, running max and sum over its keys), sinks [Hkv, Gp] f32 or None
    (counted once, here, as one more partial: max sink_h, sum 1, output 0), covered [T] bool: tokens
    in some chunk (the kernel writes no other row) -> [T, Hkv, Gp, D] in dtype; rows that saw no key
    (l = 0 everywhere and no sink) and tokens outside every chunk output 0."""
    m_star = jnp.max(m, axis=0)                                         # [T, Hkv, Gp]
    if sinks is not None:
        m_star = jnp.maximum(m_star, sinks[None])
    w = jnp.exp(m - m_star[None])                                       # [S, T, Hkv, Gp]; empty split: l = 0
    l_sum = jnp.sum(w * l, axis=0)
    if sinks is not None:
        l_sum = l_sum + jnp.exp(sinks[None] - m_star)
    out = jnp.sum(w[..., None] * acc, axis=0) / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return jnp.where(covered[:, None, None, None], out, 0.0).astype(dtype)


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
    "num_stages", "num_kv_splits"))
def _ragged_impl(q, k_pages, v_pages, positions, query_start_loc, block_tables, context_lens,
                 alibi_slopes, sinks, k_scale, v_scale, tree, traced_window, *, scale, window, softcap, block_q,
                 pages_per_compute_block, interpret, num_warps, num_stages, num_kv_splits=1):
    t, h, d = q.shape
    hkv, nb, bs, _ = k_pages.shape
    ppcb = pages_per_compute_block
    splits = num_kv_splits
    qg, g, gp = group_queries(q, hkv)
    slopes = group_slopes(alibi_slopes, hkv, g, gp)
    sinks = group_slopes(sinks, hkv, g, gp)
    bt = pad_block_tables(block_tables, ppcb)
    info = ragged_tile_table(query_start_loc, context_lens, t, block_q)
    if tree is not None:            # the slots take the positions' place in every mask
        positions = tree[:, 0]
    # with splits the sinks join in combine_splits, once per row, not in every split's softmax
    in_specs, args = _kernel_inputs(info, qg, positions, k_pages, v_pages, k_scale, v_scale, bt, slopes,
                                    sinks if splits == 1 else None, tree, traced_window)
    kernel = functools.partial(_ragged_kernel, quant=k_scale is not None, has_alibi=slopes is not None,
                               has_sinks=sinks is not None and splits == 1, has_tree=tree is not None,
                               has_traced_window=traced_window is not None,
                               block_q=block_q, ppcb=ppcb, block_size=bs, scale=scale,
                               window=window, softcap=softcap, num_splits=splits)
    name = f"ragged_paged_attention_bq{block_q}_ppcb{ppcb}"
    params = compiler_params(num_warps, num_stages)
    q_spec = in_specs[1]
    if splits == 1:
        in_specs.append(q_spec)                  # zeros, aliased to the output: untouched rows = 0
        args.append(jnp.zeros(qg.shape, q.dtype))
        out = pl.pallas_call(
            kernel, grid=(info.shape[0], hkv), in_specs=in_specs, out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
            input_output_aliases={len(args) - 1: 0}, interpret=interpret,
            compiler_params=params, name=name,
        )(*args)
        return ungroup_output(out, g)
    row_spec = pl.BlockSpec((None, t, None, gp), lambda i, j, s: (s, 0, j, 0))
    acc, m, l = pl.pallas_call(
        kernel, grid=(info.shape[0], hkv, splits), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, t, None, gp, d), lambda i, j, s: (s, 0, j, 0, 0)), row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((splits,) + qg.shape, jnp.float32)]
        + [jax.ShapeDtypeStruct((splits, t, hkv, gp), jnp.float32)] * 2,
        interpret=interpret, compiler_params=params, name=f"{name}_splits{splits}",
    )(*args)
    tok = jnp.arange(t, dtype=jnp.int32)
    covered = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    return ungroup_output(combine_splits(acc, m, l, sinks, covered, q.dtype), g)


def _kernel_inputs(info, qg, positions, k_pages, v_pages, k_scale, v_scale, bt, slopes, sinks, tree,
                   traced_window) -> tuple[list, list]:
    """_ragged_kernel's inputs and their BlockSpecs, in the kernel's order (index maps of the grid
    (tile i, kv head j[, split])): the tile table, q [T, Hkv, Gp, D], positions, the pages (and
    their scales), the block table, then the optional per-head / per-token inputs."""
    t, _, gp, d = qg.shape
    _, nb, bs, _ = k_pages.shape
    q_spec = pl.BlockSpec((t, None, gp, d), lambda i, j, *_: (0, j, 0, 0))
    page_spec = pl.BlockSpec((None, nb, bs, d), lambda i, j, *_: (j, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, nb, bs), lambda i, j, *_: (j, 0, 0))
    in_specs = [pl.BlockSpec((None, 4), lambda i, j, *_: (i, 0)), q_spec,
                pl.BlockSpec((t,), lambda i, j, *_: (0,)), page_spec, page_spec]
    args = [info, qg, positions.astype(jnp.int32), k_pages, v_pages]
    if k_scale is not None:
        in_specs += [scale_spec, scale_spec]
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    in_specs.append(pl.BlockSpec(bt.shape, lambda i, j, *_: (0, 0)))
    args.append(bt)
    for per_head in (slopes, sinks):
        if per_head is not None:
            in_specs.append(pl.BlockSpec((None, gp), lambda i, j, *_: (j, 0)))
            args.append(per_head)
    if tree is not None:            # each token's first node slot and ancestor bits
        in_specs += [pl.BlockSpec((t,), lambda i, j, *_: (0,))] * 2
        args += [tree[:, 1].astype(jnp.int32), tree[:, 2].astype(jnp.int32)]
    if traced_window is not None:
        in_specs.append(pl.BlockSpec((1,), lambda i, j, *_: (0,)))
        args.append(jnp.asarray(traced_window, jnp.int32).reshape(1))
    return in_specs, args


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           positions: jax.Array, seq_ids: jax.Array, query_start_loc: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array, *, scale: float,
                           window: int | jax.Array | None = None, alibi_slopes: jax.Array | None = None,
                           softcap: float | None = None, sinks: jax.Array | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           tree: jax.Array | None = None, block_q: int | None = None,
                           pages_per_compute_block: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = 2,
                           num_kv_splits: int = 1, interpret: bool | None = None) -> jax.Array:
    """Ragged paged attention of a step's chunks: q [T, H, D] -> [T, H, D].

    Sequence s owns tokens [query_start_loc[s], query_start_loc[s+1]) of q (contiguous; each at
    its absolute positions[t]) and attends to its cache through block_tables[s] (this step's K/V
    already written), up to context_lens[s]. Decode tokens are chunks of length 1. seq_ids is
    accepted for interface parity with the metadata (the kernel takes each tile's sequence from
    query_start_loc; they must agree). Tokens outside every chunk output 0. tree [T, 3] int32:
    Medusa's tree mask (module docstring; None: none). window: an int (part of the program) or an
    int32 scalar array (an input: a pipeline stage's layers whose windows differ between stages;
    2^30 means none), or None.
    block_q: query tokens per tile (default: 64 // Gp, at least 16); pages_per_compute_block:
    pages per KV tile (default: about 64 tokens). num_kv_splits: S >= 1 programs share each tile's
    compute blocks, their partial softmaxes merged after the kernel (split-KV, module docstring; 1:
    the unsplit program). interpret=None means "interpret on CPU".
    """
    del seq_ids
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, (int, np.integer)) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be an int >= 1, got {num_kv_splits!r}")
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
    traced_window = None
    if isinstance(window, (jax.Array, np.ndarray)):
        traced_window, window = window, None
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_softcap(softcap)
    check_sinks(sinks, h)
    if tree is not None and tree.shape != (t, 3):
        raise ValueError(f"tree needs (slot, first node slot, ancestor bits) per token of q, shape ({t}, 3), "
                         f"got {tuple(tree.shape)}")
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
                        context_lens, alibi_slopes, sinks, k_scale, v_scale,
                        None if tree is None else jnp.asarray(tree, jnp.int32), traced_window,
                        scale=float(scale),
                        window=window, softcap=None if softcap is None else float(softcap),
                        block_q=block_q, pages_per_compute_block=ppcb,
                        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                        num_kv_splits=int(num_kv_splits))


def dequantize_pages(pages: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """int8 pages * per-token scale (in f32) -> dtype; float pages pass through."""
    if scales is None:
        return pages
    return (pages.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


def paged_reference_core(q, k_pages, v_pages, positions, seq_ids, block_tables, context_lens, *,
                         scale, window=None, alibi_slopes=None, softcap=None, sinks=None, k_scale=None,
                         v_scale=None, tree=None):
    """Each token gathers its sequence's pages in logical order and attends (O(T * max_len));
    tree [T, 3] or None: the tree mask (slots for positions, tree_visible on top)."""
    hkv, _, bs, d = k_pages.shape
    s, mb = block_tables.shape
    k = dequantize_pages(k_pages, k_scale, q.dtype)[:, block_tables].reshape(hkv, s, mb * bs, d)
    v = dequantize_pages(v_pages, v_scale, q.dtype)[:, block_tables].reshape(hkv, s, mb * bs, d)
    k_pos = jnp.arange(mb * bs, dtype=jnp.int32)
    in_ctx = k_pos[None, :] < context_lens.astype(jnp.int32)[seq_ids][:, None]
    if tree is not None:
        positions = tree[:, 0]
        in_ctx &= tree_visible(k_pos[None, :], tree[:, 1:2], tree[:, 2:3])
    return masked_softmax_attention(q, k[:, seq_ids], v[:, seq_ids], positions.astype(jnp.int32),
                                    k_pos, in_ctx, scale=scale, window=window,
                                    alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def ragged_paged_attention_reference(q, k_pages, v_pages, positions, seq_ids, query_start_loc,
                                     block_tables, context_lens, *, scale, window=None,
                                     alibi_slopes=None, softcap=None, sinks=None, k_scale=None, v_scale=None,
                                     tree=None):
    """Gather-based reference of ragged_paged_attention (tokens outside every chunk -> 0)."""
    out = paged_reference_core(q, k_pages, v_pages, positions, seq_ids, block_tables,
                               context_lens, scale=scale, window=window,
                               alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, k_scale=k_scale,
                               v_scale=v_scale, tree=None if tree is None else jnp.asarray(tree, jnp.int32))
    tok = jnp.arange(q.shape[0], dtype=jnp.int32)
    covered = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    return jnp.where(covered[:, None, None], out, 0).astype(q.dtype)
