"""Pallas attention kernels (pallas_kernels/) against their jnp references and a float64 numpy
implementation of the masking definition, in interpret mode on CPU (the kernels' default there).

Definition (numpy below): a query token at position p of sequence s sees cache position l iff
l <= p, l < context_len[s] and, with a window W, p - W < l; a soft cap C maps each scaled score s
to C tanh(s / C) (Gemma 2); ALiBi adds slope_h * (l - p); int8
pages dequantize to int8 (or fp8 e4m3) * scale; softmax over the visible keys and, with attention
sinks (gpt-oss), one more logit sink_h of value 0; nothing visible -> 0.
Tolerance: max|a - b| / max|b| below tests/precision.attention_rtol(dtype, keys, head_dim), derived
from float32 / bfloat16 rounding (float32 dots run at float32 precision on every backend: no TF32).
On CPU the kernels run in Pallas interpret mode; on a GPU (`make test-gpu`) they run compiled.

Shapes are small (interpret mode is slow) but every tiled dimension has >= 3 tiles: query tiles,
KV compute blocks and sequences.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.attention_common import default_interpret
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention, ragged_paged_attention_reference,
                                                   ragged_tile_table)

from tests.precision import attention_rtol, rel_err

pytestmark = pytest.mark.device


def seed(*params) -> int:
    """A per-case seed that does not depend on PYTHONHASHSEED."""
    return zlib.crc32(repr(params).encode())


def f64(x):
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ----------------------------------------------------------------------------------------------
# Independent numpy implementation of the definition (float64, loops)
# ----------------------------------------------------------------------------------------------

def np_attend(qv, keys, vals, k_pos, p, *, scale, window, slope, softcap=None, sink=None):
    """qv [D], keys/vals [L, D], k_pos [L] (already restricted to l < context_len); sink: the head's
    sink logit (its e^sink joins the denominator) or None."""
    vis = k_pos <= p if p is not None else np.ones(len(k_pos), bool)
    if window is not None:
        vis &= k_pos > (p if p is not None else 0) - window
    if not vis.any():
        return np.zeros(qv.shape[0])
    sc = keys[vis] @ qv * scale
    if softcap is not None:
        sc = softcap * np.tanh(sc / softcap)
    if slope is not None:
        sc = sc + slope * (k_pos[vis] - p)
    top = sc.max() if sink is None else max(sc.max(), sink)
    w = np.exp(sc - top)
    return (w / (w.sum() + (0.0 if sink is None else np.exp(sink - top)))) @ vals[vis]


def np_paged(q, k_pages, v_pages, positions, seq_ids, block_tables, context_lens, *, scale,
             window=None, slopes=None, k_scale=None, v_scale=None, covered=None, softcap=None, sinks=None):
    q, slopes, sinks = f64(q), f64(slopes), f64(sinks)
    kf = f64(k_pages) if k_scale is None else f64(k_pages) * f64(k_scale)[..., None]
    vf = f64(v_pages) if v_scale is None else f64(v_pages) * f64(v_scale)[..., None]
    t_, h_, d = q.shape
    hkv, _, bs, _ = kf.shape
    g = h_ // hkv
    bt, lens = np.asarray(block_tables), np.asarray(context_lens)
    out = np.zeros((t_, h_, d))
    for t in range(t_):
        if covered is not None and not covered[t]:
            continue
        s, p = int(seq_ids[t]), int(positions[t])
        ls = np.arange(int(lens[s]))
        phys, off = bt[s, ls // bs], ls % bs
        for h in range(h_):
            out[t, h] = np_attend(q[t, h], kf[h // g, phys, off], vf[h // g, phys, off], ls, p,
                                  scale=scale, window=window, softcap=softcap,
                                  slope=None if slopes is None else slopes[h],
                                  sink=None if sinks is None else sinks[h])
    return out


def np_dense(q, k, v, *, scale, causal, window=None, slopes=None, softcap=None, sinks=None):
    q, k, v, slopes, sinks = f64(q), f64(k), f64(v), f64(slopes), f64(sinks)
    t_, h_, d = q.shape
    g = h_ // k.shape[1]
    out = np.zeros((t_, h_, d))
    ls = np.arange(t_)
    for t in range(t_):
        for h in range(h_):
            if causal:
                out[t, h] = np_attend(q[t, h], k[:, h // g], v[:, h // g], ls, t, scale=scale,
                                      window=window, softcap=softcap,
                                      slope=None if slopes is None else slopes[h],
                                      sink=None if sinks is None else sinks[h])
            else:  # no l <= p; the window still bounds l from below, ALiBi still adds slope*(l-p)
                vis = ls > t - window if window is not None else np.ones(t_, bool)
                sc = k[vis, h // g] @ q[t, h] * scale
                if slopes is not None:
                    sc = sc + slopes[h] * (ls[vis] - t)
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ v[vis, h // g]
    return out


# ----------------------------------------------------------------------------------------------
# Problem builders
# ----------------------------------------------------------------------------------------------

def make_cache(rng, *, ctx_lens, hkv, d, bs, dtype, quant, spare_blocks=3, extra_cols=1):
    """Pages with shuffled physical blocks; the null block 0 and spare blocks hold large garbage
    so any unmasked read of them shows. Returns (k, v, k_scale, v_scale, block_tables)."""
    nblk = [-(-c // bs) for c in ctx_lens]
    max_blocks = max(nblk) + extra_cols
    nb = 1 + sum(nblk) + spare_blocks
    phys = rng.permutation(np.arange(1, nb))
    bt = np.zeros((len(ctx_lens), max_blocks), np.int32)
    i = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = phys[i:i + n]
        i += n
    used = np.zeros(nb, bool)
    used[bt[bt > 0]] = True
    shape = (hkv, nb, bs, d)
    if quant == "fp8":     # e4m3 values over its whole range (max 448), subnormals included
        k, v = (np.clip(rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2.4, shape), -448, 448)
                .astype(jnp.float8_e4m3fn) for _ in range(2))
    elif quant:
        k = rng.integers(-127, 128, shape).astype(np.int8)
        v = rng.integers(-127, 128, shape).astype(np.int8)
    if quant:
        ks = rng.uniform(0.004, 0.03, shape[:3]).astype(np.float32)
        vs = rng.uniform(0.004, 0.03, shape[:3]).astype(np.float32)
        k[:, ~used], v[:, ~used] = 127, -127      # (fp8 rounds them to 128 and -128)
        ks[:, ~used], vs[:, ~used] = 3.0, 3.0
        return (jnp.asarray(k), jnp.asarray(v), jnp.asarray(ks), jnp.asarray(vs), jnp.asarray(bt))
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, ~used], v[:, ~used] = 40.0, -40.0
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), None, None, jnp.asarray(bt))


def make_ragged(rng, *, chunks, n_pad, hkv, g, d, bs, dtype, quant):
    """chunks: [(prior_context, new_tokens)] per sequence (new_tokens == 1: a decode token)."""
    ctx = [p + n for p, n in chunks]
    k, v, ks, vs, bt = make_cache(rng, ctx_lens=ctx, hkv=hkv, d=d, bs=bs, dtype=dtype, quant=quant)
    pos, sid, qsl = [], [], [0]
    for s, (p, n) in enumerate(chunks):
        pos += range(p, p + n)
        sid += [s] * n
        qsl.append(qsl[-1] + n)
    pos += [0] * n_pad          # bucket padding: outside every chunk
    sid += [0] * n_pad
    t = len(pos)
    q = jnp.asarray(rng.standard_normal((t, hkv * g, d)), dtype)
    meta = dict(positions=jnp.asarray(pos, jnp.int32), seq_ids=jnp.asarray(sid, jnp.int32),
                query_start_loc=jnp.asarray(qsl, jnp.int32), block_tables=bt,
                context_lens=jnp.asarray(ctx, jnp.int32))
    return q, k, v, ks, vs, meta


def slopes_for(rng, h):
    return jnp.asarray(rng.uniform(0.01, 0.15, h), jnp.float32)


# ----------------------------------------------------------------------------------------------
# The serving kernel: ragged_paged_attention (prefill chunks and decode tokens in one call)
# ----------------------------------------------------------------------------------------------

# (dtype, block_size, G, window, alibi, int8, block_q, pages_per_compute_block, check_numpy)
RAGGED_CASES = [
    ("float32", 8, 1, None, False, False, 8, 1, True),
    ("float32", 16, 4, 24, True, False, 4, 1, True),
    ("float32", 32, 8, None, False, True, 4, 1, True),
    ("float32", 8, 3, 11, True, True, 8, 2, True),
    ("bfloat16", 16, 4, 40, True, True, 8, 1, True),
    ("bfloat16", 8, 8, None, False, False, 8, 2, False),
    ("bfloat16", 32, 1, 50, False, False, 16, 1, False),
    ("bfloat16", 8, 4, None, True, "fp8", 8, 1, True),
]


@pytest.mark.parametrize("dtype,bs,g,window,alibi,quant,bq,ppcb,check_np", RAGGED_CASES)
def test_ragged_paged(dtype, bs, g, window, alibi, quant, bq, ppcb, check_np):
    rng = np.random.default_rng(seed(dtype, bs, g, window, alibi, quant, bq))
    hkv, d = 2, 16 if g >= 4 else 32
    blk = bs * ppcb
    # A mixed step: prefill chunks with prior context (>= 3 query tiles, >= 3 KV blocks), a
    # first chunk with no prior context, decode tokens, then bucket padding.
    chunks = [(2 * blk + 3, 3 * bq + 2), (3 * blk + 1, 1), (0, 3 * bq - 1), (blk - 2, 1),
              (blk + 5, bq + 1), (4, 1)]
    q, k, v, ks, vs, meta = make_ragged(rng, chunks=chunks, n_pad=3, hkv=hkv, g=g, d=d, bs=bs,
                                        dtype=jnp.dtype(dtype), quant=quant)
    kw = dict(scale=d ** -0.5, window=window, k_scale=ks, v_scale=vs,
              alibi_slopes=slopes_for(rng, hkv * g) if alibi else None)
    out = ragged_paged_attention(q, k, v, **meta, block_q=bq, pages_per_compute_block=ppcb, **kw)
    ref = ragged_paged_attention_reference(q, k, v, **meta, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = attention_rtol(dtype, keys=max(p + n for p, n in chunks), head_dim=d)
    assert rel_err(out, ref) < tol
    assert float(jnp.abs(out[-3:].astype(jnp.float32)).max()) == 0.0    # padding tokens -> 0
    if check_np:
        t = q.shape[0]
        want = np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"],
                        meta["context_lens"], scale=d ** -0.5, window=window,
                        slopes=kw["alibi_slopes"], k_scale=ks, v_scale=vs,
                        covered=np.arange(t) < t - 3)
        assert rel_err(ref, want) < tol
        assert rel_err(out, want) < tol


@pytest.mark.parametrize("quant", [True, "fp8"])
def test_ragged_float16_with_small_v_scales(quant):
    """float16 queries over int8 / fp8 pages whose V scales are small (V of magnitude ~1e-5, as real
    activations can be): attention is linear in V, so the error relative to the output stays within
    float16's bound. The kernel rounded p * v_scale to float16 for the PV dot, which fell into
    float16's subnormals (a fixed step of 6e-8), and the error grew as V shrank: 2.7e-3 to 1.8e-2."""
    rng = np.random.default_rng(seed("f16-small-v", quant))
    hkv, g, d, bs = 1, 2, 32, 16
    chunks = [(200, 1), (150, 4), (0, 5)]
    q, k, v, ks, vs, meta = make_ragged(rng, chunks=chunks, n_pad=2, hkv=hkv, g=g, d=d, bs=bs,
                                        dtype=jnp.dtype("float16"), quant=quant)
    vs = jnp.where(vs == 3.0, vs, vs * 1e-4)          # the visible keys' V scales only (pages past them keep 3.0)
    kw = dict(scale=d ** -0.5, k_scale=ks, v_scale=vs)
    out = ragged_paged_attention(q, k, v, **meta, block_q=8, **kw)
    t = q.shape[0]
    want = np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"],
                    covered=np.arange(t) < t - 2, **kw)
    assert rel_err(out[:t - 2], want[:t - 2]) < attention_rtol("float16", keys=204, head_dim=d)


@pytest.mark.parametrize("dtype,window", [("float32", 11), ("float32", 2**30), ("bfloat16", 7)])
def test_ragged_traced_window(dtype, window):
    """A window that is a value of the step (a pipeline stage's layer whose window differs between
    stages: an int32 scalar, 2^30 for none) masks as the same window fixed in the program."""
    rng = np.random.default_rng(seed("traced window", dtype, window))
    hkv, g, d, bs = 2, 4, 16, 8
    chunks = [(21, 9), (5, 1), (0, 12), (40, 3)]
    q, k, v, _, _, meta = make_ragged(rng, chunks=chunks, n_pad=2, hkv=hkv, g=g, d=d, bs=bs,
                                      dtype=jnp.dtype(dtype), quant=False)
    run = jax.jit(lambda q, w: ragged_paged_attention(q, k, v, **meta, scale=d ** -0.5, window=w, block_q=4,
                                                      pages_per_compute_block=1))
    out = run(q, jnp.int32(window))
    static = None if window >= 2**30 else window
    ref = ragged_paged_attention_reference(q, k, v, **meta, scale=d ** -0.5, window=static)
    want = np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"],
                    scale=d ** -0.5, window=static, covered=np.arange(q.shape[0]) < q.shape[0] - 2)
    tol = attention_rtol(dtype, keys=max(p + n for p, n in chunks), head_dim=d)
    assert rel_err(out, ref) < tol and rel_err(out, want) < tol
    if static is not None:        # the window cut keys: the case tests it
        assert rel_err(np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"],
                                meta["context_lens"], scale=d ** -0.5), want) > 10 * tol


@pytest.mark.parametrize("bq", [1, 4, 16])
def test_ragged_tile_table_partitions_tokens(bq):
    """Tiles cover every chunk token exactly once, never straddle sequences, fit in the grid."""
    lens = np.array([5, 0, 1, 17, 4, 1, 32])
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(qsl[-1]) + 2
    info = np.asarray(ragged_tile_table(jnp.asarray(qsl), jnp.arange(7, dtype=jnp.int32), t, bq))
    seen = np.zeros(t, int)
    for seq, start, n, ctx in info:
        assert 0 <= n <= bq and ctx == seq
        if n:
            assert qsl[seq] <= start and start + n <= qsl[seq + 1]
            seen[start:start + n] += 1
    assert (seen[:qsl[-1]] == 1).all() and (seen[qsl[-1]:] == 0).all()


# ----------------------------------------------------------------------------------------------
# One sequence: flash_attention
# ----------------------------------------------------------------------------------------------

# (dtype, T, G, causal, window, alibi, block_q, block_k, check_numpy)
FLASH_CASES = [
    ("float32", 50, 1, True, None, False, 16, 16, True),
    ("float32", 45, 4, True, 13, True, 8, 16, True),
    ("float32", 40, 8, False, None, False, 8, 8, True),
    ("float32", 37, 3, False, None, True, 8, 8, True),
    ("bfloat16", 64, 4, True, 20, False, 16, 8, True),
    ("bfloat16", 33, 8, True, None, True, 8, 8, False),
]


@pytest.mark.parametrize("dtype,t,g,causal,window,alibi,bq,bk,check_np", FLASH_CASES)
def test_flash(dtype, t, g, causal, window, alibi, bq, bk, check_np):
    rng = np.random.default_rng(seed(dtype, t, g, causal, window, alibi))
    hkv, d = 2, 16 if g >= 4 else 32
    q = jnp.asarray(rng.standard_normal((t, hkv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    kw = dict(scale=d ** -0.5, causal=causal, window=window,
              alibi_slopes=slopes_for(rng, hkv * g) if alibi else None)
    out = flash_attention(q, k, v, block_q=bq, block_k=bk, **kw)
    ref = flash_attention_reference(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = attention_rtol(dtype, keys=t, head_dim=d)
    assert rel_err(out, ref) < tol
    if check_np:
        want = np_dense(q, k, v, scale=d ** -0.5, causal=causal, window=window,
                        slopes=kw["alibi_slopes"])
        assert rel_err(ref, want) < tol
        assert rel_err(out, want) < tol


# ----------------------------------------------------------------------------------------------
# Soft-capped scores (Gemma 2) in each kernel
# ----------------------------------------------------------------------------------------------

# (kernel, dtype, G, window, quant): q scaled by 3 so that scores reach ~10 and a cap of 2 bends them
SOFTCAP_CASES = [("ragged", "float32", 4, 11, False), ("ragged", "float32", 1, None, "fp8"),
                 ("flash", "float32", 2, 13, False), ("flash", "bfloat16", 4, None, False)]


@pytest.mark.parametrize("kernel,dtype,g,window,quant", SOFTCAP_CASES)
def test_softcap_matches_definition(kernel, dtype, g, window, quant):
    rng = np.random.default_rng(seed("softcap", kernel, dtype, g, window, quant))
    hkv, d, bs, cap = 2, 16, 8, 2.0
    kw = dict(scale=d ** -0.5, window=window, softcap=cap)
    if kernel == "flash":
        t = 41
        q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)) * f, dtype)
                   for h, f in ((hkv * g, 3), (hkv, 1), (hkv, 1)))
        out, ref = flash_attention(q, k, v, block_q=8, block_k=8, **kw), flash_attention_reference(q, k, v, **kw)
        want = np_dense(q, k, v, scale=d ** -0.5, causal=True, window=window, softcap=cap)
        keys = t
    else:
        chunks = [(21, 9), (5, 1), (0, 12), (40, 3)]
        q, k, v, ks, vs, meta = make_ragged(rng, chunks=chunks, n_pad=0, hkv=hkv, g=g, d=d, bs=bs,
                                            dtype=jnp.dtype(dtype), quant=quant)
        q = q * 3
        kw.update(k_scale=ks, v_scale=vs)
        out = ragged_paged_attention(q, k, v, **meta, block_q=4, pages_per_compute_block=1, **kw)
        ref = ragged_paged_attention_reference(q, k, v, **meta, **kw)
        want = np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"],
                        scale=d ** -0.5, window=window, k_scale=ks, v_scale=vs, softcap=cap)
        keys = max(p + n for p, n in chunks)
    tol = attention_rtol(dtype, keys=keys, head_dim=d)
    assert rel_err(out, ref) < tol and rel_err(ref, want) < tol and rel_err(out, want) < tol
    uncapped = np_dense(q, k, v, scale=d ** -0.5, causal=True, window=window) if kernel == "flash" else np_paged(
        q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"], scale=d ** -0.5,
        window=window, k_scale=ks, v_scale=vs)
    assert rel_err(uncapped, want) > 100 * tol            # the cap changed the result: the case tests it


# (kernel, dtype, G, window, quant): sinks as large as the scores (std 2), so they matter
SINK_CASES = [("ragged", "float32", 4, 11, False), ("ragged", "float32", 1, None, "fp8"),
              ("ragged", "bfloat16", 8, None, False), ("flash", "float32", 2, 13, False),
              ("flash", "bfloat16", 4, None, False)]


@pytest.mark.parametrize("kernel,dtype,g,window,quant", SINK_CASES)
def test_sinks_match_definition(kernel, dtype, g, window, quant):
    """gpt-oss's attention sinks in both kernels and their references against the numpy definition."""
    rng = np.random.default_rng(seed("sinks", kernel, dtype, g, window, quant))
    hkv, d, bs = 2, 16, 8
    sinks = jnp.asarray(rng.normal(0.0, 2.0, hkv * g), jnp.float32)
    kw = dict(scale=d ** -0.5, window=window, sinks=sinks)
    if kernel == "flash":
        t = 37
        q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), dtype) for h in (hkv * g, hkv, hkv))
        out, ref = flash_attention(q, k, v, block_q=8, block_k=8, **kw), flash_attention_reference(q, k, v, **kw)
        want = np_dense(q, k, v, scale=d ** -0.5, causal=True, window=window, sinks=sinks)
        plain = np_dense(q, k, v, scale=d ** -0.5, causal=True, window=window)
        keys = t
    else:
        chunks = [(21, 9), (5, 1), (0, 12), (40, 3)]
        q, k, v, ks, vs, meta = make_ragged(rng, chunks=chunks, n_pad=0, hkv=hkv, g=g, d=d, bs=bs,
                                            dtype=jnp.dtype(dtype), quant=quant)
        kw.update(k_scale=ks, v_scale=vs)
        out = ragged_paged_attention(q, k, v, **meta, block_q=4, pages_per_compute_block=1, **kw)
        ref = ragged_paged_attention_reference(q, k, v, **meta, **kw)
        args = (q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"])
        want = np_paged(*args, scale=d ** -0.5, window=window, k_scale=ks, v_scale=vs, sinks=sinks)
        plain = np_paged(*args, scale=d ** -0.5, window=window, k_scale=ks, v_scale=vs)
        keys = max(p + n for p, n in chunks)
    tol = attention_rtol(dtype, keys=keys, head_dim=d)
    assert rel_err(out, ref) < tol and rel_err(ref, want) < tol and rel_err(out, want) < tol
    assert rel_err(plain, want) > 10 * tol             # the sinks changed the result: the case tests them


def test_sinks_need_one_per_query_head():
    q = jnp.zeros((4, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="one logit per query head"):
        flash_attention(q, q[:, :2], q[:, :2], scale=0.25, sinks=jnp.zeros((2,)))


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_softcap_must_be_positive(bad):
    q = jnp.zeros((4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="softcap"):
        flash_attention(q, q, q, scale=0.25, softcap=bad)


# ----------------------------------------------------------------------------------------------
# The jnp references agree with jaxinfer's XLA attention (the semantics the engine uses)
# ----------------------------------------------------------------------------------------------

def test_references_match_jaxinfer_xla():
    from jaxinfer.attention import dense_causal_attention, paged_attention_reference
    from jaxinfer.kv_cache import AttentionMetadata, LayerKV

    rng = np.random.default_rng(11)
    slopes = slopes_for(rng, 8)
    q = jnp.asarray(rng.standard_normal((30, 8, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((30, 2, 16)), jnp.float32)
    pos = jnp.arange(30, dtype=jnp.int32)
    for window, al, cap in ((None, None, None), (9, slopes, None), (9, None, 1.5)):
        want = dense_causal_attention(q, k, k, pos, scale=0.3, window=window, alibi=al, softcap=cap)
        got = flash_attention_reference(q, k, k, scale=0.3, window=window, alibi_slopes=al, softcap=cap)
        assert rel_err(got, want) < attention_rtol("float32", keys=30, head_dim=16)

    q, kp, vp, _, _, meta = make_ragged(rng, chunks=[(20, 9), (5, 1), (0, 12)], n_pad=0, hkv=2,
                                        g=4, d=16, bs=8, dtype=jnp.float32, quant=False)
    md = AttentionMetadata(seq_ids=meta["seq_ids"], slot_mapping=meta["seq_ids"],
                           block_tables=meta["block_tables"], context_lens=meta["context_lens"],
                           query_start_loc=meta["query_start_loc"])
    for window, al, cap in ((None, None, None), (9, slopes, None), (9, None, 1.5)):
        want = paged_attention_reference(q, LayerKV(kp, vp), meta["positions"], md, scale=0.3,
                                   window=window, alibi=al, softcap=cap)
        got = ragged_paged_attention_reference(q, kp, vp, **meta, scale=0.3, window=window,
                                               alibi_slopes=al, softcap=cap)
        assert rel_err(got, want) < attention_rtol("float32", keys=21, head_dim=16)


# ----------------------------------------------------------------------------------------------
# Interpret default, and the kernels lower for the Triton GPU backend (no GPU needed to lower)
# ----------------------------------------------------------------------------------------------

def test_interpret_default():
    assert default_interpret() == (jax.default_backend() == "cpu")


def _lowers_for_triton(fn, *args) -> bool:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return "triton" in text


@pytest.mark.parametrize("kernel", ["ragged", "flash"])
def test_lowers_for_triton(kernel):
    hkv, g, d, bs, nb, s, t = 2, 4, 64, 16, 24, 3, 40
    q = jnp.zeros((t, hkv * g, d), jnp.bfloat16)
    pages = jnp.zeros((hkv, nb, bs, d), jnp.int8)
    scales = jnp.ones((hkv, nb, bs), jnp.float32)
    bt, lens = jnp.zeros((s, 6), jnp.int32), jnp.zeros((s,), jnp.int32)
    common = dict(scale=0.125, window=32, alibi_slopes=jnp.ones((hkv * g,)), softcap=30.0,
                  sinks=jnp.zeros((hkv * g,)), interpret=False)
    if kernel == "ragged":
        ids = jnp.zeros((t,), jnp.int32)
        fn = lambda q, kp, vp, ks, vs: ragged_paged_attention(
            q, kp, vp, ids, ids, jnp.zeros((s + 1,), jnp.int32), bt, lens, k_scale=ks, v_scale=vs,
            **common)
        assert _lowers_for_triton(fn, q, pages, pages, scales, scales)
        traced = lambda q, kp, vp, ks, vs, w: ragged_paged_attention(        # a pipeline stage's window
            q, kp, vp, ids, ids, jnp.zeros((s + 1,), jnp.int32), bt, lens, k_scale=ks, v_scale=vs,
            **{**common, "window": w})
        assert _lowers_for_triton(traced, q, pages, pages, scales, scales, jnp.int32(32))
    else:
        kv = jnp.zeros((t, hkv, d), jnp.bfloat16)
        fn = lambda q, k, v: flash_attention(q, k, v, **common)
        assert _lowers_for_triton(fn, q, kv, kv)


def test_lowers_for_triton_tiny_shapes():
    """Tiles too small for tl.dot (G = 1, T = 3, page size 8) are grown to 16 rows / keys on GPU
    (the kernel names carry the block sizes)."""
    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    q = jnp.zeros((3, 2, 16), jnp.float32)
    kv = jnp.zeros((3, 2, 16), jnp.float32)
    assert "flash_attention_bq16_bk16" in lowered(lambda q, k, v: flash_attention(
        q, k, v, scale=0.25, block_q=1, block_k=1, interpret=False), q, kv, kv)
    pages = jnp.zeros((2, 5, 8, 16), jnp.float32)
    bt, lens = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)
    ids = jnp.zeros((3,), jnp.int32)
    qsl = jnp.arange(4, dtype=jnp.int32)
    assert "ragged_paged_attention_bq16_ppcb2" in lowered(lambda q, kp, vp: ragged_paged_attention(
        q, kp, vp, ids, ids, qsl, bt, lens, scale=0.25, block_q=1, pages_per_compute_block=1,
        interpret=False), q, pages, pages)
