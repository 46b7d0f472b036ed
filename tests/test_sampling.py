"""jaxinfer.sampling.sample against independent numpy statements of each definition.

Shapes are fixed so `jax.jit(sample)` compiles twice in all: one big batch (N_BIG rows) that holds
every statistical block (many rows, same logits, different seeds) and the determinism blocks, and a
small batch (N_SMALL rows) for the exact penalty / temperature / greedy / top-20 checks.
"""
from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from scipy import stats

from jaxinfer.sampling import MAX_LOGPROBS, SamplingBatch, apply_penalties, sample, truncate

V = 32            # vocabulary
H = 16            # history length (prompt + output, -1 padded)
N_SMALL = 8
DRAWS = 2000      # draws per statistical block
P_FLOOR = 1e-4    # chi-square p-value below which a distribution check fails

_sample = jax.jit(sample)


# ----------------------------------------------------------------------------- numpy references

def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def np_softmax(x):
    return np.exp(np_log_softmax(x))


def numpy_penalties(logits, prompt, output, r, p, f):
    """vLLM / HF penalties on one row of logits.

    repetition r: every token of prompt ∪ output, once: logit / r if logit > 0 else logit * r;
    frequency f: minus f * (occurrences of the token in the output);
    presence p: minus p for each distinct token of the output.
    """
    out = np.array(logits, np.float64, copy=True)
    for t in set(prompt) | set(output):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in output:
        out[t] -= f
    for t in set(output):
        out[t] -= p
    return out


def np_truncated_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=1e-3):
    """The renormalised distribution after min-p, then top-k, then top-p on softmax(logits / T)
    (vLLM v1's order: min-p before top-k / top-p, top-p's mass over what the others kept).

    Asserts that no cutoff sits within `margin` of a boundary, so float32 vs float64 cannot
    disagree about which tokens are kept.
    """
    p = np_softmax(np.asarray(logits, np.float64) / temperature)
    keep = np.ones(len(p), bool)
    if min_p > 0:
        ratio = p / p.max()
        assert np.min(np.abs(np.log(ratio / min_p))) > margin, "min-p cutoff too close to a boundary"
        keep &= ratio >= min_p
    order = [i for i in np.argsort(-p, kind="stable") if keep[i]]
    k = len(order) if top_k <= 0 else min(top_k, len(order))
    order = order[:k]
    keep[:] = False
    keep[order] = True
    if top_p < 1.0:
        q = p[order] / p[order].sum()                     # renormalised over the kept set
        cs = np.cumsum(q)
        assert np.min(np.abs(cs - top_p)) > margin, "top-p cutoff too close to a boundary"
        m = int(np.argmax(cs >= top_p)) + 1               # smallest prefix whose mass >= top_p
        keep[:] = False
        keep[order[:m]] = True
    out = np.where(keep, p, 0.0)
    return out / out.sum()


# ----------------------------------------------------------------------------- batch helpers

def make_batch(n, **fields):
    """SamplingBatch of n rows with neutral defaults; scalars in `fields` are broadcast."""
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0, seed=0, sample_index=0, position=0,
                    num_logprobs=20)
    dtypes = dict(top_k=np.int32, sample_index=np.int32, position=np.int32, seed=np.uint32, num_logprobs=np.int32)
    arrays = {}
    for name, default in defaults.items():
        val = fields.pop(name, default)
        arrays[name] = np.broadcast_to(np.asarray(val, dtypes.get(name, np.float32)), (n,)).copy()
    arrays["history"] = np.asarray(fields.pop("history", np.full((n, H), -1)), np.int32)
    arrays["history_is_output"] = np.asarray(fields.pop("history_is_output", np.zeros((n, H), bool)), bool)
    # 32 words: no constraint on any vocabulary up to 1,024 (the sampler reads words [0, ceil(V / 32)))
    arrays["token_mask"] = np.asarray(fields.pop("token_mask", np.full((n, 32), -1)), np.int32)
    arrays["bias_ids"] = np.asarray(fields.pop("bias_ids", np.full((n, 4), -1)), np.int32)
    arrays["bias_values"] = np.asarray(fields.pop("bias_values", np.zeros((n, 4))), np.float32)
    arrays["stop_ban"] = np.asarray(fields.pop("stop_ban", np.full((n, 2), -1)), np.int32)
    arrays["min_pos"] = np.asarray(fields.pop("min_pos", np.zeros(n)), np.int32)
    arrays["bad_words"] = np.asarray(fields.pop("bad_words", np.full((n, 1, 2), -1)), np.int32)
    arrays["grammar_rows"] = np.broadcast_to(np.asarray(fields.pop("grammar_rows", False), bool), (n,)).copy()
    mode = fields.pop("logprobs_mode", "raw_logprobs")
    assert not fields, f"unknown fields {sorted(fields)}"
    assert arrays["history"].shape == (n, H)
    return SamplingBatch(**arrays, logprobs_mode=mode)


def history_row(prompt, output):
    ids = list(prompt) + list(output)
    assert len(ids) <= H
    hist = np.full(H, -1, np.int32)
    hist[:len(ids)] = ids
    is_out = np.zeros(H, bool)
    is_out[len(prompt):len(ids)] = True
    return hist, is_out


def run(logits, batch):
    ids, lp, top_ids, top_lp = _sample(jnp.asarray(logits, jnp.float32), batch)
    return np.asarray(ids), np.asarray(lp), np.asarray(top_ids), np.asarray(top_lp)


def check_distribution(ids, expected, label):
    """No draw outside expected's support, every well-populated token drawn, chi-square fit."""
    n = len(ids)
    counts = np.bincount(ids, minlength=len(expected))
    outside = np.nonzero((expected == 0) & (counts > 0))[0]
    assert outside.size == 0, f"{label}: drew tokens {outside.tolist()} outside the allowed set"
    missing = np.nonzero((expected * n >= 15) & (counts == 0))[0]
    assert missing.size == 0, f"{label}: allowed tokens {missing.tolist()} never drawn"
    exp = expected * n
    big = exp >= 5
    obs_b = list(counts[big])
    exp_b = list(exp[big])
    small = (~big) & (expected > 0)
    if small.any():                                          # pool sparse tokens into one bin
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    obs_b, exp_b = np.asarray(obs_b, float), np.asarray(exp_b, float)
    if len(obs_b) < 2:
        return
    chi2 = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    pval = float(stats.chi2.sf(chi2, len(obs_b) - 1))
    assert pval > P_FLOOR, (f"{label}: frequencies {np.round(counts / n, 3).tolist()} vs "
                            f"expected {np.round(expected, 3).tolist()} (chi2={chi2:.1f}, p={pval:.2g})")


# ----------------------------------------------------------------------------- shared logits

# Fixed logits with no truncation cutoff near a boundary for the parameters used below
# (np_truncated_probs asserts it).
L = (np.random.default_rng(6).standard_normal(V) * 1.5).astype(np.float32)
L_FLAT = (np.random.default_rng(1).standard_normal(V) * 0.3).astype(np.float32)

# name -> (rows, logits, sampling params, seed base); seeds differ per row
STAT_BLOCKS = {
    "temperature": (DRAWS, L, dict(temperature=0.7), 10_000),
    "top_k": (DRAWS, L, dict(top_k=5), 20_000),
    "top_k1": (DRAWS, L, dict(temperature=1.3, top_k=1), 30_000),
    "top_p": (DRAWS, L, dict(temperature=0.6, top_p=0.8), 40_000),
    "min_p": (DRAWS, L, dict(temperature=1.5, min_p=0.1), 50_000),
    "combined": (DRAWS, L, dict(top_k=8, top_p=0.7, min_p=0.05), 4_290_000_000),   # seeds > 2**31
}
DET_SEED = 77
DET_BLOCKS = {   # 200 rows each, same seed, varying position / sample_index, near-uniform logits
    "positions": dict(sample_index=np.zeros(200), position=np.arange(200)),
    "indices": dict(sample_index=np.arange(200), position=np.full(200, 5)),
}


@pytest.fixture(scope="module")
def big():
    """One sample() call over every block; returns name -> (ids, logprobs, top_ids, top_lps, params)."""
    logits, cols, spans = [], {}, {}
    start = 0

    def add(name, n, row_logits, params):
        nonlocal start
        logits.append(np.broadcast_to(row_logits, (n, V)))
        for key, val in params.items():
            cols.setdefault(key, []).append((start, n, val))
        spans[name] = (start, start + n)
        start += n

    for name, (n, row_logits, params, seed_base) in STAT_BLOCKS.items():
        add(name, n, row_logits, dict(params, seed=seed_base + np.arange(n), position=3))
    for name, params in DET_BLOCKS.items():
        add(name, 200, L_FLAT, dict(params, seed=DET_SEED))
    n_big = start
    fields = {}
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, sample_index=0, position=0)
    for key, parts in cols.items():
        col = np.full(n_big, defaults[key], np.float64)
        for s, n, val in parts:
            col[s:s + n] = val
        fields[key] = col
    out = run(np.concatenate(logits).astype(np.float32), make_batch(n_big, **fields))
    return {name: tuple(o[a:b] for o in out) + (STAT_BLOCKS.get(name, (0, 0, {}))[2],)
            for name, (a, b) in spans.items()}


# ----------------------------------------------------------------------------- statistical tests

def test_temperature_sampling_matches_softmax(big):
    ids, lp, *_ = big["temperature"]
    check_distribution(ids, np_softmax(L / 0.7), "temperature 0.7")


def test_top_k_1_is_greedy_for_every_seed(big):
    ids, lp, *_ = big["top_k1"]
    assert np.all(ids == np.argmax(L)), np.unique(ids)
    np.testing.assert_allclose(lp, np_log_softmax(L)[np.argmax(L)], atol=1e-5)     # raw: before T and top-k


def test_top_k(big):
    ids, *_ = big["top_k"]
    expected = np_truncated_probs(L, top_k=5)
    assert set(np.unique(ids)) == set(np.argsort(-L)[:5])
    check_distribution(ids, expected, "top_k=5")


def test_top_p_on_tempered_distribution(big):
    ids, *_ = big["top_p"]
    expected = np_truncated_probs(L, temperature=0.6, top_p=0.8)
    # the set differs from the one the untempered distribution would give: order matters
    assert (expected > 0).sum() != (np_truncated_probs(L, top_p=0.8) > 0).sum()
    check_distribution(ids, expected, "T=0.6 top_p=0.8")


def test_min_p_on_tempered_distribution(big):
    ids, *_ = big["min_p"]
    expected = np_truncated_probs(L, temperature=1.5, min_p=0.1)
    assert (expected > 0).sum() != (np_truncated_probs(L, min_p=0.1) > 0).sum()
    check_distribution(ids, expected, "T=1.5 min_p=0.1")


def test_min_p_then_top_k_then_top_p(big):
    ids, *_ = big["combined"]
    expected = np_truncated_probs(L, top_k=8, top_p=0.7, min_p=0.05)
    check_distribution(ids, expected, "top_k=8 top_p=0.7 min_p=0.05")


def test_min_p_runs_before_top_p_as_in_vllm():
    """vLLM v1 applies min-p (an argmax-invariant processor) before top-k / top-p. By hand, for
    probabilities [.5, .3, .1, .05, .05], top_p 0.6, min_p 0.3: min-p keeps p >= 0.15, {0, 1}
    renormalised to [.625, .375]; top-p 0.6 then keeps {0}. (HF's order, top-p on the whole
    distribution first, keeps {0, 1}: what this sampler did.)"""
    from jaxinfer.sampling import truncate_sorted
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.1, 0.05, 0.05]] * 2, jnp.float32))
    b = make_batch(2, top_p=np.array([0.6, 0.6]), min_p=np.array([0.3, 0.0]))
    for fn in (truncate, truncate_sorted):
        kept = np.isfinite(np.asarray(jax.jit(fn)(logits, b)))
        assert kept[0].tolist() == [True, False, False, False, False], fn.__name__
        assert kept[1].tolist() == [True, True, False, False, False], fn.__name__   # top-p alone: .5 + .3 >= .6


@pytest.mark.parametrize("name", list(STAT_BLOCKS))
def test_raw_logprobs_whatever_the_processing(big, name):
    """logprobs_mode raw_logprobs (vLLM's default): the chosen and top-20 logprobs are
    log_softmax(logits), whatever the temperature and truncation."""
    ids, lp, top_ids, top_lp, params = big[name]
    ref = np_log_softmax(L)
    np.testing.assert_allclose(lp, ref[ids], atol=1e-5)
    order = np.argsort(-ref)[:MAX_LOGPROBS]
    assert np.all(top_ids == order[None, :])
    np.testing.assert_allclose(top_lp, np.broadcast_to(ref[order], top_lp.shape), atol=1e-5)


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "combined"])
def test_processed_logprobs_are_the_distribution_drawn_from(name):
    """logprobs_mode processed_logprobs: log of the tempered, truncated distribution (numpy's
    np_truncated_probs), the tokens cut at -inf; processed_logits: the tempered logits, cut tokens
    -inf; raw_logits: the logits as given."""
    _, _, params, seed = STAT_BLOCKS[name]
    n = 16
    want = np_truncated_probs(L, **{k: params[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in params})
    kept = want > 0
    ids, lp, top_ids, top_lp = run(np.broadcast_to(L, (n, V)), make_batch(
        n, **params, seed=seed + np.arange(n), logprobs_mode="processed_logprobs"))
    assert np.all(kept[ids])
    np.testing.assert_allclose(lp, np.log(want[ids]), atol=1e-5)
    m = int(kept.sum())
    order = np.argsort(-want)[:min(m, MAX_LOGPROBS)]
    assert np.all(top_ids[:, :len(order)] == order[None, :])
    np.testing.assert_allclose(top_lp[:, :len(order)], np.broadcast_to(np.log(want[order]), (n, len(order))), atol=1e-5)
    assert np.all(np.isneginf(top_lp[:, len(order):]))
    t = params.get("temperature", 1.0)
    for mode, ref in (("processed_logits", np.where(kept, L / t, -np.inf)), ("raw_logits", L)):
        ids, lp, top_ids, top_lp = run(np.broadcast_to(L, (n, V)), make_batch(
            n, **params, seed=seed + np.arange(n), logprobs_mode=mode))
        np.testing.assert_allclose(lp, ref[ids], rtol=1e-6, err_msg=mode)
        np.testing.assert_allclose(top_lp[:, :len(order)], np.broadcast_to(ref[order], (n, len(order))), rtol=1e-6,
                                   err_msg=mode)


# ----------------------------------------------------------------------------- determinism

def test_draws_vary_with_position_and_sample_index(big):
    for name in DET_BLOCKS:
        ids = big[name][0]
        assert len(np.unique(ids)) >= 10, (name, np.unique(ids))
        # near-uniform logits: the 200 draws look like 200 independent draws
        check_distribution(ids, np_softmax(L_FLAT), f"seed fixed, {name} varying")
    assert not np.array_equal(big["positions"][0], big["indices"][0])


def test_draw_depends_only_on_seed_index_position(big):
    """The same (seed, sample_index, position, logits, params) gives the same token in any row of
    any batch, whatever the other rows do (penalties, truncation, greedy)."""
    pos_ids = big["positions"][0]
    idx_ids = big["indices"][0]
    picks = [(0, 17), (0, 42), (0, 199), (1, 3), (1, 150)]   # (block, row)
    rng = np.random.default_rng(0)
    for perm in range(3):
        rows = rng.permutation(N_SMALL)
        logits = rng.standard_normal((N_SMALL, V)).astype(np.float32) * 2
        temperature = rng.choice([0.0, 0.5, 1.0], N_SMALL)
        top_k = rng.choice([0, 3], N_SMALL)
        rep = rng.choice([1.0, 1.4], N_SMALL)
        seed = rng.integers(0, 2**32, N_SMALL)
        sample_index = rng.integers(0, 200, N_SMALL)
        position = rng.integers(0, 200, N_SMALL)
        history = rng.integers(-1, V, (N_SMALL, H))
        is_out = rng.random((N_SMALL, H)) < 0.5
        expected = {}
        for (block, j), r in zip(picks, rows):
            logits[r] = L_FLAT
            temperature[r], top_k[r], rep[r], seed[r] = 1.0, 0, 1.0, DET_SEED
            sample_index[r], position[r] = (0, j) if block == 0 else (j, 5)
            expected[r] = (pos_ids if block == 0 else idx_ids)[j]
        batch = make_batch(N_SMALL, temperature=temperature, top_k=top_k, repetition_penalty=rep, seed=seed,
                           sample_index=sample_index, position=position, history=history,
                           history_is_output=is_out)
        ids = run(logits, batch)[0]
        for r, tok in expected.items():
            assert ids[r] == tok, (perm, r, ids[r], tok)


# ----------------------------------------------------------------------------- exact small-batch checks

def _penalty_case():
    """8 rows with different params in one batch; returns logits, batch, per-row (prompt, output, r, p, f, T)."""
    rng = np.random.default_rng(123)
    logits = (rng.standard_normal((N_SMALL, V)) * 2).astype(np.float32)
    rows = []
    for i in range(N_SMALL):
        order = np.argsort(-logits[i])
        pos_tok, neg_tok = order[:6], order[-6:]                  # positive and negative logits
        assert logits[i, pos_tok].min() > 0 and logits[i, neg_tok].max() < 0
        # prompt: repeats, tokens shared with the output, negative logits; output: repeats
        prompt = [pos_tok[0], pos_tok[0], pos_tok[1], neg_tok[0], pos_tok[4]]
        output = [pos_tok[1], pos_tok[2], pos_tok[2], pos_tok[2], neg_tok[1], neg_tok[1], pos_tok[3]]
        rows.append([prompt, output])
    #           r     p     f     T
    params = [(1.3, 0.0, 0.0, 1.0),
              (1.0, 0.7, 0.0, 1.0),
              (1.0, 0.0, 0.4, 1.0),
              (1.5, 0.5, 0.3, 1.0),
              (0.8, -0.4, -0.2, 1.0),      # r < 1 and negative penalties (allowed by vLLM)
              (1.0, 0.0, 0.0, 1.0),        # no penalties, non-empty history
              (1.2, 1.1, 0.6, 0.0),        # greedy, penalised
              (1.0, 0.0, 0.0, 0.0)]        # greedy, no penalties
    hist, is_out = zip(*(history_row(p, o) for p, o in rows))
    r, p, f, t = (np.array(c) for c in zip(*params))
    batch = make_batch(N_SMALL, temperature=t, repetition_penalty=r, presence_penalty=p, frequency_penalty=f,
                       seed=np.arange(N_SMALL) + 5, position=9, history=np.stack(hist),
                       history_is_output=np.stack(is_out))
    cases = [(pr, out, *prm) for (pr, out), prm in zip(rows, params)]
    return logits, batch, cases


def test_numpy_penalties_reference():
    """Sanity of the reference itself on a hand-computed row."""
    got = numpy_penalties(np.array([2.0, -1.0, 3.0, 0.5]), prompt=[0, 0, 1], output=[2, 2, 0], r=2.0, p=0.5, f=0.25)
    np.testing.assert_allclose(got, [2.0 / 2 - 0.25 - 0.5, -1.0 * 2, 3.0 / 2 - 0.5 - 0.5, 0.5])


def test_penalties_row_independent():
    logits, batch, cases = _penalty_case()
    # processed logprobs show the penalties (raw ones would not): no row truncates
    ids, lp, top_ids, top_lp = run(logits, SamplingBatch(**batch.arrays(), logprobs_mode="processed_logprobs"))
    for i, (prompt, output, r, p, f, t) in enumerate(cases):
        pen = numpy_penalties(logits[i], prompt, output, r, p, f)
        if (r, p, f) != (1.0, 0.0, 0.0):
            assert np.abs(pen - logits[i]).max() > 0.1            # the penalty is visible
        ref = np_log_softmax(pen)                                  # T is 1 or greedy -> logprobs at T=1
        order = np.argsort(-ref)[:MAX_LOGPROBS]
        assert list(top_ids[i]) == list(order), i
        np.testing.assert_allclose(top_lp[i], ref[order], atol=1e-5, err_msg=f"row {i}")
        np.testing.assert_allclose(lp[i], ref[ids[i]], atol=1e-5, err_msg=f"row {i}")
        if t == 0:
            assert ids[i] == np.argmax(pen), i


def test_full_penalised_logits():
    """apply_penalties over the whole vocabulary, not just the top 20."""
    logits, batch, cases = _penalty_case()
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), batch))
    for i, (prompt, output, r, p, f, _) in enumerate(cases):
        np.testing.assert_allclose(got[i], numpy_penalties(logits[i], prompt, output, r, p, f), atol=1e-5,
                                   err_msg=f"row {i}")


def test_temperature_logprobs_and_top20():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((N_SMALL, V)) * 3).astype(np.float32)
    temps = np.array([1.0, 0.5, 2.5, 0.05, 1.7, 0.0, 3.0, 0.8], np.float32)
    ids, lp, top_ids, top_lp = run(logits, make_batch(N_SMALL, temperature=temps, seed=np.arange(N_SMALL),
                                                      logprobs_mode="processed_logprobs"))
    for i, t in enumerate(temps):      # processed: the tempered distribution (no truncation here)
        ref = np_log_softmax(logits[i].astype(np.float64) / (t if t > 0 else 1.0))
        order = np.argsort(-ref)[:MAX_LOGPROBS]
        assert list(top_ids[i]) == list(order), i
        assert np.all(np.diff(top_lp[i]) <= 0)
        np.testing.assert_allclose(top_lp[i], ref[order], atol=1e-4, rtol=1e-5, err_msg=f"row {i}")
        np.testing.assert_allclose(lp[i], ref[ids[i]], atol=1e-4, rtol=1e-5, err_msg=f"row {i}")
    assert ids[5] == np.argmax(logits[5])


def test_greedy_ignores_truncation_and_uses_penalised_argmax():
    """Greedy rows with top-k / top-p / min-p set, next to sampled rows that truncate."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((N_SMALL, V)) * 2).astype(np.float32)
    hists, outs, cases = [], [], []
    for i in range(N_SMALL):
        top = int(np.argmax(logits[i]))
        prompt, output = [top, 3], [top, top, 7]                  # penalise the raw argmax
        h, o = history_row(prompt, output)
        hists.append(h)
        outs.append(o)
        cases.append((prompt, output))
    temps = np.array([0, 0, 0, 0, 1.0, 0.7, 0, 1.2], np.float32)
    top_k = np.array([3, 0, 1, 2, 4, 0, 5, 2], np.int32)
    top_p = np.array([1.0, 0.3, 0.9, 0.5, 0.9, 0.6, 0.2, 1.0], np.float32)
    min_p = np.array([0.0, 0.0, 0.5, 0.3, 0.0, 0.2, 0.9, 0.1], np.float32)
    rep, pres, freq = 1.3, 0.8, 0.9
    ids, lp, top_ids, top_lp = run(logits, make_batch(
        N_SMALL, temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
        presence_penalty=pres, frequency_penalty=freq, seed=np.arange(N_SMALL) * 3 + 1, position=4,
        history=np.stack(hists), history_is_output=np.stack(outs), logprobs_mode="processed_logprobs"))
    flipped = 0
    for i in range(N_SMALL):
        pen = numpy_penalties(logits[i], *cases[i], rep, pres, freq)
        t = temps[i] if temps[i] > 0 else 1.0
        # processed: a greedy row's penalised distribution, untruncated (vLLM turns truncation off
        # for greedy rows); a sampled row's truncated one
        probs = np_truncated_probs(pen, t, top_k[i], top_p[i], min_p[i]) if temps[i] > 0 else np.exp(np_log_softmax(pen))
        np.testing.assert_allclose(lp[i], np.log(probs[ids[i]]), atol=1e-5, err_msg=f"row {i}")
        if temps[i] == 0:
            assert ids[i] == np.argmax(pen), i
            flipped += np.argmax(pen) != np.argmax(logits[i])
        else:   # sampled rows stay inside their truncated set
            assert np_truncated_probs(pen, t, top_k[i], top_p[i], min_p[i], margin=0)[ids[i]] > 0, i
    assert flipped >= 3                                         # penalties were applied before the argmax


def test_greedy_repeatable_for_any_seed():
    logits = np.broadcast_to(L, (N_SMALL, V))
    for seeds in (np.arange(N_SMALL), np.arange(N_SMALL) + 2**31 + 17):
        ids, *_ = run(logits, make_batch(N_SMALL, temperature=0.0, top_k=4, top_p=0.5, seed=seeds,
                                         sample_index=np.arange(N_SMALL), position=np.arange(N_SMALL) * 7))
        assert np.all(ids == np.argmax(L))


# ----------------------------------------------------------------------------- top_p = 1 means off

def test_top_p_one_masks_nothing_in_a_truncating_batch():
    rng = np.random.default_rng(0)
    v = 32000
    logits = (rng.standard_normal((2, v)) * 8).astype(np.float32)
    b = make_batch(2, top_k=np.array([5, 0]))
    b.history, b.history_is_output = np.full((2, 1), -1, np.int32), np.zeros((2, 1), bool)
    filtered = np.asarray(truncate(jnp.asarray(logits), b))
    assert np.isinf(filtered[0]).sum() == v - 5                 # the top-k row is truncated
    assert np.all(np.isfinite(filtered[1])), f"{np.isinf(filtered[1]).sum()} tokens masked with top_p=1"


# ------------------------------------------------------------- truncation from the top 256 candidates

def test_truncation_from_top_candidates_matches_numpy_and_falls_back_past_them():
    """truncate() reads each row's top 256 logits (lax.top_k) and takes the full sort when a cut lies
    past them; either way it keeps exactly the set numpy's definition keeps, at V = 1000."""
    from jaxinfer.sampling import TOP_CANDIDATES, truncate_sorted
    rng = np.random.default_rng(1)    # a seed whose cuts all sit >= 4e-4 from a boundary
    v = 1000
    assert v > TOP_CANDIDATES
    peaked = rng.standard_normal(v) * 4.0
    flat = rng.standard_normal(v) * 0.05
    cases = [  # (logits, top_k, top_p, min_p): inside the candidates ...
        (peaked, 0, 0.9, 0.0), (peaked, 40, 1.0, 0.0), (peaked, 40, 0.8, 0.02), (peaked, 0, 1.0, 0.1),
        (peaked, 256, 0.95, 0.0), (flat, 10, 1.0, 0.0),
        # ... and past them: the k-th largest of 300, and a top-p set wider than 256 tokens
        (peaked, 300, 1.0, 0.0), (flat, 0, 0.5, 0.0)]
    for group in (cases[:6], cases):     # a batch that stays on the candidates, one that falls back
        logits = np.stack([c[0] for c in group]).astype(np.float32)
        b = make_batch(len(group), top_k=np.array([c[1] for c in group]), top_p=np.array([c[2] for c in group]),
                       min_p=np.array([c[3] for c in group]))
        kept = np.isfinite(np.asarray(jax.jit(truncate)(jnp.asarray(logits), b)))
        kept_sorted = np.isfinite(np.asarray(jax.jit(truncate_sorted)(jnp.asarray(logits), b)))
        for i, (lg, k, p, mp) in enumerate(group):
            # margin: float32 cumsum over <= 1000 terms is off by < 1000 * 2**-24 ~ 6e-5
            expected = np_truncated_probs(lg, top_k=k, top_p=p, min_p=mp, margin=1e-4) > 0
            assert np.array_equal(kept[i], expected), (i, kept[i].sum(), expected.sum())
            assert np.array_equal(kept_sorted[i], expected)
    assert expected.sum() > TOP_CANDIDATES     # the last case's set really lies past the candidates
