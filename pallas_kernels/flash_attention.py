"""Flash attention over one contiguous sequence (prefill, full forward) and its pure-jnp reference.

Pallas, Triton-style (pass interpret=True, the default on CPU, to run it anywhere); imports jax
only. Masking, soft-capping, ALiBi, attention sinks and GQA follow
pallas_kernels/attention_common.py, whose tile math it shares with the serving kernel
(pallas_kernels/ragged_paged_attention.py).

flash_attention: grid (cdiv(T, block_q), Hkv). Query tile i (block_q tokens x Gp heads of one kv
head) loops over KV tiles of block_k tokens, only those that can be visible:
[max(0, i*block_q - W + 1) // block_k, cdiv(min(T, (i+1)*block_q), block_k)) when causal. Partial
tiles use masked loads and stores.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .attention_common import (MIN_DOT_ROWS, attend_block, check_sinks, check_softcap, check_triton_shapes,
                               compiler_params, group_queries, group_slopes, head_rows, init_carry,
                               masked_softmax_attention, next_pow2, normalize, resolve_interpret, tile_rows,
                               ungroup_output)


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
    q_pos = tile_rows(tok, gp)
    row_ok = tile_rows(tok_ok, gp)
    slopes = head_rows(al_ref, block_q, gp)

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

    init = init_carry(block_q * gp, d, head_rows(sk_ref, block_q, gp))
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
