"""Medusa's tree mask in the Pallas ragged paged attention kernel (pallas_kernels/ragged_paged_attention.py,
interpret mode on CPU) against its jnp reference, the reference against jaxinfer's XLA paged attention
(paged_attention_xla: an independent implementation over the host's work items), and both against a
float64 numpy loop that derives what each node sees from its tree's parent links, not from the bitmask.

The steps mix what a Medusa engine's steps hold: prefill chunks, decode rows and tree-verification
rows (a root and N nodes of a random tree: node j's K/V at slot root + 1 + j, its position root +
depth(j)), one of them after two ordinary tokens of the same chunk, then bucket padding. Trees span
several query tiles and KV blocks. Tolerance: tests/precision.attention_rtol (float32 / bfloat16
rounding of the same definition).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import paged_attention_xla
from jaxinfer.kv_cache import TREE_NONE, AttentionMetadata, LayerKV, StepRow, build_attention_metadata
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from tests.precision import attention_rtol, rel_err
from tests.test_kernels_attention import f64, make_cache, np_attend, seed, slopes_for

pytestmark = pytest.mark.device


def random_tree(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent [N+1], depth [N+1]) of a random tree of n nodes under the root 0, each node's parent
    an earlier node (the slots of a Medusa row follow that order too)."""
    parent = np.full(n + 1, -1)
    depth = np.zeros(n + 1, np.int32)
    for j in range(1, n + 1):
        parent[j] = rng.integers(0, j)
        depth[j] = depth[parent[j]] + 1
    return parent, depth


def tree_bits(parent: np.ndarray) -> np.ndarray:
    """AttentionMetadata.tree's ancestor bits: bit j - 1 set for node j itself and each ancestor but
    the root (the root's bits: 0)."""
    bits = np.zeros(len(parent), np.int64)
    for j in range(1, len(parent)):
        a = j
        while a > 0:
            bits[j] |= 1 << (a - 1)
            a = parent[a]
    return bits.astype(np.int32)


def tree_step(rng, rows, *, bs, hkv, g, d, dtype, quant, n_pad=3):
    """rows: [(prior_context, plain_tokens, tree_nodes)] (tree_nodes 0: no tree). Returns q, pages
    (k, v, k_scale, v_scale), the step's numpy metadata with its work items and tree, positions, and
    per token the key slots it sees (None for padding) computed from the trees' parent links."""
    ctx = [p + n + (1 + m if m else 0) for p, n, m in rows]
    k, v, ks, vs, bt = make_cache(rng, ctx_lens=ctx, hkv=hkv, d=d, bs=bs, dtype=dtype, quant=quant)
    bt = np.asarray(bt)
    t = sum(c - p for c, (p, _, _) in zip(ctx, rows)) + n_pad
    meta = build_attention_metadata([StepRow(p, c - p, bt[i, : -(-c // bs)]) for i, (c, (p, _, _)) in
                                     enumerate(zip(ctx, rows))], bs, t, len(rows) + 1, bt.shape[1])
    tree = np.stack([np.zeros(t), np.full(t, TREE_NONE), np.zeros(t)], 1).astype(np.int32)
    positions, sees, cur = np.zeros(t, np.int32), [None] * t, 0
    for (p, n, m), c in zip(rows, ctx):
        for i in range(c - p):                                   # slots p .. c - 1, causal
            tree[cur + i, 0] = positions[cur + i] = p + i
            sees[cur + i] = np.arange(p + i + 1)
        if m:
            root = p + n                                         # the root's slot = its position
            parent, depth = random_tree(rng, m)
            r = cur + n
            tree[r: r + m + 1, 1] = root + 1
            tree[r: r + m + 1, 2] = tree_bits(parent)
            positions[r: r + m + 1] = root + depth
            sees[r] = np.arange(root + 1)
            for j in range(1, m + 1):                            # context, root, ancestors and itself
                path, a = [], j
                while a > 0:
                    path.append(root + a)
                    a = parent[a]
                sees[r + j] = np.concatenate([np.arange(root + 1), sorted(path)])
        cur += c - p
    meta.tree = tree
    q = jnp.asarray(rng.standard_normal((t, hkv * g, d)), dtype)
    return q, (k, v, ks, vs), meta, positions, sees


def np_tree_attention(q, pages, meta, sees, *, scale, window=None, slopes=None):
    """float64 loops: token t at slot l_t attends to the key slots `sees[t]` (its tree's nodes by
    parent links), the window and ALiBi measured in slots, as the tree mask defines them."""
    k, v, ks, vs = pages
    kf = f64(k) if ks is None else f64(k) * f64(ks)[..., None]
    vf = f64(v) if vs is None else f64(v) * f64(vs)[..., None]
    q, slopes = f64(q), f64(slopes)
    t_, h_, d = q.shape
    g = h_ // kf.shape[0]
    bs = kf.shape[2]
    out = np.zeros((t_, h_, d))
    for t in range(t_):
        if sees[t] is None:
            continue
        ls = sees[t]
        phys, off = meta.block_tables[meta.seq_ids[t], ls // bs], ls % bs
        for h in range(h_):
            out[t, h] = np_attend(q[t, h], kf[h // g, phys, off], vf[h // g, phys, off], ls, int(meta.tree[t, 0]),
                                  scale=scale, window=window, slope=None if slopes is None else slopes[h])
    return out


def _kernel_args(meta: AttentionMetadata, positions) -> dict:
    return dict(positions=jnp.asarray(positions), seq_ids=jnp.asarray(meta.seq_ids),
                query_start_loc=jnp.asarray(meta.query_start_loc), block_tables=jnp.asarray(meta.block_tables),
                context_lens=jnp.asarray(meta.context_lens))


# (dtype, block_size, G, KV format, block_q, pages_per_compute_block, window + ALiBi)
TREE_CASES = [
    ("float32", 8, 4, False, 4, 1, False),
    ("float32", 16, 1, "int8", 8, 2, False),
    ("float32", 8, 2, False, 8, 2, True),
    ("bfloat16", 8, 2, False, 8, 1, False),
    ("bfloat16", 8, 4, "int8", 4, 2, False),
    ("bfloat16", 16, 4, "fp8", 16, 1, False),
]


@pytest.mark.parametrize("dtype,bs,g,quant,bq,ppcb,masks", TREE_CASES)
def test_tree_kernel_equals_reference_xla_and_numpy(dtype, bs, g, quant, bq, ppcb, masks):
    rng = np.random.default_rng(seed("tree", dtype, bs, g, quant, bq, ppcb, masks))
    hkv, d = 2, 32 if g == 1 else 16
    rows = [(2 * bs + 3, 2 * bq + 2, 0), (3 * bs + 1, 1, 0), (bs + 5, 0, 9), (0, 5, 0), (2 * bs - 3, 2, 20),
            (4, 1, 0)]
    q, pages, meta, positions, sees = tree_step(rng, rows, bs=bs, hkv=hkv, g=g, d=d, dtype=jnp.dtype(dtype),
                                                quant=quant)
    k, v, ks, vs = pages
    # window and ALiBi are measured in slots under the tree mask (Medusa refuses both models; the
    # kernel and the references still agree on the definition)
    kw = dict(scale=d ** -0.5, window=13 if masks else None, alibi_slopes=slopes_for(rng, hkv * g) if masks else None)
    args = _kernel_args(meta, positions)
    out = ragged_paged_attention(q, k, v, **args, k_scale=ks, v_scale=vs, tree=jnp.asarray(meta.tree), block_q=bq,
                                 pages_per_compute_block=ppcb, **kw)
    ref = ragged_paged_attention_reference(q, k, v, **args, k_scale=ks, v_scale=vs, tree=meta.tree, **kw)
    xla = jax.jit(lambda q, kv, m: paged_attention_xla(q, None, None, kv, jnp.asarray(positions), m,
                                                       scale=kw["scale"], window=kw["window"],
                                                       alibi=kw["alibi_slopes"]))(
        q, LayerKV(k, v, ks, vs), jax.tree.map(jnp.asarray, meta))
    want = np_tree_attention(q, pages, meta, sees, scale=kw["scale"], window=kw["window"], slopes=kw["alibi_slopes"])
    assert out.shape == q.shape and out.dtype == q.dtype and xla.dtype == q.dtype
    tol = attention_rtol(dtype, keys=int(meta.context_lens.max()), head_dim=d)
    assert rel_err(out, ref) < tol
    assert rel_err(ref, xla) < tol
    assert rel_err(ref, want) < tol and rel_err(out, want) < tol
    assert float(jnp.abs(out[-3:].astype(jnp.float32)).max()) == 0.0           # padding tokens -> 0
    # the mask decides the case: without it the nodes see their siblings
    plain = ragged_paged_attention_reference(q, k, v, **args, k_scale=ks, v_scale=vs, **kw)
    assert rel_err(plain, want) > 10 * tol


def test_no_tree_is_the_same_program():
    """tree=None adds neither an input nor a mask to the kernel: the lowered program of a step
    without a tree is the one a plain call gives, and a tree adds exactly its two [T] inputs."""
    rng = np.random.default_rng(5)
    q, (k, v, _, _), meta, positions, _ = tree_step(rng, [(9, 3, 0), (4, 0, 6)], bs=8, hkv=2, g=2, d=16,
                                                     dtype=jnp.float32, quant=False)
    args = _kernel_args(meta, positions)

    def lowered(tree):
        fn = lambda q, k, v, tr: ragged_paged_attention(q, k, v, **args, scale=0.25, tree=tr, block_q=4)  # noqa: E731
        return jax.jit(fn).lower(q, k, v, tree).as_text()
    plain = jax.jit(lambda q, k, v: ragged_paged_attention(q, k, v, **args, scale=0.25, block_q=4)).lower(q, k, v)
    assert lowered(None).replace("jit__lambda", "jit_fn") == plain.as_text().replace("jit__lambda", "jit_fn")
    assert "tree" not in plain.as_text()
    with pytest.raises(ValueError, match="tree needs"):
        ragged_paged_attention(q, k, v, **args, scale=0.25, tree=jnp.zeros((3, 3), jnp.int32))


def test_tree_kernel_lowers_for_triton():
    """The tree mask's int32 shifts lower for the Triton GPU backend (no GPU needed to lower)."""
    hkv, g, d, bs, nb, s, t = 2, 4, 64, 16, 24, 3, 40
    q = jnp.zeros((t, hkv * g, d), jnp.bfloat16)
    pages = jnp.zeros((hkv, nb, bs, d), jnp.bfloat16)
    bt, lens, ids = jnp.zeros((s, 6), jnp.int32), jnp.zeros((s,), jnp.int32), jnp.zeros((t,), jnp.int32)
    tree = jnp.zeros((t, 3), jnp.int32)
    fn = lambda q, kp, vp, tr: ragged_paged_attention(  # noqa: E731
        q, kp, vp, ids, ids, jnp.zeros((s + 1,), jnp.int32), bt, lens, scale=0.125, tree=tr, interpret=False)
    text = jax.jit(fn).trace(q, pages, pages, tree).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
