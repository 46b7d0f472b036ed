"""The draft-model proposer: a small model of the target's vocabulary proposes k tokens per
speculating row inside the step, one token per row per iteration, each drawn with the row's own
sampling settings (its distribution q goes to verification.verify, which keeps the target's
distribution exact whatever the draft proposes).

The draft's KV pages use the target's blocks and slots, so a rollback of num_computed_tokens leaves
both as valid; a row whose draft pages lag (the load policy skipped the draft) catches up in a step
of such chunks alone (host/scheduler.py, lazy_draft; chain_step.py runs it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, LayerKV
from jaxinfer.sampling import SamplingBatch, gumbel_draw, process, row_keys
from jaxinfer.spec_decode.contract import SpecStepInputs
from jaxinfer.step import with_history

DRAFT_TAG = 2    # fold_in tag of the draft model's own draws (verification.ACCEPT_TAG: the acceptance uniforms)


def draft_sample(logits: jax.Array, b: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """The draft model's draw for each row: (ids [S], q [S, V], the distribution it was drawn
    from: softmax of the processed logits; one-hot of the argmax for greedy rows). A batch of greedy
    rows only (the common case) computes no keys, noise or softmax."""
    greedy = b.temperature <= 0

    def sampled(logits):
        tempered, _, filtered = process(logits, b)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_TAG))(row_keys(b.seed, b.sample_index, b.position))
        ids = jnp.where(greedy, jnp.argmax(tempered, axis=-1), gumbel_draw(filtered, keys)).astype(jnp.int32)
        return ids, jnp.where(greedy[:, None], jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32),
                              jax.nn.softmax(filtered, axis=-1))

    def argmax(logits):
        ids = jnp.argmax(process(logits, b)[0], axis=-1).astype(jnp.int32)
        return ids, jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32)

    return jax.lax.cond(jnp.any(~greedy), sampled, argmax, logits)


def propose(dmodel, dpages: list[LayerKV], inputs: SpecStepInputs, tokens: jax.Array, k: int, impl: str):
    """The draft model's proposals: it writes its K/V for the step's tokens (so its pages track the
    target's: same blocks, same slots) and draws d_1 from each speculating row's t0; then one token
    per speculating row: iteration i feeds d_i (writing its K/V too, so that after a rollback the
    draft's pages are as valid as the target's) and, but for the last, draws d_{i+1}.
    -> (drafts [S, k], q [S, k, V]: the distributions they were drawn from, pages)."""
    sp, li, sb = inputs.spec, inputs.logits_indices, inputs.sampling
    s = li.shape[0]
    t0 = li - sp.num_spec
    h, dpages = dmodel.hidden_states(tokens, inputs.positions, dpages, inputs.meta, impl)
    dm = sp.draft_meta
    n = jnp.max(sp.num_spec)
    bs = dpages[0].k.shape[-2]
    real = dm.slot_mapping != PAD_SLOT                         # [S] the speculating rows' tokens
    row = dm.seq_ids
    at = jnp.minimum(dm.decode_tokens, s - 1)                  # row r's token in the compact layout

    def body(i, carry):
        """Draw d_{i+1} from the logits at hand, then feed it (position t0 + i + 1)."""
        dpages, logits, drafts, q, b = carry
        ids, qi = draft_sample(logits, b)
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, ids, i, 1)
        q = jax.lax.dynamic_update_index_in_dim(q, qi, i, 1)
        b = with_history(b, ids, i < sp.num_spec)
        b = SamplingBatch(**{**vars(b), "position": b.position + 1})
        pos = sp.draft_positions[row] + i
        going = real & (i < sp.num_spec[row])
        blk = jnp.take_along_axis(dm.block_tables[row], (pos // bs)[:, None], axis=1)[:, 0]
        slots = jnp.where(going, blk * bs + pos % bs, PAD_SLOT)
        meta = AttentionMetadata(**{**vars(dm), "slot_mapping": slots,
                                    "context_lens": jnp.where(sp.num_spec > 0, sp.draft_positions + i + 1, 0)})
        logits, dpages = dmodel(ids[row], jnp.where(real, pos, 0), dpages, meta, at, impl=impl)
        return dpages, logits, drafts, q, b

    b0 = SamplingBatch(**{**vars(sb), "position": sp.draft_positions})
    carry = (dpages, dmodel.logits(h[t0]), jnp.zeros((s, k), jnp.int32),
             jnp.zeros((s, k, dmodel.cfg.vocab_size), jnp.float32), b0)
    dpages, _, drafts, q, _ = jax.lax.fori_loop(0, n, body, carry)
    return drafts, q, dpages
