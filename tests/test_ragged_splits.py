"""Split-KV ("flash-decoding") in the Pallas ragged paged attention kernel (num_kv_splits = S > 1:
S programs share each query tile's compute blocks; their partial softmaxes are merged in jnp after
the kernel) against ragged_paged_attention_reference, in interpret mode on CPU (compiled on a GPU
under `make test-gpu`).

The split changes only the order of the float32 accumulation (S partial sums merged by rescaling
instead of one running sum), so the tolerance is the unsplit kernel's: tests/precision.attention_rtol.
With 8-key compute blocks and S in {2, 3, 4}, the steps hold contexts shorter than S compute blocks
(splits with nothing to do), exactly S blocks, and longer ones whose ceil(n / S) shares leave the
last split short or empty; beside decode rows they hold prefill chunks over several query tiles, a
first chunk and bucket padding. Attention sinks must count once per row (the combine adds them, the
splits do not), also for a row that sees no key (output 0). S = 1 is the unsplit program (lowered
text), and the split kernel lowers for Triton from CPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import attention
from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, LayerKV
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from tests.precision import attention_rtol, rel_err
from tests.test_kernels_attention import make_ragged, np_paged, seed, slopes_for
from tests.test_tree_attention_pallas import _kernel_args, np_tree_attention, tree_step

pytestmark = pytest.mark.device

BS, D, HKV = 8, 16, 2          # 8-token pages, one page per compute block (ppcb = 1)


def split_step(rng, s: int, *, g: int, dtype, quant, n_pad: int = 2):
    """Decode rows at contexts below, at and above S compute blocks, a prefill chunk over cached
    tokens spanning 3 query tiles (block_q 4), a first chunk, then padding."""
    blk = BS
    chunks = [(s * blk - 1, 1),           # S blocks exactly: one each
              (blk - 4, 1),               # one block: S - 1 empty splits
              (3 * s * blk + 5, 1),       # 3S + 1 blocks: ceil shares, the last split short
              (2 * blk + 3, 10),          # a chunk over 2 blocks of cache: 3 tiles
              (0, 6)]                     # a first chunk
    return make_ragged(rng, chunks=chunks, n_pad=n_pad, hkv=HKV, g=g, d=D, bs=BS, dtype=jnp.dtype(dtype),
                       quant=quant), max(p + n for p, n in chunks)


# (S, dtype, G, KV format, window, ALiBi, soft cap, sinks)
CASES = [
    (2, "float32", 2, False, None, False, None, False),
    (3, "float32", 4, "int8", 11, True, None, True),
    (4, "float32", 1, False, None, False, 2.0, True),
    (4, "bfloat16", 2, "int8", None, True, 2.0, False),
    (3, "bfloat16", 4, False, 13, False, None, True),
    (2, "bfloat16", 2, "fp8", None, False, None, True),
]


@pytest.mark.parametrize("s,dtype,g,quant,window,alibi,softcap,sinks", CASES)
def test_splits_equal_reference(s, dtype, g, quant, window, alibi, softcap, sinks):
    rng = np.random.default_rng(seed("splits", s, dtype, g, quant, window, alibi, softcap, sinks))
    (q, k, v, ks, vs, meta), keys = split_step(rng, s, g=g, dtype=dtype, quant=quant)
    h = HKV * g
    kw = dict(scale=D ** -0.5, window=window, softcap=softcap, k_scale=ks, v_scale=vs,
              alibi_slopes=slopes_for(rng, h) if alibi else None,
              sinks=jnp.asarray(rng.uniform(0.5, 2.5, h), jnp.float32) if sinks else None)
    out = ragged_paged_attention(q, k, v, **meta, block_q=4, pages_per_compute_block=1, num_kv_splits=s, **kw)
    ref = ragged_paged_attention_reference(q, k, v, **meta, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = attention_rtol(dtype, keys=keys, head_dim=D)
    assert rel_err(out, ref) < tol
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0         # padding tokens -> 0
    if sinks:         # the sinks weigh in the case: one counted twice (or never) would show
        no_sink = ragged_paged_attention_reference(q, k, v, **meta, **{**kw, "sinks": None})
        assert rel_err(no_sink, ref) > 10 * tol


@pytest.mark.parametrize("sinks", [False, True])
def test_split_row_that_sees_nothing_outputs_zero(sinks):
    """A decode row whose sequence has no key in the cache (context_len 0) outputs 0 in every split
    and after the combine, with or without a sink; the other rows match float64 numpy."""
    rng = np.random.default_rng(seed("nothing", sinks))
    (q, k, v, _, _, meta), keys = split_step(rng, 3, g=2, dtype="float32", quant=False)
    meta["context_lens"] = meta["context_lens"].at[1].set(0)                   # row 1: the token at qsl[1]
    sk = jnp.asarray(rng.uniform(0.5, 2.5, 2 * HKV), jnp.float32) if sinks else None
    out = ragged_paged_attention(q, k, v, **meta, scale=0.25, sinks=sk, block_q=4, pages_per_compute_block=1,
                                 num_kv_splits=3)
    t = q.shape[0]
    want = np_paged(q, k, v, meta["positions"], meta["seq_ids"], meta["block_tables"], meta["context_lens"],
                    scale=0.25, sinks=sk, covered=np.arange(t) < t - 2)
    assert float(jnp.abs(out[1]).max()) == 0.0 and np.abs(want[1]).max() == 0.0
    assert rel_err(out, want) < attention_rtol("float32", keys=keys, head_dim=D)


@pytest.mark.parametrize("dtype,window", [("float32", 11), ("bfloat16", 2**30)])
def test_splits_traced_window(dtype, window):
    """A pipeline stage's window (an int32 input of the step; 2^30: none) with splits."""
    rng = np.random.default_rng(seed("splits traced window", dtype, window))
    (q, k, v, _, _, meta), keys = split_step(rng, 3, g=2, dtype=dtype, quant=False)
    run = jax.jit(lambda q, w: ragged_paged_attention(q, k, v, **meta, scale=D ** -0.5, window=w, block_q=4,
                                                      pages_per_compute_block=1, num_kv_splits=3))
    ref = ragged_paged_attention_reference(q, k, v, **meta, scale=D ** -0.5, window=None if window >= 2**30 else window)
    assert rel_err(run(q, jnp.int32(window)), ref) < attention_rtol(dtype, keys=keys, head_dim=D)


@pytest.mark.parametrize("s,dtype,quant", [(2, "float32", False), (4, "bfloat16", "int8")])
def test_splits_tree(s, dtype, quant):
    """Medusa's tree rows (a root and 9 / 20 nodes over several blocks) beside plain rows, split."""
    rng = np.random.default_rng(seed("splits tree", s, dtype, quant))
    rows = [(2 * BS + 3, 6, 0), (3 * BS + 1, 1, 0), (BS + 5, 0, 9), (2 * BS - 3, 2, 20)]
    q, (k, v, ks, vs), meta, positions, sees = tree_step(rng, rows, bs=BS, hkv=HKV, g=2, d=D,
                                                         dtype=jnp.dtype(dtype), quant=quant)
    args = _kernel_args(meta, positions)
    out = ragged_paged_attention(q, k, v, **args, scale=D ** -0.5, k_scale=ks, v_scale=vs,
                                 tree=jnp.asarray(meta.tree), block_q=4, pages_per_compute_block=1, num_kv_splits=s)
    ref = ragged_paged_attention_reference(q, k, v, **args, scale=D ** -0.5, k_scale=ks, v_scale=vs, tree=meta.tree)
    want = np_tree_attention(q, (k, v, ks, vs), meta, sees, scale=D ** -0.5)
    tol = attention_rtol(dtype, keys=int(meta.context_lens.max()), head_dim=D)
    assert rel_err(out, ref) < tol and rel_err(out, want) < tol


def test_attention_entry_passes_kv_splits():
    """jaxinfer.attention(impl="pallas", kv_splits=S) runs the split kernel (same numbers)."""
    rng = np.random.default_rng(seed("entry"))
    (q, k, v, _, _, meta), keys = split_step(rng, 2, g=2, dtype="float32", quant=False)
    t = q.shape[0]
    md = AttentionMetadata(seq_ids=meta["seq_ids"], slot_mapping=jnp.full((t,), PAD_SLOT, jnp.int32),
                           block_tables=meta["block_tables"], context_lens=meta["context_lens"],
                           query_start_loc=meta["query_start_loc"])
    new_kv = jnp.zeros((t, HKV, D), jnp.float32)            # written to PAD_SLOT: dropped
    out, _ = attention(q, new_kv, new_kv, meta["positions"], scale=0.25, kv=LayerKV(k, v), meta=md,
                       impl="pallas", kv_splits=2)
    ref = ragged_paged_attention_reference(q, k, v, **meta, scale=0.25)
    assert rel_err(out, ref) < attention_rtol("float32", keys=keys, head_dim=D)


def test_one_split_is_the_same_program():
    """num_kv_splits=1 is the unsplit kernel: the same lowered program as a call without it (the
    lowered text of each, sinks in the kernel); S = 2 is another program; S < 1 is refused by name."""
    rng = np.random.default_rng(7)
    (q, k, v, _, _, meta), _ = split_step(rng, 2, g=2, dtype="float32", quant=False)
    sinks = jnp.ones((2 * HKV,), jnp.float32)

    def lowered(**kw):
        fn = lambda q, k, v: ragged_paged_attention(q, k, v, **meta, scale=0.25, sinks=sinks, block_q=4, **kw)  # noqa: E731
        return jax.jit(fn).lower(q, k, v).as_text()
    plain = lowered()
    assert lowered(num_kv_splits=1) == plain and "splits" not in plain
    assert lowered(num_kv_splits=2) != plain     # (its Triton kernel is named for it: the lowering test)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="num_kv_splits"):
            ragged_paged_attention(q, k, v, **meta, scale=0.25, num_kv_splits=bad)


def test_splits_lower_for_triton():
    """The split kernel (partials' masked stores, the third grid axis) lowers for the Triton GPU
    backend with every option on, a traced window and a tree (no GPU needed to lower)."""
    hkv, g, d, bs, nb, s, t = 2, 4, 64, 16, 24, 3, 40
    q = jnp.zeros((t, hkv * g, d), jnp.bfloat16)
    pages = jnp.zeros((hkv, nb, bs, d), jnp.int8)
    scales = jnp.ones((hkv, nb, bs), jnp.float32)
    bt, lens, ids = jnp.zeros((s, 6), jnp.int32), jnp.zeros((s,), jnp.int32), jnp.zeros((t,), jnp.int32)
    common = dict(scale=0.125, alibi_slopes=jnp.ones((hkv * g,)), softcap=30.0, sinks=jnp.zeros((hkv * g,)),
                  k_scale=scales, v_scale=scales, num_kv_splits=4, interpret=False)

    def text(static: dict, traced: dict) -> str:       # traced: the step's arrays among the arguments
        fn = lambda q, kp, vp, extra: ragged_paged_attention(  # noqa: E731
            q, kp, vp, ids, ids, jnp.zeros((s + 1,), jnp.int32), bt, lens, **common, **static, **extra)
        return jax.jit(fn).trace(q, pages, pages, traced).lower(lowering_platforms=("cuda",)).as_text()
    for static, traced in (({"window": 32}, {}), ({}, {"window": jnp.int32(32)}),
                           ({}, {"tree": jnp.zeros((t, 3), jnp.int32)})):
        lowered = text(static, traced)
        assert "triton" in lowered and "_splits4" in lowered
