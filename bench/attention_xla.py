"""The XLA paged attention on its own: today's work-item attention (jaxinfer/attention.py) against
the previous one (dense in-step T x T + decode rows gathered to the step's longest context +
`prior_rows` slots, commit 305d24f, kept below as `previous_paged_attention_xla`) and against
variants of the work-item loop (items per iteration; one flat pass with a segment softmax over
the items padded to a power of two). One layer, the bundled model's shapes (4 heads, 2 kv heads,
head_dim 64, block_size 16, float32 pages, max_model_len 1024), KV write included, pages donated.

    python bench/attention_xla.py [--reps 15] [--out bench/results/...-cpu-attention-xla.json]

Medians of --reps timed calls after one warm call; every variant of a case runs in the same process
on the same inputs, interleaved round by round so that load from other processes hits all alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer.kv_cache as kvc
from bench.common import device_info, device_slug, results_path, write_report
from jaxinfer.attention import NEG_INF, attention, gather_context, mask_and_bias
from jaxinfer.kv_cache import LayerKV, StepRow, build_attention_metadata, init_kv_pages, write_kv

H, HKV, D, BS, MAX_MODEL_LEN = 4, 2, 64, 16, 1024
MAX_BLOCKS = MAX_MODEL_LEN // BS


# ------------------------------------------------------------------ the previous XLA attention
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PreviousMetadata:
    seq_ids: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array      # [S, B]: B the power-of-4 bucket of the cached blocks
    context_lens: jax.Array
    query_start_loc: jax.Array
    prior_rows: jax.Array        # [P]: continuation chunks (-1: empty slot)


def _partial_attend(scores, valid, bias, v, v_spec):
    hkv, g = scores.shape[:2]
    if bias is not None:
        scores = scores + bias.reshape(hkv, g, *bias.shape[1:])
    scores = jnp.where(valid[None, None], scores, NEG_INF)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(valid[None, None], jnp.exp(scores - m[..., None]), 0.0)
    acc = jnp.einsum(f"kgql,{v_spec}->kgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=-1), acc


def _decode_rows(q, k_seq, v_seq, valid, bias, scale):
    s, hkv, g, _ = q.shape
    qk = q.transpose(1, 0, 2, 3).astype(jnp.float32)
    sc = jnp.einsum("ksld,ksgd->kslg", k_seq.astype(jnp.float32), qk) * scale
    if bias is not None:
        sc = sc + bias.reshape(hkv, g, s, -1).transpose(0, 2, 3, 1)
    mask = valid[None, :, :, None]
    sc = jnp.where(mask, sc, NEG_INF)
    m = jnp.max(sc, axis=2)
    p = jnp.where(mask, jnp.exp(sc - m[:, :, None]), 0.0)
    acc = jnp.einsum("kslg,ksld->ksgd", p, v_seq.astype(jnp.float32))
    return m.transpose(0, 2, 1), jnp.sum(p, axis=2).transpose(0, 2, 1), acc.transpose(0, 2, 1, 3)


def _merge(parts):
    m = parts[0][0]
    for pm, _, _ in parts[1:]:
        m = jnp.maximum(m, pm)
    num = sum(acc * jnp.exp(pm - m)[..., None] for pm, _, acc in parts)
    den = sum(pl * jnp.exp(pm - m) for pm, pl, _ in parts)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def previous_paged_attention_xla(q, k, v, kv, positions, meta, *, scale, window=None, alibi=None):
    """jaxinfer/attention.py::paged_attention_xla at commit 305d24f (float pages), verbatim."""
    t, h, d = q.shape
    hkv = kv.k.shape[0]
    g = h // hkv
    qsl = meta.query_start_loc
    qlen = qsl[1:] - qsl[:-1]
    cached = meta.context_lens - qlen
    tok_valid = jnp.arange(t) < qsl[-1]
    qg = q.reshape(t, hkv, g, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
    same = (meta.seq_ids[:, None] == meta.seq_ids[None, :]) & tok_valid[:, None] & tok_valid[None, :]
    valid, bias = mask_and_bias(positions, positions, window, alibi, extra_valid=same)
    parts = [_partial_attend(scores, valid, bias, v.astype(q.dtype), "lkd")]
    k_pos = jnp.arange(meta.block_tables.shape[1] * kv.k.shape[2], dtype=jnp.int32)
    single = (qlen == 1)[meta.seq_ids] & tok_valid
    first = jnp.minimum(qsl[:-1], t - 1)

    def decode_rows(_):
        k_seq, v_seq = gather_context(kv, meta.block_tables, jnp.float32)
        valid_r, bias_r = mask_and_bias(positions[first], k_pos, window, alibi,
                                         extra_valid=k_pos[None, :] < cached[:, None])
        m_r, l_r, acc_r = _decode_rows(qg[first], k_seq, v_seq, valid_r, bias_r, scale)
        return (jnp.where(single, m_r[:, :, meta.seq_ids], NEG_INF),
                jnp.where(single, l_r[:, :, meta.seq_ids], 0.0),
                jnp.where(single[:, None], acc_r[:, :, meta.seq_ids], 0.0))

    empty = (jnp.full((hkv, g, t), NEG_INF, jnp.float32), jnp.zeros((hkv, g, t), jnp.float32),
             jnp.zeros((hkv, g, t, d), jnp.float32))
    parts.append(jax.lax.cond(jnp.any((qlen == 1) & (cached > 0)), decode_rows, lambda _: empty, None))

    def continued(row):
        k_row, v_row = gather_context(kv, meta.block_tables[row][None], q.dtype)
        extra = (meta.seq_ids == row)[:, None] & tok_valid[:, None] & (k_pos[None, :] < cached[row])
        sc = jnp.einsum("tkgd,kld->kgtl", qg, k_row[:, 0], preferred_element_type=jnp.float32) * scale
        vmask, vbias = mask_and_bias(positions, k_pos, window, alibi, extra_valid=extra)
        return _partial_attend(sc, vmask, vbias, v_row[:, 0], "kld")

    for slot in range(meta.prior_rows.shape[0]):
        row = meta.prior_rows[slot]
        parts.append(jax.lax.cond(row >= 0, continued, lambda _: empty, jnp.maximum(row, 0)))
    out = _merge(parts)
    return out.transpose(2, 0, 1, 3).reshape(t, h, d).astype(q.dtype)


def _previous_step(q, k, v, kv, positions, meta):
    kv = write_kv(kv, k, v, meta.slot_mapping)
    return previous_paged_attention_xla(q, k, v, kv, positions, meta, scale=D ** -0.5), kv


# ------------------------------------------------------------------ cases
def cases(rng) -> dict[str, tuple[list[tuple[int, int]], int]]:
    """name -> ([(cached, new)] per row, token bucket T)."""
    spread = [int(c) for c in np.linspace(16, 512, 64)]
    return {
        "decode_b1_ctx256": ([(256, 1)], 8),
        "decode_b64_ctx16-512": ([(c, 1) for c in spread], 64),
        "prefill_512_first_chunk": ([(0, 512)], 512),
        "8x32_continuations_ctx768+32_decode": ([(768, 32)] * 8 + [(c, 1) for c in spread[::2]], 512),
        "prefill_64x8_short_prompts": ([(0, 8)] * 64, 512),
    }


def _pow4_bucket(n: int) -> int:
    b = 4
    while b < n:
        b *= 4
    return min(b, MAX_BLOCKS)


def build(rng, rows_spec, t):
    s = min(t, 64)
    tables, nxt = [], 1
    for c, n in rows_spec:
        used = -(-(c + n) // BS)
        tables.append(list(range(nxt, nxt + used)))
        nxt += used
    perm = np.concatenate([[0], 1 + rng.permutation(nxt - 1)])      # pages scattered over the pool
    tables = [[int(perm[b]) for b in tab] for tab in tables]
    kv = init_kv_pages(1, HKV, D, nxt + 1, BS, jnp.float32)[0]
    kv = LayerKV(jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32),
                 jnp.asarray(rng.standard_normal(kv.v.shape), jnp.float32))
    rows = [StepRow(c, n, tab) for (c, n), tab in zip(rows_spec, tables)]
    meta = build_attention_metadata(rows, BS, t, s, MAX_BLOCKS)
    n_tok = sum(n for _, n in rows_spec)
    pos = np.zeros(t, np.int32)
    pos[:n_tok] = np.concatenate([np.arange(c, c + n) for c, n in rows_spec])
    # the previous metadata: tables as wide as the cached blocks' power-of-4 bucket, one prior slot per
    # continuation chunk (its scheduler allowed one per step; here it gets as many as the case has)
    b_prev = _pow4_bucket(max(1, max(-(-c // BS) for c, _ in rows_spec)))
    prior = [i for i, (c, n) in enumerate(rows_spec) if c > 0 and n > 1] or [-1]
    prev = PreviousMetadata(meta.seq_ids, meta.slot_mapping, meta.block_tables[:, :b_prev].copy(),
                            meta.context_lens, meta.query_start_loc, np.asarray(prior, np.int32))
    q = rng.standard_normal((t, H, D)).astype(np.float32)
    k = rng.standard_normal((t, HKV, D)).astype(np.float32)
    v = rng.standard_normal((t, HKV, D)).astype(np.float32)
    return q, k, v, kv, pos, meta, prev, rows


def _meta_with_keys(rows, t, keys: int):
    """The same step's metadata with `keys` keys per work item."""
    return build_attention_metadata(rows, BS, t, min(t, 64), MAX_BLOCKS, keys_per_item=keys)


def _with_group(meta, group: tuple[int, int] | None):
    """Item arrays re-padded for `group` items per iteration; None: cut to the next power of two of
    the real items (>= 64) and done in one pass (the flat segment-softmax layout with its own bucket)."""
    s, nt = meta.decode_tokens.shape[0], meta.chunk_tiles.shape[0]
    out = {}
    for name, dummy, n, gr in (("decode_items", s, meta.num_items[0], group and group[0]),
                               ("chunk_items", nt, meta.num_items[1], group and group[1])):
        items = getattr(meta, name)[: int(n)]
        size = max(64, 1 << int(max(n, 1) - 1).bit_length()) if group is None else -(-max(n, 1) // gr) * gr
        pad = np.zeros((size - len(items), items.shape[1]), np.int32)
        pad[:, 0] = dummy
        out[name] = np.concatenate([items, pad])
    if group is None:   # every item, padding included (harmless: the dummy tile), in one pass
        out["num_items"] = np.asarray([len(out["decode_items"]), len(out["chunk_items"])], np.int32)
    return dataclasses.replace(meta, **out)


def _new_step(q, k, v, kv, positions, meta, group):
    """Today's attention with `group` = (decode, chunk) work items per loop iteration."""
    return attention(q, k, v, positions, scale=D ** -0.5, kv=kv, meta=meta, impl="xla", item_groups=group)


def run_case(rng, rows_spec, t, reps, groups, keys):
    q, k, v, kv, pos, meta, prev, rows = build(rng, rows_spec, t)
    variants = {"previous": (_previous_step, prev)}
    for kpi in keys:
        m = meta if kpi == kvc.KEYS_PER_ITEM else _meta_with_keys(rows, t, kpi)
        for g in groups:
            name = f"items_{kpi}keys_" + (f"groups{g[0]}/{g[1]}" if g else "flat_pow2")
            # flat (g None): every item in one loop iteration
            variants[name] = (functools.partial(_new_step, group=g or (1 << 30, 1 << 30)), _with_group(m, g))
    fns, outs = {}, {}
    for name, (fn, m) in variants.items():
        f = jax.jit(fn, donate_argnums=(3,))
        t0 = time.perf_counter()
        out, kv = f(q, k, v, kv, pos, m)
        out.block_until_ready()
        compile_s = time.perf_counter() - t0
        fns[name] = (f, m, compile_s)
        outs[name] = np.asarray(out)
    n_tok = sum(n for _, n in rows_spec)
    ref = outs["previous"][:n_tok]
    times = {name: [] for name in variants}
    for _ in range(reps):                          # interleaved: other processes' load hits all alike
        for name, (f, m, _) in fns.items():
            t0 = time.perf_counter()
            out, kv = f(q, k, v, kv, pos, m)
            out.block_until_ready()
            times[name].append(time.perf_counter() - t0)
    result = {}
    for name in variants:
        err = float(np.linalg.norm(outs[name][:n_tok] - ref) / np.linalg.norm(ref))
        result[name] = {"median_ms": 1e3 * float(np.median(times[name])), "min_ms": 1e3 * min(times[name]),
                        "first_call_s": fns[name][2], "rel_err_vs_previous": err}
    result["num_items_decode_chunk"] = [int(x) for x in meta.num_items]
    result["tokens"], result["bucket"] = n_tok, t
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--groups", default="16/8,8/4,32/16,flat", help="decode/chunk items per iteration, or flat")
    ap.add_argument("--keys", default="64,16", help="keys per work item (the first is today's)")
    ap.add_argument("--cases", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    groups = [None if g == "flat" else tuple(int(x) for x in g.split("/")) for g in args.groups.split(",")]
    rng = np.random.default_rng(0)
    report = {"device": device_info(), "reps": args.reps, "chosen": f"items_{kvc.KEYS_PER_ITEM}keys_groups"
              f"{kvc.DECODE_GROUP}/{kvc.CHUNK_GROUP}", "shapes": dict(heads=H, kv_heads=HKV, head_dim=D,
              block_size=BS, max_model_len=MAX_MODEL_LEN, dtype="float32"), "points": []}
    for name, (rows_spec, t) in cases(rng).items():
        if args.cases and name not in args.cases.split(","):
            continue
        res = run_case(rng, rows_spec, t, args.reps, groups, [int(x) for x in args.keys.split(",")])
        report["points"].append({"case": name, **res})
        print(name, {k: (round(v["median_ms"], 3) if isinstance(v, dict) else v) for k, v in res.items()},
              flush=True)
    out = results_path(args.out, device_slug(report["device"]), "attention-xla")
    write_report(report, out, "case", "XLA paged attention", plot=False)
    print("wrote", out)


if __name__ == "__main__":
    main()
