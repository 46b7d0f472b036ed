"""Exact verification of speculative proposals on the device, whichever proposer made them (the
draft model: draft_model.py; n-gram prompt lookup: ngram.py; Medusa trees: medusa.py, which
verifies a tree with `expand_paths` from here).

A speculating row of a step holds 1 + k tokens: its last drawn token t0 (position p) and k proposed
tokens d_1..d_k (positions p + 1 .. p + k). The target computes logits at all 1 + k positions in
one forward; `verify` then decides, position by position, with the rejection rule of Leviathan et
al. 2023 / Chen et al. 2023:
  - p_j: the target's distribution for position p + j + 1 after every sampling processor (logit
    bias, the grammar's mask after t0, d_1..d_j, penalties over the history *including d_1..d_j*, temperature, top-k /
    top-p / min-p), exactly what `sampling.sample` would draw from there;
  - q_j: the distribution d_{j+1} was drawn from, after the same processors (draft model), or the
    one-hot of d_{j+1} (n-gram lookup, any host-side proposer);
  - accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); at the first rejection draw from
    norm(max(0, p_j - q_j)) and stop; when all k are accepted draw a bonus token from p_k.
The tokens so emitted are distributed exactly as the target's own samples, for any proposer
(a garbage proposer only lowers the acceptance). Greedy rows (temperature 0) accept d exactly when
it is the target's argmax and emit the argmax at the first mismatch: the output is the plain
greedy output token for token.

Randomness: every draw is keyed by (seed, sample index, position) as in `sampling.sample`, with a
tag per use (acceptance, the draft's own draw), so a seeded request is reproducible and does not
depend on the other rows of the batch. The residual and bonus draws use the untagged key, so a row
with no proposals draws exactly what `sample` draws. Each position is decided in one round only,
and the uniforms and draft noise of positions after a rejection never influenced anything
emitted, so re-using their keys in the next round keeps the draws independent.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import NEG_INF, SamplingBatch, gumbel_draw, process, reads_history, row_keys, top_logprobs

ACCEPT_TAG = 1   # fold_in tag of the acceptance uniforms (draft_model.DRAFT_TAG: the draft's own draws)


def expand_paths(b: SamplingBatch, node_tokens: jax.Array, depth: np.ndarray, path_nodes: np.ndarray,
                 num_spec: jax.Array, row_of: jax.Array, node_of: jax.Array, node_masks: jax.Array | None = None,
                 mask_slot: jax.Array | None = None) -> SamplingBatch:
    """The batch of M logits rows of a step that verifies proposals laid out as a tree (a chain is a
    tree whose node j is d_j): row m belongs to batch row row_of[m] and is its node node_of[m] (0:
    the token before the proposals; -1: no node, e.g. a prefill token). It draws the token after
    that node (position b.position[row] + depth[node]); for penalties its history holds the
    proposals on the node's path, node_tokens[row, path_nodes[node, 1:] - 1], at positions
    b.position[row] + 0, 1, ... (only nodes 1 .. num_spec[row] are proposals).
    depth [N+1], path_nodes [N+1, D+1]: the tree's tables (medusa.tree_arrays; -1 past a node's depth).
    Grammars: node_masks [C, N, W], mask_slot [S] (-1: none): a row with a slot draws the token after
    its node n > 0 under node_masks[slot, n - 1] (the grammar's mask after the path to that node,
    host/structured.Grammars.fill_paths) instead of its own token_mask (the mask after t0)."""
    depth, path_nodes = jnp.asarray(depth), jnp.asarray(path_nodes)
    node = jnp.maximum(node_of, 0)
    out = {name: x[row_of] for name, x in b.arrays().items()}
    out["position"] = b.position[row_of] + depth[node]
    if node_masks is not None:
        slot = mask_slot[row_of]
        own = node_masks[jnp.maximum(slot, 0), jnp.maximum(node - 1, 0)]              # [M, W]
        out["token_mask"] = jnp.where(((node_of > 0) & (slot >= 0))[:, None], own, out["token_mask"])

    def extend(out):
        h = out["history"].shape[1]
        nodes = path_nodes[node, 1:]                                             # [M, D]
        live = (node_of[:, None] > 0) & (nodes > 0) & (nodes <= num_spec[row_of][:, None])
        toks = node_tokens[row_of[:, None], jnp.maximum(nodes - 1, 0)]
        cols = jnp.where(live, b.position[row_of][:, None] + jnp.arange(nodes.shape[1])[None, :], h)
        rows = jnp.broadcast_to(jnp.arange(row_of.shape[0])[:, None], cols.shape)
        return {**out, "history": out["history"].at[rows, cols].set(toks, mode="drop"),
                "history_is_output": out["history_is_output"].at[rows, cols].set(True, mode="drop")}
    out = jax.lax.cond(reads_history(b), extend, lambda o: o, out)
    return SamplingBatch(**out, logprobs_mode=b.logprobs_mode)


def expand_batch(b: SamplingBatch, drafts: jax.Array, num_spec: jax.Array, k1: int,
                 node_masks: jax.Array | None = None, mask_slot: jax.Array | None = None) -> SamplingBatch:
    """The [S * k1] batch of the positions a speculating row decides: row s * k1 + j draws position
    b.position[s] + j, its history holding d_1..d_j (drafts [S, k1 - 1]) of row s (and, under a
    grammar, its mask after d_1..d_j): expand_paths over a chain."""
    s = b.temperature.shape[0]
    j = np.arange(k1)
    path_nodes = np.where(j[None, :] <= j[:, None], j[None, :], -1)           # node j: 0, 1, .., j
    return expand_paths(b, drafts, j, path_nodes, num_spec, jnp.repeat(jnp.arange(s), k1),
                        jnp.tile(jnp.arange(k1), s), node_masks, mask_slot)


def verify(logits: jax.Array, drafts: jax.Array, num_spec: jax.Array, q: jax.Array | None, b: SamplingBatch,
           node_masks: jax.Array | None = None, mask_slot: jax.Array | None = None):
    """Decide the proposals of every row (module docstring).

    logits [S, k1, V]: the target's raw logits at each row's 1 + k positions (rows with fewer
    proposals repeat their last one); drafts [S, k1 - 1] (entries past num_spec[s]: ignored);
    q [S, k1 - 1, V] the draft distributions, or None: one-hot proposals; b: the rows' batch, its
    position that of the token after t0; node_masks / mask_slot: the grammar masks after each
    proposal (expand_paths), so p_j is the constrained distribution.
    Returns (ids [k1, S], logprobs [k1, S], top ids [k1, S, 20], top logprobs [k1, S, 20],
    num_drawn [S] = accepted + 1): the target's logprobs of the emitted tokens."""
    s, k1, v = logits.shape
    k = k1 - 1
    bx = expand_batch(b, drafts, num_spec, k1, node_masks, mask_slot)
    tempered, logprobs, filtered = (x.reshape(s, k1, v) for x in process(logits.reshape(s * k1, v), bx))
    greedy = b.temperature <= 0
    target_argmax = jnp.argmax(tempered, axis=-1).astype(jnp.int32)                 # [S, k1]
    probs = jax.nn.softmax(filtered, axis=-1)                                        # [S, k1, V]
    pos = b.position[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]              # [S, k1]
    flat_keys = row_keys(jnp.repeat(b.seed, k1), jnp.repeat(b.sample_index, k1), pos.reshape(-1))
    if k > 0:
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, ACCEPT_TAG)))(flat_keys)
        u = u.reshape(s, k1)[:, :k]
        p_d = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]     # [S, k]
        q_d = 1.0 if q is None else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        ok = jnp.where(greedy[:, None], drafts == target_argmax[:, :k], u * q_d < p_d)
        ok &= jnp.arange(k)[None, :] < num_spec[:, None]
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)        # [S]
    else:
        accepted = jnp.zeros((s,), jnp.int32)
    rejected = accepted < num_spec
    rows = jnp.arange(s)
    # the token at the first undecided position: the residual after a rejection, else the bonus
    p_a, f_a = probs[rows, accepted], filtered[rows, accepted]
    if k > 0:
        d_a = drafts[rows, jnp.minimum(accepted, k - 1)]
        q_a = jax.nn.one_hot(d_a, v, dtype=jnp.float32) if q is None else q[rows, jnp.minimum(accepted, k - 1)]
        residual = jnp.maximum(p_a - q_a, 0.0)
        # p == q to rounding leaves nothing: then the target's own distribution (never exactly 0)
        has_mass = jnp.sum(residual, axis=-1, keepdims=True) > 0
        res_logits = jnp.where(has_mass, jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)),
                                                   NEG_INF), f_a)
        f_a = jnp.where(rejected[:, None], res_logits, f_a)
    keys_a = row_keys(b.seed, b.sample_index, b.position + accepted)
    drawn = jax.lax.cond(jnp.any(~greedy), lambda f: gumbel_draw(f, keys_a),
                         lambda f: jnp.zeros(f.shape[:1], jnp.int32), f_a)
    last = jnp.where(greedy, target_argmax[rows, accepted], drawn)
    j = jnp.arange(k1)[None, :]
    ids = jnp.where(j < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
    ids = jnp.where(j == accepted[:, None], last[:, None], ids).astype(jnp.int32)    # [S, k1]
    lps = jnp.take_along_axis(logprobs, ids[..., None], axis=-1)[..., 0]
    top_ids, top_lps = top_logprobs(logprobs.reshape(s * k1, v), bx)
    return (ids.T, lps.T, top_ids.reshape(s, k1, -1).transpose(1, 0, 2),
            top_lps.reshape(s, k1, -1).transpose(1, 0, 2), accepted + 1)
