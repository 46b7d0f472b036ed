"""The engine's XLA paged attention (in-step dense + per-sequence cached context, merged) equals
the plain definition (every token gathers its whole context from the pages) on ragged steps."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import attention, paged_attention_reference
from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, init_kv_pages, write_kv

SLOTS = 4   # prior_rows slots, as the runner uses


def build_step(rng, chunks, *, pad_tokens, pad_rows, hkv, g, d, bs, kv_dtype):
    """chunks [(cached, new)]: pages holding each sequence's cached K/V, this step's q/k/v and metadata."""
    s = len(chunks) + pad_rows
    nblk = [-(-(c + n) // bs) for c, n in chunks]
    max_blocks = max(nblk) + 1
    nb = 1 + sum(nblk) + 2
    phys = rng.permutation(np.arange(1, nb))
    bt = np.zeros((s, max_blocks), np.int32)
    i = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = phys[i:i + n]
        i += n
    slot = lambda r, p: bt[r, p // bs] * bs + p % bs  # noqa: E731
    kv = init_kv_pages(1, hkv, d, nb, bs, kv_dtype)[0]
    cached_slots = [slot(r, p) for r, (c, _) in enumerate(chunks) for p in range(c)]
    if cached_slots:
        m = len(cached_slots)
        kv = write_kv(kv, jnp.asarray(rng.standard_normal((m, hkv, d)), jnp.float32),
                      jnp.asarray(rng.standard_normal((m, hkv, d)), jnp.float32), jnp.asarray(cached_slots, jnp.int32))
    pos, sid, slots, qsl = [], [], [], [0]
    for r, (c, n) in enumerate(chunks):
        pos += range(c, c + n)
        sid += [r] * n
        slots += [slot(r, p) for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
    t = len(pos) + pad_tokens
    pos += [0] * pad_tokens
    sid += [0] * pad_tokens
    slots += [PAD_SLOT] * pad_tokens
    qsl += [qsl[-1]] * pad_rows
    ctx = [c + n for c, n in chunks] + [0] * pad_rows
    prior = [r for r, (c, n) in enumerate(chunks) if c > 0 and n > 1]
    meta = AttentionMetadata(jnp.asarray(sid, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(bt),
                             jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl, jnp.int32),
                             jnp.asarray(prior + [-1] * (SLOTS - len(prior)), jnp.int32))
    q = jnp.asarray(rng.standard_normal((t, hkv * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.float32)
    return q, k, v, kv, jnp.asarray(pos, jnp.int32), meta, len(pos) - pad_tokens


CASES = [
    # chunks (cached, new), pad tokens, pad rows, hkv, g, block size, window, alibi, kv dtype
    ([(0, 9), (17, 1), (5, 1), (0, 1)], 3, 2, 2, 4, 8, None, False, "float32"),
    ([(30, 1), (12, 7), (0, 20), (3, 1)], 0, 1, 1, 8, 16, None, True, "float32"),
    ([(40, 5), (9, 3), (33, 1), (0, 4), (1, 2)], 5, 0, 2, 1, 8, 6, False, "float32"),
    ([(20, 1), (0, 13), (35, 8)], 2, 3, 2, 4, 32, 11, True, "int8"),
    ([(64, 1)] * 6 + [(0, 25)], 7, 1, 2, 2, 16, None, False, "int8"),
]


@pytest.mark.parametrize("chunks,pad_t,pad_r,hkv,g,bs,window,alibi,kv_dtype", CASES)
def test_paged_xla_equals_definition(chunks, pad_t, pad_r, hkv, g, bs, window, alibi, kv_dtype):
    rng = np.random.default_rng(len(chunks) * 7 + bs)
    q, k, v, kv, pos, meta, n_real = build_step(rng, chunks, pad_tokens=pad_t, pad_rows=pad_r, hkv=hkv,
                                                g=g, d=16, bs=bs, kv_dtype=jnp.dtype(kv_dtype))
    slopes = jnp.asarray(rng.uniform(0.01, 0.2, hkv * g), jnp.float32) if alibi else None
    got, kv_after = attention(q, k, v, pos, scale=0.25, window=window, alibi=slopes, kv=kv, meta=meta, impl="xla")
    want = paged_attention_reference(q, write_kv(kv, k, v, meta.slot_mapping), pos, meta, scale=0.25,
                                     window=window, alibi=slopes)
    got, want = np.asarray(got)[:n_real], np.asarray(want)[:n_real]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.all(np.isfinite(np.asarray(kv_after.k, np.float32)))
