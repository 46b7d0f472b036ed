"""The step of a draft-model or n-gram engine: chains of proposals verified exactly
(verification.verify), several rounds per call where the device makes the proposals (the draft
model: draft_model.py; n-gram lookup: ngram.py). Steps with nothing speculative in them (the load
policy's, prefill chunks without proposals) run the plain program (jaxinfer/step.py) instead
(runner.py), so the draft model runs only where some row speculates or catches up; a row whose
draft pages lag catches up in a step of such chunks alone, which runs the draft and not the target
(SpecInputs.run_target, draft_slots; host/scheduler.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata
from jaxinfer.sampling import SamplingBatch, reads_history, sample
from jaxinfer.spec_decode import draft_model, ngram
from jaxinfer.spec_decode.contract import SpecStepInputs, SpecStepOutputs, SpecStepSettings
from jaxinfer.spec_decode.rounds import drawn_outputs, no_draws, record_round
from jaxinfer.spec_decode.verification import verify
from jaxinfer.step import pin_pages, run_loop, tokens_with_prev


def _round(model, dmodel, kv_pages, inputs: SpecStepInputs, settings: SpecStepSettings):
    """One round of speculation over the step's layout: the draft model's proposals (draft method),
    the target's forward over every token, then each row's exact verification
    (verification.verify; rows without proposals draw as `sample` does).
    -> (ids [k1, S], logprobs [k1, S], top ids / logprobs [k1, S, 20], drawn [S], pages)."""
    k, k1 = settings.spec_tokens, settings.spec_tokens + 1
    sp, li, sb, tokens = inputs.spec, inputs.logits_indices, inputs.sampling, inputs.tokens
    s, t = li.shape[0], tokens.shape[0]
    t0 = li - sp.num_spec
    j = jnp.arange(k)[None, :]
    proposal_at = jnp.where(j < sp.num_spec[:, None], t0[:, None] + 1 + j, t)      # [S, k]; t: none
    q, num_spec = None, sp.num_spec
    if dmodel is not None:
        tpages, dpages = kv_pages
        dinputs = dataclasses.replace(inputs, meta=AttentionMetadata(**{**vars(inputs.meta),
                                                                        "slot_mapping": sp.draft_slots}))
        drafts, q, dpages = draft_model.propose(dmodel, dpages, dinputs, tokens, k, settings.attention)
        dpages = pin_pages(dpages, settings, replicated=True)
        tokens = tokens.at[proposal_at].set(drafts, mode="drop")
    else:
        tpages = kv_pages
        drafts = jnp.where(proposal_at < t, tokens[jnp.minimum(proposal_at, t - 1)], 0)
        if settings.ngram:
            drafts, num_spec = ngram.propose(sp, sb, inputs.positions[t0] + 1, drafts, settings)
            # a row's slots past its proposals compute (and write) what a rejected proposal would
            tokens = tokens.at[proposal_at].set(drafts, mode="drop")
    h, tpages = model.hidden_states(tokens, inputs.positions, tpages, inputs.meta, settings.attention)
    tpages = pin_pages(tpages, settings)

    # the token after t0 is drawn at its position + 1: in a later round sb's (round 0's) is stale, and
    # the draw's key, min_tokens' ban and the bad words' history columns all read it
    b = SamplingBatch(**{**vars(sb), "position": inputs.positions[t0] + 1})

    def speculative(h):
        idx = jnp.minimum(t0[:, None] + jnp.arange(k1)[None, :], li[:, None])        # [S, k1]
        logits = model.logits(h[idx.reshape(-1)]).reshape(s, k1, -1)
        return verify(logits, drafts, num_spec, q, b, sp.node_masks, sp.mask_slot)

    def plain(h):   # t0: a row whose lookup found nothing has placeholders after it
        ids, lps, top_ids, top_lps = sample(model.logits(h[t0]), b)
        pad = lambda x: jnp.zeros((k1,) + x.shape, x.dtype).at[0].set(x)  # noqa: E731
        return pad(ids), pad(lps), pad(top_ids), pad(top_lps), jnp.ones((s,), jnp.int32)

    out = jax.lax.cond(jnp.any(num_spec > 0), speculative, plain, h)
    return (*out, num_spec, ((tpages, dpages) if dmodel is not None else tpages))


def step(params, kv_pages, inputs: SpecStepInputs, prev_tokens: jax.Array, settings: SpecStepSettings
         ) -> tuple[SpecStepOutputs, object]:
    """A draft-model or n-gram engine's step: one round (_round), or, when nobody waits and every row
    either speculates with proposals made on the device (draft model, n-gram lookup) or decodes
    without proposals (multi-step decoding, as in the plain step: the load policy turned speculation off),
    up to num_iters rounds on the device: round r + 1 moves each row's chunk to just after the
    tokens it drew (its last drawn token, then the proposals' slots), so the host is not consulted
    between rounds. A row stops at a stop id, or when another round could draw past max_new; the
    loop when every row has stopped."""
    k, k1, rounds = settings.spec_tokens, settings.spec_tokens + 1, settings.max_iters
    draft = settings.draft_graphdef is not None
    model = nnx.merge(settings.graphdef, params.target if draft else params)
    dmodel = nnx.merge(settings.draft_graphdef, params.draft) if draft else None
    tokens = tokens_with_prev(inputs, prev_tokens)
    sp, li, sb, meta = inputs.spec, inputs.logits_indices, inputs.sampling, inputs.meta
    s, t = li.shape[0], tokens.shape[0]
    t0 = li - sp.num_spec
    row = meta.seq_ids
    real = meta.slot_mapping != PAD_SLOT
    off = jnp.arange(t) - t0[row]                               # a token's place in its row's round
    bs = (kv_pages[0] if draft else kv_pages)[0].k.shape[-2]
    n_out = rounds * k1

    def round_inputs(i, p, last, done, b):
        """Round i's StepInputs: the host's for round 0; later, row s's chunk at p[s] .. p[s] + k_s
        with its last drawn token first (the draft fills the proposals), nothing written for a
        stopped row."""
        later = i > 0
        pos = jnp.where(later & real, p[row] + off, inputs.positions)
        tok = jnp.where(later & real, jnp.where(off == 0, last[row], 0), tokens)
        blk = jnp.take_along_axis(meta.block_tables[row], (pos // bs)[:, None], axis=1)[:, 0]
        slots = jnp.where(later, jnp.where(real & ~done[row], blk * bs + pos % bs, PAD_SLOT), meta.slot_mapping)
        m = AttentionMetadata(**{**vars(meta), "slot_mapping": slots,
                                 "context_lens": jnp.where(later, p + sp.num_spec + 1, meta.context_lens)})
        spec = sp
        if draft:
            dm = sp.draft_meta
            dslots = jnp.where(later & done[dm.seq_ids], PAD_SLOT, dm.slot_mapping)
            spec = dataclasses.replace(sp, draft_meta=AttentionMetadata(**{**vars(dm), "slot_mapping": dslots}),
                                       draft_positions=jnp.where(later, p + 1, sp.draft_positions),
                                       draft_slots=jnp.where(later, slots, sp.draft_slots))
        return SpecStepInputs(tok, pos, m, li, b, inputs.stop_ids, inputs.max_new, inputs.num_iters, inputs.from_prev,
                              spec)

    def body(carry):
        i, pages, p, last, done, b, out, counts = carry
        ids, lps, top_ids, top_lps, drawn, ns, pages = _round(model, dmodel, pages, round_inputs(i, p, last, done, b),
                                                              settings)
        drawn = jnp.where(done, 0, jnp.minimum(drawn, inputs.max_new - out.num_drawn))
        # penalties and prompt lookup in later rounds see what this one drew
        reads = reads_history(b) if sp.lookup is None else reads_history(b) | jnp.any(sp.lookup)
        out, counts, b, stopped, last = record_round(out, counts, b, p, last, (ids, lps, top_ids, top_lps), drawn,
                                                     ns, done, inputs.stop_ids, reads)
        p = p + drawn
        done = done | stopped | (drawn == 0) | (out.num_drawn + sp.num_spec + 1 > inputs.max_new)
        return i + 1, pages, p, last, done, b, out, counts

    out = no_draws(n_out, s)

    def speculate(kv_pages):
        carry = (jnp.int32(0), kv_pages, inputs.positions[t0], tokens[t0], inputs.max_new <= 0, sb, out,
                 jnp.zeros((s, 3 + k), jnp.int32))
        _, kv_pages, _, _, _, _, drawn, counts = run_loop(body, carry, 4, inputs.num_iters, rounds)
        return drawn_outputs(drawn, counts, settings.max_rows), kv_pages

    if not draft:
        return speculate(kv_pages)

    def catch_up(kv_pages):
        """A step of draft catch-up chunks alone (SpecInputs.run_target False): the draft writes their
        K/V, the target (which has it) does not run, nothing is drawn."""
        tpages, dpages = kv_pages
        dmeta = AttentionMetadata(**{**vars(meta), "slot_mapping": sp.draft_slots})
        _, dpages = dmodel.hidden_states(tokens, inputs.positions, dpages, dmeta, settings.attention)
        return (drawn_outputs(out, jnp.zeros((s, 3 + k), jnp.int32), settings.max_rows),
                (pin_pages(tpages, settings), pin_pages(dpages, settings, replicated=True)))
    return jax.lax.cond(sp.run_target, speculate, catch_up, kv_pages)
