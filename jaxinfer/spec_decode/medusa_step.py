"""The step of a Medusa engine while the load policy speculates: every verifying row's tree of the
heads' candidates (medusa.py) under a tree attention mask, decided exactly (medusa.verify_tree_flat),
the accepted path's K/V moved into place, and the next tree proposed in the same call. The policy's
other steps run the plain program (jaxinfer/step.py; runner.py chooses).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.kv_cache import PAD_SLOT, TREE_NONE, AttentionMetadata, move_kv
from jaxinfer.sampling import SamplingBatch, reads_history, sample
from jaxinfer.spec_decode import medusa
from jaxinfer.spec_decode.contract import SpecStepInputs, SpecStepOutputs, SpecStepSettings
from jaxinfer.spec_decode.rounds import drawn_outputs, no_draws, record_round
from jaxinfer.step import pin_pages, run_loop, tokens_with_prev


class _TreeRows(NamedTuple):
    """Where each of a Medusa step's tokens sits: its row, whether it is real (not padding), its node
    in its row's tree (0: the root), that node's depth; the pages' block size and the tree's size."""
    row: jax.Array
    real: jax.Array
    off: jax.Array
    node_depth: jax.Array
    tokens: jax.Array
    block_size: int
    n: int


def _tree_rows(inputs: SpecStepInputs, tokens: jax.Array, t0: jax.Array, depth: jax.Array, n: int,
               block_size: int) -> _TreeRows:
    meta = inputs.meta
    row = meta.seq_ids
    off = jnp.arange(tokens.shape[0]) - t0[row]
    return _TreeRows(row, meta.slot_mapping != PAD_SLOT, off, depth[jnp.clip(off, 0, n)], tokens, block_size, n)


def _round_inputs(g: _TreeRows, inputs: SpecStepInputs, i, p, last, nodes, done):
    """Round i's tokens, positions and metadata: the host's for round 0; later, row s's root
    (last[s]) at p[s] and its nodes (nodes[s]) in slots p[s] + 1 .. at positions p[s] + depth,
    nothing written for a stopped row."""
    meta, row, real, off, bs, n = inputs.meta, g.row, g.real, g.off, g.block_size, g.n
    later = i > 0
    slot_idx = p[row] + off
    pos = jnp.where(later & real, p[row] + g.node_depth, inputs.positions)
    tok = jnp.where(later & real, jnp.where(off == 0, last[row], nodes[row, jnp.clip(off - 1, 0, n - 1)]), g.tokens)
    blk = jnp.take_along_axis(meta.block_tables[row], (slot_idx // bs)[:, None], axis=1)[:, 0]
    slots = jnp.where(later, jnp.where(real & ~done[row], blk * bs + slot_idx % bs, PAD_SLOT), meta.slot_mapping)
    tree = meta.tree
    moved = jnp.stack([jnp.where(real, slot_idx, tree[:, 0]),
                       jnp.where(tree[:, 1] != TREE_NONE, p[row] + 1, TREE_NONE), tree[:, 2]], axis=1)
    m = AttentionMetadata(**{**vars(meta), "slot_mapping": slots, "tree": jnp.where(later, moved, tree),
                             "context_lens": jnp.where(later, p + inputs.spec.num_spec + 1, meta.context_lens)})
    return tok, pos, m


def _move_accepted_kv(pages, slot_mapping: jax.Array, t0: jax.Array, path: jax.Array, drawn: jax.Array,
                      num_spec: jax.Array, settings: SpecStepSettings):
    """The accepted nodes' K/V: from their tree slots to the slots right after the root (path [S, D+1]:
    the accepted path's node per depth; drawn [S]: tokens drawn this round)."""
    t, d1 = slot_mapping.shape[0], path.shape[1]
    j = jnp.arange(1, d1)[None, :]
    moving = (num_spec[:, None] > 0) & (j < drawn[:, None]) & (path[:, 1:] != j)
    src = slot_mapping[jnp.minimum(t0[:, None] + path[:, 1:], t - 1)]
    dst = jnp.where(moving, slot_mapping[jnp.minimum(t0[:, None] + j, t - 1)], PAD_SLOT)
    pages = jax.lax.cond(jnp.any(moving), lambda kv: move_kv(kv, src.reshape(-1), dst.reshape(-1)),
                         lambda kv: kv, pin_pages(pages, settings))
    return pin_pages(pages, settings)


def step(params, kv_pages, inputs: SpecStepInputs, prev_tokens: jax.Array, settings: SpecStepSettings
         ) -> tuple[SpecStepOutputs, object]:
    """A Medusa engine's step (medusa.py) while the load policy speculates: one forward over
    every row, a verifying row being its root and its tree's nodes (tree-masked: meta.tree), each
    verifying row's tree decided exactly (medusa.verify_tree), the accepted path's K/V moved to the
    slots after the root, and every row's next tree proposed by the heads from the hidden state
    whose logits drew its last token. When every row verifies a tree and nobody waits, up to
    num_iters such rounds run on the device (the scheduler's _plan_spec_rounds), as chain_step.step runs
    chains: round r + 1 puts each row's root (its last drawn token) right after what it drew, its
    nodes (the heads' proposals of round r) in the slots after the root at positions root + depth,
    and moves the tree mask (meta.tree: slot indexes, the first node slot) with them, so the host is
    not consulted between rounds. A row stops at a stop id, or when another round could draw past
    max_new. The host gets every round's tokens and each row's last proposals. (Plain multi-step
    decoding does not run here: the policy's other steps run the plain program, runner.py.)"""
    arrays = medusa.tree_arrays(settings.tree)
    d1, n, n_out = settings.tree.depth + 1, len(settings.tree.paths), settings.out_rows
    rounds = max(1, n_out // d1)
    model = nnx.merge(settings.graphdef, params.target)
    heads = nnx.merge(settings.medusa_graphdef, params.heads)
    li, sp, sb = inputs.logits_indices, inputs.spec, inputs.sampling
    s = li.shape[0]
    tokens = tokens_with_prev(inputs, prev_tokens)
    t = tokens.shape[0]
    t0 = li - sp.num_spec
    depth = jnp.asarray(arrays["depth"])
    g = _tree_rows(inputs, tokens, t0, depth, n, kv_pages[0].k.shape[-2])
    row, off = g.row, g.off
    # the most a row draws in a round: 1 + the depth of its tree (the host may have cut it)
    per_round = 1 + jnp.max(jnp.where(jnp.arange(n + 1)[None, :] <= sp.num_spec[:, None], depth[None, :], 0), axis=1)

    def body(carry):
        i, pages, p, last, nodes, done, b, out, counts, proposals = carry
        tok, pos, m = _round_inputs(g, inputs, i, p, last, nodes, done)
        h, pages = model.hidden_states(tok, pos, pages, m, settings.attention)
        node_at = jnp.minimum(t0[:, None] + jnp.arange(n + 1)[None, :], li[:, None])      # [S, N+1]
        node_tokens = tok[jnp.minimum(t0[:, None] + 1 + jnp.arange(n)[None, :], t - 1)]   # [S, N]
        node_of = jnp.where((m.slot_mapping != PAD_SLOT) & (off >= 0) & (off <= sp.num_spec[row]), off, -1)
        bi = SamplingBatch(**{**vars(b), "position": pos[t0] + 1})

        def verifying(h):
            # the LM head and the processors over the step's T tokens, not S * (N + 1) node slots
            return medusa.verify_tree_flat(model.logits(h), node_at, node_tokens, sp.num_spec, bi, arrays,
                                           row, node_of, sp.node_masks, sp.mask_slot)

        def plain(h):
            ids, lps, top_ids, top_lps = sample(model.logits(h[li]), bi)
            one = lambda x: jnp.zeros((d1,) + x.shape, x.dtype).at[0].set(x)  # noqa: E731
            return (one(ids), one(lps), one(top_ids), one(top_lps), jnp.ones((s,), jnp.int32),
                    jnp.zeros((s, d1), jnp.int32))

        ids, lps, top_ids, top_lps, drawn, path = jax.lax.cond(jnp.any(sp.num_spec > 0), verifying, plain, h)
        drawn = jnp.where(done, 0, jnp.clip(jnp.minimum(drawn, inputs.max_new - out.num_drawn), 0))
        pages = _move_accepted_kv(pages, m.slot_mapping, t0, path, drawn, sp.num_spec, settings)
        # the next tree: from the hidden state whose logits drew the row's last token
        source = t0 + path[jnp.arange(s), jnp.maximum(drawn - 1, 0)]
        nodes = jax.lax.cond(sp.propose, lambda h: medusa.propose(heads, model.logits, h, arrays),
                             lambda h: jnp.full((s, n), -1, jnp.int32), h[source])
        proposals = jnp.where((drawn > 0)[:, None], nodes, proposals)
        # penalties in later rounds see what this one drew
        out, counts, b, stopped, last = record_round(out, counts, b, p, last, (ids, lps, top_ids, top_lps), drawn,
                                                     sp.num_spec, done, inputs.stop_ids, reads_history(b) & (rounds > 1))
        p = p + drawn
        done = done | stopped | (drawn == 0) | (out.num_drawn + per_round > inputs.max_new)
        return i + 1, pages, p, last, nodes, done, b, out, counts, proposals

    carry = (jnp.int32(0), kv_pages, inputs.positions[t0], tokens[t0], jnp.full((s, n), -1, jnp.int32),
             inputs.max_new <= 0, sb, no_draws(n_out, s), jnp.zeros((s, 2 + d1), jnp.int32),
             jnp.full((s, n), -1, jnp.int32))
    _, kv_pages, _, _, _, _, _, drawn, counts, proposals = run_loop(body, carry, 5, inputs.num_iters, rounds)
    return drawn_outputs(drawn, counts, settings.max_rows, proposals), kv_pages
