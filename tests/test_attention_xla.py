"""The engine's XLA paged attention (work items over KV blocks, kv_cache.build_attention_metadata)
equals the plain definition (every token gathers its whole context from the pages,
paged_attention_reference) on ragged steps: decode rows, first chunks, any number of chunks that
continue a cached context, padding rows and tokens; windows, ALiBi, soft caps, attention sinks, GQA,
int8 / fp8 / 16-bit pages."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import attention as _attention, paged_attention_reference as _reference
from jaxinfer.kv_cache import (CHUNK_GROUP, DECODE_GROUP, QUERY_TILE, StepRow, build_attention_metadata, init_kv_pages, kv_storage_dtype,
                               work_item_capacity, write_kv)
from tests.precision import attention_rtol, rel_err

# both under jit, as the engine's step runs them (called eagerly, each call compiled about a hundred
# one-operation programs: this file took 1,267 compiles)
attention = jax.jit(_attention, static_argnames=("scale", "window", "softcap", "impl", "item_groups"))
paged_attention_reference = jax.jit(_reference, static_argnames=("scale", "window", "softcap"))


def build_step(rng, chunks, *, pad_tokens, pad_rows, hkv, g, d, bs, kv_dtype):
    """chunks [(cached, new)]: pages holding each sequence's cached K/V, this step's q/k/v and metadata."""
    nblk = [-(-(c + n) // bs) for c, n in chunks]
    width = max(nblk) + 1
    nb = 1 + sum(nblk) + 2
    phys = rng.permutation(np.arange(1, nb))          # scattered pages; block 0 stays the null block
    tables, i = [], 0
    for n in nblk:
        tables.append([int(b) for b in phys[i:i + n]])
        i += n
    rows = [StepRow(c, n, tab) for (c, n), tab in zip(chunks, tables)]
    n_real = sum(n for _, n in chunks)
    t = n_real + pad_tokens
    meta = build_attention_metadata(rows, bs, t, len(chunks) + pad_rows, width)
    kv = init_kv_pages(1, hkv, d, nb, bs, kv_dtype)[0]
    cached = [tab[p // bs] * bs + p % bs for (c, _), tab in zip(chunks, tables) for p in range(c)]
    if cached:
        m = len(cached)
        kv = write_kv(kv, jnp.asarray(rng.standard_normal((m, hkv, d)), jnp.float32),
                      jnp.asarray(rng.standard_normal((m, hkv, d)), jnp.float32), jnp.asarray(cached, jnp.int32))
    pos = np.concatenate([np.arange(c, c + n) for c, n in chunks] + [np.zeros(pad_tokens, int)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, hkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    return q, k, v, kv, jnp.asarray(pos), jax.tree.map(jnp.asarray, meta), n_real


CASES = [
    # chunks (cached, new), pad tokens, pad rows, hkv, g, block size, window, alibi, kv dtype
    ([(0, 9), (17, 1), (5, 1), (0, 1)], 3, 2, 2, 4, 8, None, False, "float32"),
    ([(30, 1), (12, 7), (0, 20), (3, 1)], 0, 1, 1, 8, 16, None, True, "float32"),
    ([(40, 5), (9, 3), (33, 1), (0, 4), (1, 2)], 5, 0, 2, 1, 8, 6, False, "float32"),
    # six chunks continuing a cached context in one step (+ decode rows and a first chunk)
    ([(37, 19), (16, 40), (64, 3), (5, 17), (90, 33), (1, 2), (70, 1), (0, 21), (12, 1)], 6, 2, 2, 2, 16, None,
     False, "float32"),
    ([(37, 19), (16, 40), (64, 3), (5, 17), (90, 33), (1, 2), (70, 1), (0, 21)], 1, 1, 1, 4, 8, 13, True,
     "float32"),
    ([(20, 1), (0, 13), (35, 8)], 2, 3, 2, 4, 32, 11, True, "int8"),
    ([(64, 1)] * 6 + [(0, 25)], 7, 1, 2, 2, 16, None, False, "int8"),
    ([(20, 1), (0, 13), (35, 8)], 2, 3, 2, 4, 32, 11, True, "fp8"),
    # many decode rows and chunk tiles: several full loop groups of items (kv_cache.DECODE_GROUP) and a tail
    ([(c, 1) for c in range(5, 400, 9)] + [(200, 70), (0, 90)], 3, 2, 2, 2, 16, None, False, "float32"),
    ([(45, 18), (3, 1), (0, 30), (22, 6), (60, 1)], 4, 1, 2, 2, 16, 20, False, "bfloat16"),
    ([(45, 18), (3, 1), (0, 30), (22, 6), (60, 1)], 0, 2, 1, 8, 8, None, True, "float16"),
    # decode rows only, and chunks only (a verification round): the other part is skipped
    ([(30, 1), (0, 1), (75, 1)], 2, 1, 2, 2, 16, None, False, "float32"),
    ([(12, 5), (0, 20), (50, 5)], 3, 1, 2, 4, 8, 9, True, "float32"),
]


@pytest.mark.parametrize("chunks,pad_t,pad_r,hkv,g,bs,window,alibi,kv_dtype", CASES)
def test_paged_xla_equals_definition(chunks, pad_t, pad_r, hkv, g, bs, window, alibi, kv_dtype):
    rng = np.random.default_rng(len(chunks) * 7 + bs)
    q, k, v, kv, pos, meta, n_real = build_step(rng, chunks, pad_tokens=pad_t, pad_rows=pad_r, hkv=hkv,
                                                g=g, d=16, bs=bs, kv_dtype=kv_storage_dtype(kv_dtype))
    slopes = jnp.asarray(rng.uniform(0.01, 0.2, hkv * g), jnp.float32) if alibi else None
    got, kv_after = attention(q, k, v, pos, scale=0.25, window=window, alibi=slopes, kv=kv, meta=meta, impl="xla")
    # the same pages (this step's K/V written, rounded to the page dtype) through the plain definition;
    # 16-bit pages exactly upcast, since the reference would round its probabilities to the page dtype
    pages = write_kv(kv, k, v, meta.slot_mapping)
    if kv_dtype in ("bfloat16", "float16"):
        pages = jax.tree.map(lambda a: a.astype(jnp.float32), pages)
    want = paged_attention_reference(q, pages, pos, meta, scale=0.25, window=window, alibi=slopes)
    got, want = np.asarray(got)[:n_real], np.asarray(want)[:n_real]
    # both accumulate in float32 over <= 160 keys in different orders: a few ulp (6e-8) times a
    # small factor; a wrong mask or a missed block is off by O(1e-1)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.all(np.isfinite(np.asarray(kv_after.k, np.float32)))
    assert np.all(np.asarray(got) != 0)   # no real token lost its output


@pytest.mark.parametrize("groups", [(24, 8), (17, 5), (16, 8)])
def test_item_groups_that_do_not_divide_the_items(groups):
    """attention(item_groups=...) with loop groups that do not divide the work-item array (8 decode
    rows of 256 keys: exactly 32 items): every item merged once, as the plain definition has it (the
    tail loop's last slice once ran past the array, was shifted back, and merged items twice: errors
    of 0.2-0.3)."""
    rng = np.random.default_rng(6)
    s, bs, hkv, d = 8, 16, 1, 16
    nb = 1 + s * 16
    phys = rng.permutation(np.arange(1, nb))
    tables = [[int(b) for b in phys[i * 16:(i + 1) * 16]] for i in range(s)]
    meta = jax.tree.map(jnp.asarray, build_attention_metadata([StepRow(255, 1, t) for t in tables], bs, s, s, 16))
    assert meta.decode_items.shape[0] == int(meta.num_items[0]) == 32
    kv = init_kv_pages(1, hkv, d, nb, bs, jnp.float32)[0]
    kv = dataclasses.replace(kv, k=jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32),
                             v=jnp.asarray(rng.standard_normal(kv.v.shape), jnp.float32))
    q = jnp.asarray(rng.standard_normal((s, 2, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((s, hkv, d)), jnp.float32) for _ in range(2))
    pos = jnp.full((s,), 255, jnp.int32)
    got, _ = attention(q, k, v, pos, scale=0.25, kv=kv, meta=meta, impl="xla", item_groups=groups)
    want = paged_attention_reference(q, write_kv(kv, k, v, meta.slot_mapping), pos, meta, scale=0.25)
    got, want = np.asarray(got), np.asarray(want)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("kv_dtype,window", [("float32", 7), ("int8", None)])
def test_paged_xla_softcap_equals_definition(kv_dtype, window):
    """Gemma 2's soft cap (scores ~10 bent by a cap of 2) through the work items, decode rows and chunks."""
    rng = np.random.default_rng(5)
    chunks = [(20, 1), (0, 13), (35, 8), (50, 1)]
    q, k, v, kv, pos, meta, n_real = build_step(rng, chunks, pad_tokens=3, pad_rows=1, hkv=2, g=2, d=16, bs=8,
                                                kv_dtype=kv_storage_dtype(kv_dtype))
    q = q * 3
    got, _ = attention(q, k, v, pos, scale=0.25, window=window, softcap=2.0, kv=kv, meta=meta, impl="xla")
    pages = write_kv(kv, k, v, meta.slot_mapping)
    want = paged_attention_reference(q, pages, pos, meta, scale=0.25, window=window, softcap=2.0)
    uncapped = paged_attention_reference(q, pages, pos, meta, scale=0.25, window=window)
    got, want, uncapped = (np.asarray(a)[:n_real] for a in (got, want, uncapped))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.linalg.norm(uncapped - want) / np.linalg.norm(want) > 1e-2


def test_metadata_items_cover_each_visible_block_once():
    """The host's work items: a decode row reads each of its blocks once; a tile reads the blocks up to
    its last token; padding items name the dummy tile and the null block; sizes are the bucket's."""
    rows = [StepRow(40, 1, [7, 3, 9]), StepRow(0, 20, [4, 5]), StepRow(33, 17, [8, 2, 6, 1])]
    t, s, b, bs = 64, 8, 4, 16
    meta = build_attention_metadata(rows, bs, t, s, b)
    nd, nt, nc = work_item_capacity(t, s, b, bs)
    kb = 4   # 64 keys per item
    assert meta.decode_items.shape == (nd, 2 + kb) and meta.chunk_items.shape == (nc, 2 + kb)
    assert meta.chunk_tiles.shape == (nt, QUERY_TILE) and nd % DECODE_GROUP == 0 == nc % CHUNK_GROUP
    assert list(meta.num_items) == [1, 1 + 1 + 1 + 1]
    assert meta.decode_tokens.tolist() == [0] + [t] * 7
    assert meta.decode_items[:1].tolist() == [[0, 0, 7, 3, 9, 0]]
    # row 1: tokens 1..20 in tiles [1..16] and [17..20]; row 2: positions 33..49 at tokens 21..37 in
    # tiles of 16 (33..48) and 1 (49); each tile's visible blocks fit one item of 4 blocks
    assert meta.chunk_tiles[0].tolist() == list(range(1, 17))
    assert meta.chunk_tiles[1].tolist() == list(range(17, 21)) + [t] * 12
    assert meta.chunk_tiles[3].tolist() == [37] + [t] * 15
    assert meta.chunk_items[:4].tolist() == [[0, 0, 4, 5, 0, 0], [1, 0, 4, 5, 0, 0], [2, 0, 8, 2, 6, 1],
                                             [3, 0, 8, 2, 6, 1]]
    assert np.all(meta.chunk_items[4:] == [nt] + [0] * (1 + kb)) and np.all(meta.decode_items[1:] == [s] + [0] * (1 + kb))
    # 64 keys per item: a 100-block context is 25 items, a tile at position 70 reads blocks 0..4 in 2
    long = build_attention_metadata([StepRow(99 * bs, 1, list(range(1, 101))), StepRow(60, 11, [3, 4, 5, 6, 7])],
                                    bs, 16, 4, 100)
    assert list(long.num_items) == [25, 2] and long.decode_items[24].tolist() == [0, 96, 97, 98, 99, 100]
    assert long.chunk_items[1].tolist() == [0, 4, 7, 0, 0, 0]
    assert meta.slot_mapping[0] == 9 * bs + 8 and meta.query_start_loc.tolist() == [0, 1, 21, 38] + [38] * 5
    assert meta.context_lens.tolist() == [41, 20, 50, 0, 0, 0, 0, 0]


def test_multi_step_decode_rows_read_blocks_of_later_positions():
    """A decode row run for 3 iterations in one step (positions 31, 32, 33 with block size 16): its items
    and block table cover block 2, so the later iterations see their own keys; the attention at the third
    position (as the device advances positions) equals the definition."""
    bs, hkv, g, d = 16, 2, 2, 16
    rng = np.random.default_rng(3)
    meta = build_attention_metadata([StepRow(31, 1, [5, 2, 7], lookahead=2), StepRow(10, 1, [4])], bs, 8, 4, 4)
    assert list(meta.num_items) == [2, 0] and meta.block_tables[0, :3].tolist() == [5, 2, 7]
    assert meta.decode_items[0].tolist() == [0, 0, 5, 2, 7, 0]
    kv = init_kv_pages(1, hkv, d, 8, bs, jnp.float32)[0]
    kv = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), kv)
    meta = jax.tree.map(jnp.asarray, meta)
    # the third iteration: positions 33 and 12, slots from the tables, contexts 34 and 13
    advanced = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.at[:2].set(jnp.asarray([7 * bs + 1, 4 * bs + 12])),
                                   context_lens=meta.context_lens.at[:2].set(jnp.asarray([34, 13])))
    pos = jnp.asarray([33, 12] + [0] * 6, jnp.int32)
    q = jnp.asarray(rng.standard_normal((8, hkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((8, hkv, d)), jnp.float32)
    got, pages = attention(q, k, k, pos, scale=0.25, kv=kv, meta=advanced, impl="xla")
    want = paged_attention_reference(q, pages, pos, advanced, scale=0.25)
    # the XLA attention and the reference sum the scores and values in other orders (34 keys at most)
    assert rel_err(np.asarray(got)[:2], np.asarray(want)[:2]) <= attention_rtol("float32", keys=34, head_dim=d)


@pytest.mark.parametrize("kv_dtype,window,g", [("float32", 7, 2), ("int8", None, 4), ("float32", None, 1)])
def test_paged_xla_sinks_equal_definition(kv_dtype, window, g):
    """gpt-oss's attention sinks (one logit per query head, as large as the scores) through the work
    items' online softmax, decode rows and chunks, against the reference's explicit denominator."""
    rng = np.random.default_rng(9)
    chunks = [(20, 1), (0, 13), (35, 8), (50, 1), (3, 1)]
    q, k, v, kv, pos, meta, n_real = build_step(rng, chunks, pad_tokens=3, pad_rows=1, hkv=2, g=g, d=16, bs=8,
                                                kv_dtype=kv_storage_dtype(kv_dtype))
    sinks = jnp.asarray(rng.normal(0.0, 2.0, 2 * g), jnp.float32)
    got, _ = attention(q, k, v, pos, scale=0.25, window=window, sinks=sinks, kv=kv, meta=meta, impl="xla")
    pages = write_kv(kv, k, v, meta.slot_mapping)
    want = paged_attention_reference(q, pages, pos, meta, scale=0.25, window=window, sinks=sinks)
    plain = paged_attention_reference(q, pages, pos, meta, scale=0.25, window=window)
    got, want, plain = (np.asarray(a)[:n_real] for a in (got, want, plain))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.linalg.norm(plain - want) / np.linalg.norm(want) > 1e-2      # the sinks changed the result
