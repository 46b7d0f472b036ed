"""The jittable sampler: one row per sampled token, each row with its own parameters.

Order of operations per row (vLLM v1's: min-p, an "argmax-invariant" processor there, runs before
top-k / top-p, so top-p's mass is over what min-p kept; HF runs min-p last, a different set where a
row sets min_p with top_p):
  0. logit_bias (OpenAI's: added to the raw logits), then the token mask: tokens the row's grammar
     (a packed bitmask, host/structured.py), its allowed_token_ids or its one-token bad_words do
     not allow become -inf; then vLLM's position-dependent bans: the last token of a multi-token bad
     word where the row's output ends with the rest of it (read from the history), and the row's
     stop ids while it has drawn fewer than min_tokens. Every later rule, the logprobs included,
     sees the constrained distribution;
  1. penalties on the raw logits, from the row's history (prompt + output so far):
     repetition (CTRL: divide positive / multiply negative logits of every seen token),
     frequency (subtract freq * count of the token in the output),
     presence (subtract pres once for every token present in the output);
  2. temperature: logits / T (greedy rows use T = 1);
  3. truncation on the tempered distribution: min-p (keep tokens with p >= min_p * p_max), then
     top-k, then top-p (the smallest set whose mass, renormalised over what min-p and top-k kept,
     reaches p);
  4. draw: Gumbel-max with a key derived only from (seed, sample index, position), so a
     row's draw never depends on what else is in the batch. Greedy rows take the argmax (a batch
     of greedy rows only skips the draw and the truncation).
Logprobs (the drawn token's and the top 20) report what the engine's logprobs_mode says, vLLM's
--logprobs-mode: raw_logprobs (the default), log_softmax of the model's logits as they come, before
step 0 (a grammar row's after its grammar's mask: vLLM applies the bitmask to the logits its sampler
gets; where a row has a grammar and allowed_token_ids or one-token bad words, whose mask is ANDed
into the grammar's, after all three); raw_logits, those logits; processed_logprobs, log_softmax after steps 0-3 (the distribution
drawn from, tokens the truncation cut at -inf; a greedy row's untruncated, at temperature 1);
processed_logits, the logits after steps 0-3.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20
NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device arrays ([N] each; history [N, H])."""
    temperature: jax.Array      # f32; 0 = greedy
    top_k: jax.Array            # i32; 0 = off
    top_p: jax.Array            # f32; 1 = off
    min_p: jax.Array            # f32; 0 = off
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array             # u32: the request's seed (runner.key_seed of larger ones)
    sample_index: jax.Array     # i32: which of the request's n samples this row is
    position: jax.Array         # i32: position of the token being drawn
    num_logprobs: jax.Array     # i32: top logprobs the row wants (0 = none; the step computes
                                #      MAX_LOGPROBS for every row when any row wants some)
    history: jax.Array          # i32 [N, H]: prompt + output ids, -1 padded (penalties only)
    history_is_output: jax.Array  # bool [N, H]
    token_mask: jax.Array       # i32 [N, ceil(V / 32)]: bit j of word w allows token 32 w + j (-1: all)
    bias_ids: jax.Array         # i32 [N, MAX_LOGIT_BIAS]: logit_bias token ids, -1 padded
    bias_values: jax.Array      # f32 [N, MAX_LOGIT_BIAS]
    stop_ban: jax.Array         # i32 [N, MAX_MIN_TOKENS_STOP_IDS]: min_tokens' banned stop ids, -1 padded
    min_pos: jax.Array          # i32 [N]: they are banned while position < min_pos (0: never)
    bad_words: jax.Array        # i32 [N, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS]: multi-token bad
                                #      words, left-padded with -1 (each word's last token in the last column)
    grammar_rows: jax.Array     # bool [N]: the row's token_mask is its grammar's (the raw logprobs come
                                #      after it, as vLLM applies a grammar's bitmask before its sampler)
    # what the logprobs report (module docstring): the engine's setting, static (part of the program)
    logprobs_mode: str = field(default="raw_logprobs", metadata=dict(static=True))

    def arrays(self) -> dict:
        """The per-row arrays by field name (a transform's input: map, gather, repeat them, then
        SamplingBatch(**arrays, logprobs_mode=b.logprobs_mode))."""
        return {k: v for k, v in vars(self).items() if k != "logprobs_mode"}


def row_keys(seed: jax.Array, sample_index: jax.Array, position: jax.Array) -> jax.Array:
    def one(s, i, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), p)
    return jax.vmap(one)(seed, sample_index, position)


def any_penalty(b: SamplingBatch) -> jax.Array:
    """Some row uses a penalty (which reads the history)."""
    return jnp.any((b.repetition_penalty != 1) | (b.presence_penalty != 0) | (b.frequency_penalty != 0))


def reads_history(b: SamplingBatch) -> jax.Array:
    """Some row reads the history: a penalty, or a multi-token bad word (the steps then record what
    each iteration, round or proposal puts before the token being drawn)."""
    return any_penalty(b) | jnp.any(b.bad_words >= 0)


def apply_bad_words(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """-inf on each multi-token bad word's last token where the tokens just before the one being drawn
    (positions position - L + 1 .. position - 1, all of them output, vLLM's rule) are the rest of it."""
    n, v = logits.shape
    lb = b.bad_words.shape[-1]
    prefix = b.bad_words[..., :-1]                                               # [N, B, L-1]
    cols = b.position[:, None] - (lb - 1) + jnp.arange(lb - 1)[None, :]         # [N, L-1]
    inside = cols >= 0
    cols = jnp.clip(cols, 0, b.history.shape[1] - 1)
    seen = jnp.take_along_axis(b.history, cols, axis=1)                          # [N, L-1]
    is_out = jnp.take_along_axis(b.history_is_output, cols, axis=1) & inside
    match = (prefix < 0) | ((prefix == seen[:, None, :]) & is_out[:, None, :])
    hit = jnp.all(match, axis=-1) & (b.bad_words[..., -1] >= 0)                  # [N, B]
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], hit.shape)
    ids = jnp.where(hit, b.bad_words[..., -1], v)                                # no hit -> dropped
    return _unless_empty(logits.at[rows, ids].set(NEG_INF, mode="drop"), logits)


def apply_min_tokens(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """-inf on each row's stop ids while it has drawn fewer than min_tokens (position < min_pos)."""
    n, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], b.stop_ban.shape)
    ids = jnp.where((b.stop_ban >= 0) & (b.position < b.min_pos)[:, None], b.stop_ban, v)
    return _unless_empty(logits.at[rows, ids].set(NEG_INF, mode="drop"), logits)


def _unless_empty(banned: jax.Array, logits: jax.Array) -> jax.Array:
    """A row's bans yield where they would leave it no token (a grammar that allows only a banned
    one, e.g. the EOS that completes it): the row keeps what it had, as Guide.static yields to the
    grammar's mask, instead of drawing from nothing."""
    return jnp.where(jnp.any(banned > NEG_INF, axis=-1, keepdims=True), banned, logits)


def apply_logit_bias(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    n, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], b.bias_ids.shape)
    ids = jnp.where(b.bias_ids >= 0, b.bias_ids, v)                  # padding -> dropped
    return logits.at[rows, ids].add(b.bias_values, mode="drop")


def apply_token_mask(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """Disallowed tokens -> -inf: token t is allowed when bit t % 32 of word t // 32 is set."""
    v = logits.shape[-1]
    t = jnp.arange(v, dtype=jnp.int32)
    bits = jnp.right_shift(b.token_mask[:, t // 32], t % 32) & 1
    return jnp.where(bits != 0, logits, NEG_INF)


def apply_penalties(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    n, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], b.history.shape)
    ids = jnp.where(b.history >= 0, b.history, v)                   # padding -> dropped
    seen = jnp.zeros((n, v), jnp.bool_).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((n, v), jnp.float32).at[rows, ids].add(
        b.history_is_output.astype(jnp.float32), mode="drop")
    rep = b.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - b.frequency_penalty[:, None] * counts
    return logits - b.presence_penalty[:, None] * (counts > 0)


TOP_CANDIDATES = 256   # truncation looks at each row's top 256 logits (lax.top_k), not a full sort


def truncate_sorted(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """Mask (to -inf) the tokens outside each row's min-p / top-k / top-p set: the definition, over
    a full-vocabulary sort."""
    v = logits.shape[-1]
    logits = _min_p(logits, jnp.max(logits, axis=-1, keepdims=True), b)
    sorted_desc = -jnp.sort(-logits, axis=-1)                        # (N, V)
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, NEG_INF, logits)
    sorted_desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], sorted_desc, NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # top-p: keep sorted token i while the mass before it is < p (the top token always stays)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p >= 1 means off: float32 cumsum reaches 1.0 before the tail of a large vocabulary
    keep = (mass_before < b.top_p[:, None]) | (b.top_p[:, None] >= 1.0)
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def _min_p(logits: jax.Array, top: jax.Array, b: SamplingBatch) -> jax.Array:
    """min-p relative to the most likely token: p >= min_p * p_max <=> logit >= max + log(min_p)."""
    floor = jnp.where(b.min_p[:, None] > 0, top + jnp.log(jnp.maximum(b.min_p[:, None], 1e-30)), NEG_INF)
    return jnp.where(logits < floor, NEG_INF, logits)


def truncate(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    """truncate_sorted's result from each row's top TOP_CANDIDATES logits (lax.top_k: 13x faster than
    the sort at 64 x 4096 on XLA:CPU). Exact: top-k needs the k-th largest logit and top-p the point
    where the sorted mass reaches p (normalised over the whole top-k set, as in truncate_sorted); when
    some row's answer lies beyond its candidates (top_k > 256, or a top-p set wider than 256 tokens
    under a flat distribution), the step takes the full sort instead."""
    v = logits.shape[-1]
    c = min(TOP_CANDIDATES, v)
    top_vals = jax.lax.top_k(logits, c)[0]                            # (N, c), descending
    # min-p first (its floor is relative to the row's max, the first candidate), then the rest on
    # what it keeps
    logits = _min_p(logits, top_vals[:, :1], b)
    top_vals = _min_p(top_vals, top_vals[:, :1], b)
    k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, v), v)
    in_k = jnp.arange(c)[None, :] < k[:, None]
    vals = jnp.where(in_k, top_vals, NEG_INF)
    # the top-k set's normaliser: all of it is among the candidates, or top-k is off (the whole vocabulary)
    log_z = jnp.where(k <= c, jax.nn.logsumexp(vals, axis=-1), jax.nn.logsumexp(logits, axis=-1))
    probs = jnp.exp(vals - log_z[:, None])
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    p_off = b.top_p[:, None] >= 1.0
    keep = ((mass_before < b.top_p[:, None]) | p_off).at[:, 0].set(True) & in_k
    kth = jnp.where(k <= c, jnp.take_along_axis(top_vals, jnp.minimum(k, c)[:, None] - 1, axis=-1)[:, 0], NEG_INF)
    cutoff = jnp.maximum(jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1), kth)
    cutoff = jnp.where(p_off[:, 0] & (k >= v), NEG_INF, cutoff)
    # exact when the whole top-k set is among the candidates, or top-k is off and top-p is off or cuts
    # inside them; top-k in (c, v) needs the k-th largest logit (and the top-k set's normaliser)
    p_cut_inside = ~p_off[:, 0] & ~keep[:, -1]
    exact = (k <= c) | ((k >= v) & (p_off[:, 0] | p_cut_inside))
    fast = lambda lg: jnp.where(lg < cutoff[:, None], NEG_INF, lg)  # noqa: E731
    return jax.lax.cond(jnp.all(exact), fast, lambda lg: truncate_sorted(lg, b), logits)


def process(logits: jax.Array, b: SamplingBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps 0-3 of the module docstring: logits [N, V] -> (tempered logits, logprobs as
    b.logprobs_mode says, truncated logits). Greedy rows take the argmax of the tempered logits
    (temperature 1 for them)."""
    raw = logits
    unchanged = lambda l, _: l  # noqa: E731
    logits = jax.lax.cond(jnp.any(b.bias_ids >= 0), apply_logit_bias, unchanged, logits, b)
    logits = jax.lax.cond(jnp.any(b.token_mask != -1), apply_token_mask, unchanged, logits, b)
    logits = jax.lax.cond(jnp.any(b.bad_words >= 0), apply_bad_words, unchanged, logits, b)
    logits = jax.lax.cond(jnp.any(b.position < b.min_pos), apply_min_tokens, unchanged, logits, b)
    logits = jax.lax.cond(any_penalty(b), apply_penalties, unchanged, logits, b)
    greedy = b.temperature <= 0
    logits = logits / jnp.where(greedy, 1.0, b.temperature)[:, None]
    any_truncation = jnp.any(((b.top_k > 0) | (b.top_p < 1) | (b.min_p > 0)) & ~greedy)
    filtered = jax.lax.cond(any_truncation, truncate, lambda l, _: l, logits, b)
    if b.logprobs_mode.startswith("raw"):   # a grammar row's after its grammar's mask (vLLM's order)
        reported = jax.lax.cond(jnp.any(b.grammar_rows),
                                lambda r: jnp.where(b.grammar_rows[:, None], apply_token_mask(r, b), r), lambda r: r, raw)
    else:   # greedy rows are not truncated (vLLM turns top-k / top-p / min-p off for them)
        reported = jnp.where(greedy[:, None], logits, filtered)
    logprobs = jax.nn.log_softmax(reported, axis=-1) if b.logprobs_mode.endswith("logprobs") else reported
    return logits, logprobs, filtered


def gumbel_draw(filtered: jax.Array, keys: jax.Array) -> jax.Array:
    """Gumbel-max: one draw per row from softmax(filtered) [N, V] with the rows' keys."""
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)


def top_logprobs(logprobs: jax.Array, b: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """(top ids [N, 20], their logprobs [N, 20]) when some row asked for them, else zeros."""
    no_top = lambda lp: (jnp.zeros((lp.shape[0], MAX_LOGPROBS), jnp.float32),  # noqa: E731
                         jnp.zeros((lp.shape[0], MAX_LOGPROBS), jnp.int32))
    top_lp, top_ids = jax.lax.cond(jnp.any(b.num_logprobs > 0),
                                   lambda lp: tuple(jax.lax.top_k(lp, MAX_LOGPROBS)), no_top, logprobs)
    return top_ids.astype(jnp.int32), top_lp


def sample(logits: jax.Array, b: SamplingBatch) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [N, V] f32 -> (token ids [N], their logprobs [N], top ids [N, 20], top logprobs [N, 20])."""
    logits, logprobs, filtered = process(logits, b)
    greedy = b.temperature <= 0
    # an all-greedy batch skips the draw: the Gumbel noise (threefry over the whole vocabulary per
    # row) is the sampler's largest cost on CPU
    drawn = jax.lax.cond(jnp.any(~greedy), lambda f: gumbel_draw(f, row_keys(b.seed, b.sample_index, b.position)),
                         lambda f: jnp.zeros(f.shape[:1], jnp.int32), filtered)
    ids = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    return (ids, chosen, *top_logprobs(logprobs, b))
