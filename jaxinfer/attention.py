"""The one attention entry point of the model.

`attention(...)` takes this step's q, k, v for T flattened tokens and either
  - no cache: causal attention among the T tokens of one sequence (Generator.logits, training), or
  - a layer's KV pages + AttentionMetadata: write k, v into their slots, then every token attends to
    its own sequence's context (earlier chunks included) through the block table.
It dispatches to an implementation: "xla" (plain jnp, below; works on every backend) or the
Pallas kernels (pallas_kernels/), chosen per device by the caller. Masks are built from token
positions, so chunked prefill and decode are the same code: token t at position p sees context
positions l with l <= p and, with a sliding window W, p - W < l. A soft cap C (Gemma 2) maps each
scaled score s to C * tanh(s / C) before anything else touches it; ALiBi adds slope_h * (l - p).
Attention sinks (gpt-oss: sinks [H], one logit per head) join every softmax's denominator as a key
of value 0 the query always sees: out = sum_l e^(s_l) v_l / (e^(sink_h) + sum_l e^(s_l)); in the
online softmax they are the running (max, sum) a row starts from, (sink_h, 1). A row that sees no
key outputs 0 either way. Softmax is always float32. Medusa's tree verification adds a tree mask
(AttentionMetadata.tree: each token's slot, which replaces its position in the masks, its row's first
node slot and its ancestor bits), defined once in pallas_kernels/attention_common.tree_visible and
applied by both implementations.

The XLA paged attention (paged_attention_xla) is one ragged mechanism for every kind of row: this
step's K/V are written first and read back from the pages like all other keys (as the Pallas
kernel does), through work items the host lists (kv_cache.build_attention_metadata): one per
(decode row or 16-token query tile of a multi-token chunk, 4 KV blocks = 64 keys it can see). Two
loops (decode items, chunk items) take 16 / 8 items per iteration, stop at the step's real item
count and merge into each tile's running softmax (scatter-max / scatter-add), so work and memory
follow the blocks actually used; the item arrays' sizes depend on T alone, which replaced the
block-count bucket (7 compiled shapes instead of 21 on the bundled model). A step with no decode
rows (a speculative round's verification: every row is a chunk) or no chunks (a decode step, the
draft model's proposal iterations) skips that part under a lax.cond: at batch 1 a part's fixed ops,
not its work, are most of its cost (the draft method's batch-1 decode ran 1.26x faster).
bench/attention_xla.py, one layer of the bundled model (4 heads, 2 kv heads, head_dim 64, block
16, float32), KV write included, XLA:CPU on 2 shared cores (load ~7), medians of 15 interleaved calls:
  step                                        previous (305d24f)   work items
  decode, batch 1, 256 cached                        0.56 ms          0.55 ms
  decode, 64 rows, contexts 16..512                  88.9 ms          19.7 ms
  first chunk, 512 tokens                            29.1 ms          10.6 ms
  8 chunks x 32 over 768 cached + 32 decode rows    211.0 ms          20.4 ms
  64 first chunks of 8 tokens                        16.8 ms           3.8 ms
(previous: dense T x T in-step part + decode rows gathered to the longest context's block bucket +
one slot per continuation chunk.) Measured against each other in the same run: one flat pass
over the items padded to a power of two with a segment softmax was 3-6x slower than the loop
(59 / 61 / 65 ms on the three big steps); 16 keys per item 1.2-2x slower than 64 on prefill and
mixed steps; 8 to 32 items per iteration within the machine's noise.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.kv_cache import (CHUNK_GROUP, DECODE_GROUP, TREE_NONE, AttentionMetadata, LayerKV, value_view,
                               write_kv)
from jaxinfer.quant import dot_precision
from pallas_kernels.attention_common import soft_cap, tree_visible
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

NEG_INF = -1e30  # finite, so fully-masked padding rows give zeros instead of NaN


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
              window: int | jax.Array | None = None, alibi: jax.Array | None = None, softcap: float | None = None,
              sinks: jax.Array | None = None, kv: LayerKV | None = None, meta: AttentionMetadata | None = None,
              impl: str = "xla", item_groups: tuple[int, int] | None = None,
              kv_splits: int = 1) -> tuple[jax.Array, LayerKV | None]:
    """q [T, H, D], k/v [T, Hkv, D], positions [T], sinks [H] float32 or None -> (out [T, H, D],
    updated pages or None). window: an int, None, or an int32 scalar array (a pipeline stage's layer
    whose window differs between stages; pipeline._NO_WINDOW for none). item_groups: (decode, chunk)
    work items the XLA paged attention takes per loop iteration (None: kv_cache.DECODE_GROUP,
    CHUNK_GROUP; bench/attention_xla.py compares). kv_splits: the Pallas ragged kernel's split-KV
    programs per query tile and kv head (num_kv_splits; 1: unsplit); the XLA paths ignore it."""
    if impl not in ("xla", "pallas"):
        raise ValueError(f"unknown attention implementation {impl!r}; use 'xla' or 'pallas'")
    if kv is None:
        # a traced window (pipeline.py: a layer whose window differs between stages) is an input of the
        # ragged kernel, not of flash_attention: a cacheless forward (Generator.logits, no serving
        # step) of such a stage runs the dense XLA attention
        if impl == "pallas" and not isinstance(window, jax.Array):
            return flash_attention(q, k, v, scale=scale, causal=True, window=window, alibi_slopes=alibi,
                                   softcap=softcap, sinks=sinks), None
        return dense_causal_attention(q, k, v, positions, scale=scale, window=window, alibi=alibi,
                                      softcap=softcap, sinks=sinks), None
    assert meta is not None, "paged attention needs AttentionMetadata"
    kv = write_kv(kv, k, v, meta.slot_mapping)
    pages = value_view(kv)   # shared-value pages (latent attention): the values read from the K pages
    if impl == "pallas":
        out = ragged_paged_attention(q, pages.k, pages.v, positions, meta.seq_ids, meta.query_start_loc,
                                     meta.block_tables, meta.context_lens, scale=scale, window=window,
                                     alibi_slopes=alibi, softcap=softcap, sinks=sinks, k_scale=pages.k_scale,
                                     v_scale=pages.v_scale, tree=meta.tree, num_kv_splits=kv_splits)
        return out.astype(q.dtype), kv
    return paged_attention_xla(q, k, v, pages, positions, meta, scale=scale, window=window, alibi=alibi,
                               softcap=softcap, sinks=sinks, item_groups=item_groups), kv


def mask_and_bias(q_pos: jax.Array, k_pos: jax.Array, window: int | None, alibi: jax.Array | None,
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
                    v_spec: str, sinks: jax.Array | None = None) -> jax.Array:
    """scores [Hkv, G, T, L] f32 -> weighted sum of v; v_spec is the einsum spec of v's axes;
    sinks [H] f32: one more logit per head in each denominator (module docstring)."""
    hkv, g = scores.shape[:2]
    if bias is not None:
        scores = scores + bias.reshape(hkv, g, *bias.shape[1:])
    scores = jnp.where(valid[None, None], scores, NEG_INF)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(hkv, g, 1, 1)
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    probs = jnp.where(valid[None, None], probs, 0.0)  # rows with no visible key -> 0
    return jnp.einsum(f"kgtl,{v_spec}->tkgd", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32, precision=dot_precision(v.dtype))


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                           scale: float, window: int | None = None, alibi: jax.Array | None = None,
                           softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Reference attention of one sequence's T tokens among themselves. [T,H,D],[T,Hkv,D] -> [T,H,D]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, h // hkv, d)                                # (T, Hkv, G, D)
    scores = soft_cap(jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32,
                                 precision=dot_precision(q.dtype)) * scale, softcap)
    valid, bias = mask_and_bias(positions, positions, window, alibi)
    out = _softmax_attend(scores, valid, bias, v, "lkd", sinks)
    return out.reshape(t, h, d).astype(q.dtype)


def gather_context(kv: LayerKV, block_tables: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Each sequence's pages in logical order: (Hkv, S, max_blocks * bs, D), dequantized if int8 or fp8."""
    hkv, _, bs, d = kv.k.shape
    s, max_blocks = block_tables.shape
    k_seq = kv.k[:, block_tables].reshape(hkv, s, max_blocks * bs, d)
    v_seq = kv.v[:, block_tables].reshape(hkv, s, max_blocks * bs, d)
    if kv.k_scale is not None:
        k_seq = (k_seq.astype(jnp.float32) * kv.k_scale[:, block_tables].reshape(hkv, s, -1)[..., None]).astype(dtype)
        v_seq = (v_seq.astype(jnp.float32) * kv.v_scale[:, block_tables].reshape(hkv, s, -1)[..., None]).astype(dtype)
    return k_seq, v_seq


def paged_attention_reference(q: jax.Array, kv: LayerKV, positions: jax.Array, meta: AttentionMetadata, *,
                              scale: float, window: int | None = None, alibi: jax.Array | None = None,
                              softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """The plain definition, after this step's K/V were written: every token gathers its own
    sequence's whole context from the pages. Memory O(T * max_context * D): a reference only."""
    t, h, d = q.shape
    hkv, _, bs, _ = kv.k.shape
    k_seq, v_seq = gather_context(kv, meta.block_tables, q.dtype)
    k_tok, v_tok = k_seq[:, meta.seq_ids], v_seq[:, meta.seq_ids]             # (Hkv, T, L, D)
    qg = q.reshape(t, hkv, h // hkv, d)
    scores = soft_cap(jnp.einsum("tkgd,ktld->kgtl", qg, k_tok, preferred_element_type=jnp.float32,
                                 precision=dot_precision(q.dtype)) * scale, softcap)
    k_pos = jnp.arange(k_seq.shape[2], dtype=jnp.int32)
    in_context = k_pos[None, :] < meta.context_lens[meta.seq_ids][:, None]
    if meta.tree is not None:
        positions = meta.tree[:, 0]
        in_context &= tree_visible(k_pos[None, :], meta.tree[:, 1:2], meta.tree[:, 2:3])
    valid, bias = mask_and_bias(positions, k_pos, window, alibi, extra_valid=in_context)
    out = _softmax_attend(scores, valid, bias, v_tok, "ktld", sinks)
    return out.reshape(t, h, d).astype(q.dtype)


def _attend_items(q_tiles: jax.Array, pos_tiles: jax.Array, kv: LayerKV, items: jax.Array,
                  num_items: jax.Array, *, scale: float, window: int | None,
                  alibi: jax.Array | None, group: int, tree_tiles: tuple | None = None,
                  precision=None, softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention of query tiles over a flat list of work items (tile, first logical block j,
    physical blocks j .. j + KB - 1), `group` items per loop iteration (the last few group // 8),
    merged per tile by online softmax.

    q_tiles [NT+1, Hkv, Q, D] f32 (row NT: the padding items' dummy tile), pos_tiles [NT+1, Q]
    (position of each query, -1: none), items [N, 2 + KB] int32 (any N >= num_items); only the
    first num_items are real and the loops stop there: the work follows the blocks the step actually
    reads, not the bucket. -> [NT+1, Hkv, Q, D] f32 (0: a query with no key).
    Keys past a query's position are masked, so an item's null blocks past the context cost work but
    never count. tree_tiles: (first node slot, ancestor bits) [NT+1, Q] of each query (Medusa;
    pos_tiles then hold slot indexes). Items of one tile may share a group: the running max, sum and output are merged
    with scatter-max / scatter-add, which combine duplicates. precision: of the two f32 einsums
    (quant.dot_precision of the model's dtype: a float32 model's scores are not rounded to TF32 on a
    GPU; a bfloat16 model's operands came from bfloat16, which TF32 holds exactly)."""
    nt1, hkv, nq, d = q_tiles.shape
    bs = kv.k.shape[2]
    kb = items.shape[1] - 2
    per_head = alibi if alibi is not None else sinks          # [H]: G query heads per kv head
    g = per_head.shape[0] // hkv if per_head is not None else 1
    per_q = lambda a: jnp.tile(a.reshape(hkv, 1, g), (1, nq // g, 1)).reshape(hkv, nq)  # noqa: E731  [H] -> [Hkv, Q]
    slope = None if alibi is None else per_q(alibi)
    offs = jnp.arange(kb * bs, dtype=jnp.int32)

    def step(carry, start, size):
        """Merge items [start, start + size) into the running (max, sum, output) of their tiles."""
        m_acc, l_acc, o_acc = carry                                       # [NT+1, Hkv, Q(, D)]
        it = jax.lax.dynamic_slice_in_dim(items, start, size)
        tile, j, blk = it[:, 0], it[:, 1], it[:, 2:]                      # [K], [K], [K, KB]
        # block ids come from the block manager (0: null), so always in range: no clamping
        k = kv.k.at[:, blk].get(mode="promise_in_bounds")                 # (Hkv, K, KB, bs, D)
        v = kv.v.at[:, blk].get(mode="promise_in_bounds")
        if kv.k_scale is not None:
            k = k.astype(jnp.float32) * kv.k_scale[:, blk][..., None]
            v = v.astype(jnp.float32) * kv.v_scale[:, blk][..., None]
        k = k.astype(jnp.float32).reshape(hkv, size, kb * bs, d)
        v = v.astype(jnp.float32).reshape(hkv, size, kb * bs, d)
        # scores (Hkv, K, L, Q): batch axes in the pages' order and [L, D] read as stored, so XLA:CPU
        # transposes neither k nor v (the small q tile and the outputs move instead)
        qt = q_tiles[tile].transpose(1, 0, 2, 3)                          # (Hkv, K, Q, D)
        sc = soft_cap(jnp.einsum("knld,knqd->knlq", k, qt, precision=precision) * scale, softcap)  # (Hkv, K, KB*bs, Q)
        rel = (j[:, None] * bs + offs)[None, :, :, None] - pos_tiles[tile][None, :, None, :]
        valid = (rel <= 0) & (pos_tiles[tile] >= 0)[None, :, None, :]     # (1, K, KB*bs, Q)
        if window is not None:
            valid &= rel > -window
        if tree_tiles is not None:
            k_idx = (j[:, None] * bs + offs)[:, :, None]                    # (K, KB*bs, 1)
            valid &= tree_visible(k_idx, tree_tiles[0][tile][:, None, :], tree_tiles[1][tile][:, None, :])[None]
        if slope is not None:
            sc = sc + slope[:, None, None, :] * rel.astype(jnp.float32)
        sc = jnp.where(valid, sc, NEG_INF)
        m_new = m_acc.at[tile].max(jnp.max(sc, axis=2).transpose(1, 0, 2))
        alpha = jnp.exp(m_acc - m_new)
        p = jnp.where(valid, jnp.exp(sc - m_new[tile].transpose(1, 0, 2)[:, :, None, :]), 0.0)
        l_acc = (l_acc * alpha).at[tile].add(jnp.sum(p, axis=2).transpose(1, 0, 2))
        o_acc = (o_acc * alpha[..., None]).at[tile].add(jnp.einsum("knlq,knld->nkqd", p, v, precision=precision))
        return m_new, l_acc, o_acc

    init = (jnp.full((nt1, hkv, nq), NEG_INF, jnp.float32), jnp.zeros((nt1, hkv, nq), jnp.float32),
            jnp.zeros((nt1, hkv, nq, d), jnp.float32))
    if sinks is not None:   # every tile starts from its heads' sink: (max, sum) = (sink, e^0)
        init = (jnp.broadcast_to(per_q(sinks.astype(jnp.float32)), (nt1, hkv, nq)),
                jnp.ones((nt1, hkv, nq), jnp.float32), init[2])
    # full groups, then the rest in groups of `tail` so that a small step (batch-1 decode) does not
    # pay for a whole group of padding items. tail divides both `group` and the item array's length,
    # so the last tail slice ends inside the array (a slice past its end is shifted back by
    # dynamic_slice, and its items would be merged twice)
    tail = math.gcd(math.gcd(group, items.shape[0]), max(1, group // 8))
    full = num_items // group
    carry = jax.lax.fori_loop(0, full, lambda i, c: step(c, i * group, group), init)
    carry = jax.lax.fori_loop(0, (num_items - full * group + tail - 1) // tail,
                              lambda i, c: step(c, full * group + i * tail, tail), carry)
    _, l_acc, o_acc = carry
    return jnp.where(l_acc[..., None] > 0, o_acc / jnp.where(l_acc > 0, l_acc, 1.0)[..., None], 0.0)


def paged_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV, positions: jax.Array,
                        meta: AttentionMetadata, *, scale: float, window: int | None = None,
                        alibi: jax.Array | None = None, softcap: float | None = None,
                        sinks: jax.Array | None = None, item_groups: tuple[int, int] | None = None) -> jax.Array:
    """Ragged paged attention over the work items of `meta` (kv_cache.build_attention_metadata).
    q [T,H,D], this step's k/v [T,Hkv,D] (already written to kv; read back from the pages like
    every other key) -> [T,H,D].

    Every key a token sees is read from the pages through a flat list of work items built on the
    host, each KEYS_PER_ITEM keys (4 blocks of 16) wide: (row, blocks) covering every block of a
    single-token row (decode: Q = G query heads), and (tile, blocks) covering every block a
    QUERY_TILE-token tile of a multi-token chunk can see (first chunks, later chunks of a chunked
    prefill, forked samples, any number of them: Q = QUERY_TILE * G). Two loops, one per kind, run
    over the real items only, so work and memory follow the KV blocks the step uses: no padding to
    the longest context, no per-token gather. Padding tokens (in no row) output 0. item_groups:
    (decode, chunk) items per loop iteration (None: DECODE_GROUP, CHUNK_GROUP).
    """
    del k, v
    if meta.num_items is None:   # hand-built metadata without work items: the plain definition
        return paged_attention_reference(q, kv, positions, meta, scale=scale, window=window, alibi=alibi,
                                         softcap=softcap, sinks=sinks)
    t, h, d = q.shape
    hkv = kv.k.shape[0]
    g = h // hkv
    if meta.tree is not None:   # tree nodes: the causal mask compares slot indexes, not positions
        positions = meta.tree[:, 0]
    q_ext = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((1, h, d), jnp.float32)])   # row T: none
    pos_ext = jnp.concatenate([positions, jnp.full((1,), -1, positions.dtype)])
    kw = dict(scale=scale, window=window, alibi=alibi, softcap=softcap, sinks=sinks, precision=dot_precision(q.dtype))
    decode_group, chunk_group = item_groups or (DECODE_GROUP, CHUNK_GROUP)

    # a step without decode rows (or without chunks) skips that part: at batch 1 most of a layer's
    # attention ops are the fixed cost of a part, not its work
    dec_tok = jnp.concatenate([meta.decode_tokens, jnp.full((1,), t, jnp.int32)])       # [S+1]; S: the dummy
    dout = jax.lax.cond(meta.num_items[0] > 0, lambda: _attend_decode(q_ext, pos_ext, kv, meta, dec_tok, g, decode_group, **kw),
                        lambda: jnp.zeros((dec_tok.shape[0], hkv, g, d), jnp.float32))   # (S+1, Hkv, G, D)
    out = jnp.zeros((t + 1, hkv, g, d), jnp.float32)
    out = jax.lax.cond(meta.num_items[1] > 0, lambda o: _attend_chunks(q_ext, pos_ext, kv, meta, o, chunk_group, **kw),
                       lambda o: o, out)
    out = out.at[dec_tok].set(dout)                       # index T collects every padding entry
    return out[:t].reshape(t, h, d).astype(q.dtype)


def _attend_decode(q_ext: jax.Array, pos_ext: jax.Array, kv: LayerKV, meta: AttentionMetadata, dec_tok: jax.Array,
                   g: int, group: int, **kw) -> jax.Array:
    """paged_attention_xla's single-token rows: tile = row (dec_tok [S+1], row S: the padding items'
    dummy), its G query heads per kv head. -> (S+1, Hkv, G, D)."""
    hkv, d = kv.k.shape[0], q_ext.shape[-1]
    dq = q_ext[dec_tok].reshape(-1, hkv, g, d)                                           # (S+1, Hkv, G, D)
    dpos = jnp.broadcast_to(pos_ext[dec_tok][:, None], (dq.shape[0], g))
    return _attend_items(dq, dpos, kv, meta.decode_items, meta.num_items[0],
                         group=min(group, meta.decode_items.shape[0]), **kw)


def _attend_chunks(q_ext: jax.Array, pos_ext: jax.Array, kv: LayerKV, meta: AttentionMetadata, out: jax.Array,
                   group: int, **kw) -> jax.Array:
    """paged_attention_xla's multi-token chunks: tiles of tq tokens x G heads (tile NT: the dummy),
    their outputs set into out [T+1, Hkv, G, D]."""
    t = q_ext.shape[0] - 1
    _, hkv, g, d = out.shape
    tq = meta.chunk_tiles.shape[1]
    tiles = jnp.concatenate([meta.chunk_tiles, jnp.full((1, tq), t, jnp.int32)])         # [NT+1, tq]
    cq = q_ext[tiles].reshape(-1, tq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(-1, hkv, tq * g, d)
    cpos = jnp.repeat(pos_ext[tiles], g, axis=1)                                         # (NT+1, tq*G)
    tree_tiles = None
    if meta.tree is not None:
        first = jnp.concatenate([meta.tree[:, 1], jnp.full((1,), TREE_NONE, jnp.int32)])
        bits = jnp.concatenate([meta.tree[:, 2], jnp.zeros((1,), jnp.int32)])
        tree_tiles = (jnp.repeat(first[tiles], g, axis=1), jnp.repeat(bits[tiles], g, axis=1))
    cout = _attend_items(cq, cpos, kv, meta.chunk_items, meta.num_items[1],
                         group=min(group, meta.chunk_items.shape[0]), tree_tiles=tree_tiles, **kw)
    cout = cout.reshape(-1, hkv, tq, g, d).transpose(0, 2, 1, 3, 4)                      # (NT+1, tq, Hkv, G, D)
    return out.at[tiles.reshape(-1)].set(cout.reshape(-1, hkv, g, d))
