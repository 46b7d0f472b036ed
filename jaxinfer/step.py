"""One engine step on the device: the typed host-to-device contract and the jitted step function.

The contract (SGLang states its ScheduleBatch -> ForwardBatch the same way):
  host, numpy (runner.ModelRunner.prepare builds it from the scheduler's plan)   device
  StepInputs.tokens, positions [T]     this step's tokens, flattened rows   -> embeddings, RoPE / ALiBi
  StepInputs.meta                      AttentionMetadata (kv_cache.py)      -> K/V writes, paged reads
  StepInputs.logits_indices [S]        last token of each row               -> LM head on S rows only
  StepInputs.sampling                  SamplingBatch [S]                    -> token ids, logprobs
  StepInputs.stop_ids [S, M]           ids that end a row on device (EOS unless ignore_eos, the row's
                                       stop_token_ids; -1 padded)
  StepInputs.max_new [S]               tokens each row may draw this call (0: the row does not sample)
  StepInputs.num_iters []              decode iterations to run (1 unless every row decodes)
  StepInputs.from_prev [T]             async scheduling: where a token still on the device lies in the
                                       previous step's next_tokens (-1: the host's token)
and back, one device-to-host copy of StepOutputs: ids/logprobs [K, S] (+ top-N [K, S, 20]) and
num_drawn [S]. next_tokens [K * max_rows] stays on the device as the next step's `prev_tokens`
(async scheduling, runner.py). The KV pages are donated, so they are updated in place.

The step is one module-level function of (params, kv_pages, inputs, prev_tokens) with everything it
is compiled for in `StepSettings`, so the compiled program depends on nothing hidden; `jit_step`
jits it for one engine (which owns the executables).

Multi-step decoding: when every row of a step decodes (one token each), the scheduler asks for
up to K iterations. Iteration i feeds the tokens sampled by iteration i - 1 straight back in:
positions and context lengths grow by one, each row's next KV slot comes from its block table
(the scheduler allocated blocks for all K tokens up front), and the sampler's position (hence
its key, from (seed, sample index, position)) advances, so every draw is the one a one-token step
would make. A row stops on device at a stop id or when it has drawn max_new tokens; the loop ends
when every row has stopped or after num_iters iterations. A stopped row writes no more KV. The
host applies stop strings afterwards and discards what follows a stop (engine.py). A mixed step
(prefill chunks) runs the same program with num_iters = 1, so multi-step adds no compilation.

Speculative engines: `_spec_step` (draft model / n-gram: chains verified by speculative.verify,
several rounds per call where the device makes the proposals: the draft model, n-gram lookup) and
`_medusa_step` (a tree of the Medusa heads' candidates per row under a tree attention mask,
medusa.verify_tree_flat, the accepted path's K/V moved into place, the next tree proposed in the
same call). Steps with nothing speculative in them (the load policy's, prefill chunks without
proposals) run the plain program (`_step`) instead (runner.py), so the draft model runs only where
some row speculates or catches up; a row whose draft pages lag catches up in a step of such chunks
alone, which runs the draft and not the target (SpecInputs.run_target, draft_slots;
host/scheduler.py).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import medusa
from jaxinfer.kv_cache import PAD_SLOT, TREE_NONE, AttentionMetadata, LayerKV, move_kv
from jaxinfer.sampling import MAX_LOGPROBS, SamplingBatch, any_penalty, sample
from jaxinfer.speculative import draft_sample, ngram_lookup, verify, with_history

MAX_STOP_IDS = 8   # stop ids checked on device per row; a row with more is checked by the host only


@jax.tree_util.register_dataclass
@dataclass
class SpecInputs:
    """Speculative decoding (jaxinfer/speculative.py): row s's last num_spec[s] tokens are proposals."""
    num_spec: jax.Array                     # [S] int32
    # draft model: its proposal iterations' layout, one token per speculating row (row s's token
    # at decode_tokens[s]), positions / slots / context of the first proposal; None: n-gram
    draft_meta: AttentionMetadata | None = None
    draft_positions: jax.Array | None = None    # [S] int32: row s's t0 position + 1
    # draft model: where it writes the step's tokens (the target's slots, and those of a catching-up
    # row's positions whose target K/V is cached, which the target's meta pads), and whether the
    # target runs (not in a step of catch-up chunks alone): host/scheduler.py, lazy_draft. (A step
    # without the draft runs the plain program: runner.py.)
    draft_slots: jax.Array | None = None        # [T] int32
    run_target: jax.Array | None = None         # [] bool
    propose: jax.Array | None = None            # [] bool, Medusa: propose next trees (the load policy is on)
    # structured outputs: row s (mask_slot[s] >= 0) draws the token after its proposal / tree node n
    # under node_masks[mask_slot[s], n - 1], its grammar's mask after the path to n (-1: no grammar)
    node_masks: jax.Array | None = None         # [C, N, W] int32 (C: min(MAX_GUIDED_ROWS, max_num_seqs))
    mask_slot: jax.Array | None = None          # [S] int32
    # n-gram: row s's proposals come from prompt lookup on the device (its num_spec[s] slots are
    # placeholders, its sampling history holds its tokens), every round; False: the host's proposals
    lookup: jax.Array | None = None             # [S] bool


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    tokens: jax.Array           # [T] int32
    positions: jax.Array        # [T] int32
    meta: AttentionMetadata
    logits_indices: jax.Array   # [S] int32
    sampling: SamplingBatch     # [S] rows
    stop_ids: jax.Array         # [S, MAX_STOP_IDS] int32, -1 padded
    max_new: jax.Array          # [S] int32
    num_iters: jax.Array        # [] int32, 1 <= num_iters <= StepSettings.max_iters
    from_prev: jax.Array        # [T] int32: index into the previous step's next_tokens, or -1
    spec: SpecInputs | None = None   # speculative engines only


@jax.tree_util.register_dataclass
@dataclass
class StepOutputs:
    ids: jax.Array              # [K, S] int32: token drawn by row s at iteration k
    logprobs: jax.Array         # [K, S] float32
    top_ids: jax.Array          # [K, S, MAX_LOGPROBS] int32 (zeros unless some row asked for logprobs)
    top_logprobs: jax.Array     # [K, S, MAX_LOGPROBS] float32
    num_drawn: jax.Array        # [S] int32: how many of ids[:, s] are real
    next_tokens: jax.Array      # [K * max_rows] int32: ids[k, s] at k * max_rows + s (stays on device)
    # speculation, per row: [S, 3 + k] rounds run, rounds that proposed, tokens proposed, then how
    # many rounds accepted the proposal at each position (a Medusa tree: a node at each depth)
    spec_counts: jax.Array | None = None
    proposals: jax.Array | None = None     # Medusa: [S, N] each row's next tree, from what drew its last token


@dataclass(frozen=True)
class StepSettings:
    """What `step` is compiled for (static: hashable)."""
    graphdef: nnx.GraphDef
    attention: str                      # "xla" | "pallas"
    max_iters: int = 1                  # K: output rows of StepOutputs
    max_rows: int = 1                   # the largest S of any bucket (next_tokens' row stride)
    kv_sharding: NamedSharding | None = None   # pages leave as they came (TP): in-place donation
    replicate_samples: NamedSharding | None = None   # multi-host: process 0 reads every row
    spec_tokens: int = 0                # K > 0: speculative decoding, up to K proposals per row
    draft_graphdef: nnx.GraphDef | None = None   # the draft model (params and pages: (target, draft))
    medusa_graphdef: nnx.GraphDef | None = None  # Medusa heads (params: (target, heads)); spec_tokens: depth
    tree: medusa.Tree | None = None              # ... and their candidate tree
    ngram: tuple[int, ...] = ()                  # n-gram method: (max_n, min_n) of the device's prompt lookup
    # a speculative engine's plain step (runner.py): its next_tokens has the speculative step's rows,
    # so that either program reads the other's as prev_tokens
    next_rows: int = 0

    @property
    def out_rows(self) -> int:
        """Rows of next_tokens (out_rows * max_rows) and, but for a plain step's next_rows, of
        StepOutputs.ids."""
        if self.tree is not None:   # Medusa rounds of up to depth + 1 draws each (or multi-step decoding)
            return max(self.max_iters * (self.tree.depth + 1), self.next_rows)
        return max(self.max_iters * (self.spec_tokens + 1), self.next_rows)


def _advance(inputs: StepInputs, ids: jax.Array, drew: jax.Array, going: jax.Array, block_size: int
             ) -> StepInputs:
    """The next decode iteration's inputs: row s's token becomes ids[s] one position later, for the
    rows still going; the others write nothing (PAD_SLOT). Penalties see what was drawn (drew).
    Valid only when every row of the step holds one token (the scheduler's condition for
    num_iters > 1)."""
    meta, li = inputs.meta, inputs.logits_indices
    t = inputs.tokens.shape[0]
    row_of_tok = meta.seq_ids
    real = meta.slot_mapping != PAD_SLOT
    tok_going = going[row_of_tok] & real & (jnp.arange(t) == li[row_of_tok])
    tokens = jnp.where(tok_going, ids[row_of_tok], inputs.tokens)
    positions = jnp.where(tok_going, inputs.positions + 1, inputs.positions)
    block = jnp.take_along_axis(meta.block_tables[row_of_tok], (positions // block_size)[:, None], axis=1)[:, 0]
    slots = jnp.where(tok_going, block * block_size + positions % block_size, PAD_SLOT)
    meta = AttentionMetadata(**{**vars(meta), "slot_mapping": slots,
                                "context_lens": meta.context_lens + going.astype(jnp.int32)})
    sb = with_history(inputs.sampling, ids, drew)   # penalties see the tokens drawn by earlier iterations
    sb = SamplingBatch(**{**vars(sb), "position": sb.position + going.astype(jnp.int32)})
    return StepInputs(tokens, positions, meta, li, sb, inputs.stop_ids, inputs.max_new, inputs.num_iters,
                      inputs.from_prev, inputs.spec)


def _step(params, kv_pages: list[LayerKV], inputs: StepInputs, prev_tokens: jax.Array, settings: StepSettings
          ) -> tuple[StepOutputs, list[LayerKV]]:
    """prev_tokens [K * max_rows]: the previous step's next_tokens (zeros when every token is known)."""
    if settings.tree is not None:
        return _medusa_step(params, kv_pages, inputs, prev_tokens, settings)
    if settings.spec_tokens:
        return _spec_step(params, kv_pages, inputs, prev_tokens, settings)
    model = nnx.merge(settings.graphdef, params)
    tokens = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
    inputs = StepInputs(tokens, *(getattr(inputs, f) for f in ("positions", "meta", "logits_indices", "sampling",
                                                               "stop_ids", "max_new", "num_iters", "from_prev",
                                                               "spec")))
    s, k = inputs.logits_indices.shape[0], settings.max_iters
    block_size = kv_pages[0].k.shape[-2]

    def iteration(i, kv, x: StepInputs, out: StepOutputs, done):
        """One forward + sample; returns the drawn ids and the updated kv, outputs and done."""
        logits, kv = model(x.tokens, x.positions, kv, x.meta, x.logits_indices, impl=settings.attention)
        kv = _pin_pages(kv, settings)
        ids, lps, top_ids, top_lps = sample(logits, x.sampling)
        drew = ~done
        drawn = out.num_drawn + drew.astype(jnp.int32)
        out = StepOutputs(out.ids.at[i].set(jnp.where(drew, ids, 0)), out.logprobs.at[i].set(lps),
                          out.top_ids.at[i].set(top_ids), out.top_logprobs.at[i].set(top_lps), drawn,
                          out.next_tokens)
        stopped = jnp.any(ids[:, None] == x.stop_ids, axis=1)
        return ids, drew, kv, out, done | (drew & stopped) | (drawn >= x.max_new)

    def body(carry):
        i, kv, x, out, done = carry
        ids, drew, kv, out, done = iteration(i, kv, x, out, done)
        # the next iteration's inputs (unused after the last one; cheap next to the forward)
        return i + 1, kv, _advance(x, ids, drew, ~done, block_size), out, done

    def cond(carry):
        i, _, x, _, done = carry
        # the first iteration always runs: a step whose rows draw nothing still writes its K/V
        return (i == 0) | ((i < x.num_iters) & jnp.any(~done))

    out = StepOutputs(jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), jnp.float32),
                      jnp.zeros((k, s, MAX_LOGPROBS), jnp.int32), jnp.zeros((k, s, MAX_LOGPROBS), jnp.float32),
                      jnp.zeros((s,), jnp.int32), jnp.zeros((k * settings.max_rows,), jnp.int32))
    carry = (jnp.int32(0), kv_pages, inputs, out, inputs.max_new <= 0)
    if k == 1:   # one iteration, no loop (the model is traced once either way)
        _, kv_pages, _, out, _ = body(carry)
    else:
        _, kv_pages, _, out, _ = jax.lax.while_loop(cond, body, carry)
    next_tokens = jnp.zeros((settings.out_rows, settings.max_rows), jnp.int32).at[:k, :s].set(out.ids).reshape(-1)
    out = StepOutputs(out.ids, out.logprobs, out.top_ids, out.top_logprobs, out.num_drawn, next_tokens)
    if settings.replicate_samples is not None:
        out = jax.lax.with_sharding_constraint(out, settings.replicate_samples)
    return out, kv_pages


def _pin_pages(pages, settings: StepSettings, replicated: bool = False):
    """Under tensor parallelism: the target's pages keep their head sharding and the draft's stay
    replicated, so that they leave the step as they came (in-place donation, no recompilation)."""
    if settings.kv_sharding is None:
        return pages
    sharding = NamedSharding(settings.kv_sharding.mesh, PartitionSpec()) if replicated else settings.kv_sharding
    return jax.lax.with_sharding_constraint(pages, sharding)


def _propose(dmodel, dpages: list[LayerKV], inputs: StepInputs, tokens: jax.Array, k: int, impl: str):
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


def _spec_round(model, dmodel, kv_pages, inputs: StepInputs, settings: StepSettings):
    """One round of speculation over the step's layout: the draft model's proposals (draft method),
    the target's forward over every token, then each row's exact verification
    (jaxinfer/speculative.py; rows without proposals draw as `sample` does).
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
        drafts, q, dpages = _propose(dmodel, dpages, dinputs, tokens, k, settings.attention)
        dpages = _pin_pages(dpages, settings, replicated=True)
        tokens = tokens.at[proposal_at].set(drafts, mode="drop")
    else:
        tpages = kv_pages
        drafts = jnp.where(proposal_at < t, tokens[jnp.minimum(proposal_at, t - 1)], 0)
        if settings.ngram:
            drafts, num_spec = _lookup(sp, sb, inputs.positions[t0] + 1, drafts, settings)
            # a row's slots past its proposals compute (and write) what a rejected proposal would
            tokens = tokens.at[proposal_at].set(drafts, mode="drop")
    h, tpages = model.hidden_states(tokens, inputs.positions, tpages, inputs.meta, settings.attention)
    tpages = _pin_pages(tpages, settings)

    def speculative(h):
        idx = jnp.minimum(t0[:, None] + jnp.arange(k1)[None, :], li[:, None])        # [S, k1]
        logits = model.logits(h[idx.reshape(-1)]).reshape(s, k1, -1)
        b = SamplingBatch(**{**vars(sb), "position": inputs.positions[t0] + 1})
        return verify(logits, drafts, num_spec, q, b, sp.node_masks, sp.mask_slot)

    def plain(h):   # t0: a row whose lookup found nothing has placeholders after it
        ids, lps, top_ids, top_lps = sample(model.logits(h[t0]), sb)
        pad = lambda x: jnp.zeros((k1,) + x.shape, x.dtype).at[0].set(x)  # noqa: E731
        return pad(ids), pad(lps), pad(top_ids), pad(top_lps), jnp.ones((s,), jnp.int32)

    out = jax.lax.cond(jnp.any(num_spec > 0), speculative, plain, h)
    return (*out, num_spec, ((tpages, dpages) if dmodel is not None else tpages))


def _lookup(sp: SpecInputs, sb: SamplingBatch, length: jax.Array, drafts: jax.Array, settings: StepSettings):
    """The n-gram rows' proposals from prompt lookup over their histories (length [S]: tokens up to
    and including the row's last drawn one), at most the row's slots; other rows keep the host's.
    -> (drafts [S, k], num_spec [S])."""
    def look(_):
        d, n = ngram_lookup(sb.history, length, settings.spec_tokens, *settings.ngram)
        return (jnp.where(sp.lookup[:, None], d, drafts),
                jnp.where(sp.lookup, jnp.minimum(n, sp.num_spec), sp.num_spec))
    return jax.lax.cond(jnp.any(sp.lookup), look, lambda _: (drafts, sp.num_spec), None)


def _record_round(out: StepOutputs, counts: jax.Array, b: SamplingBatch, p: jax.Array, last: jax.Array,
                  drew: tuple, drawn: jax.Array, num_spec: jax.Array, done: jax.Array, stop_ids: jax.Array,
                  reads_history: jax.Array):
    """One speculation round's draws (ids, logprobs, top ids, top logprobs, each [R, S]: up to R a
    row) into a multi-round step's state (_spec_step, _medusa_step): each row's drawn tokens after
    its earlier rounds' in `out`; `counts` (StepOutputs.spec_counts: rounds run, rounds proposed,
    proposals, rounds that accepted position i); where later rounds read it, the sampling history
    at positions p + 1 ... -> (out, counts, b, stopped: a row drew a stop id, last: each row's last
    drawn token)."""
    ids, lps, top_ids, top_lps = drew
    r, s = ids.shape
    jj = jnp.arange(r)[:, None]
    dest = jnp.where(jj < drawn[None, :], out.num_drawn[None, :] + jj, out.ids.shape[0])   # [R, S]; past the end: none
    cols = jnp.broadcast_to(jnp.arange(s)[None, :], dest.shape)
    put = lambda a, x: a.at[dest, cols].set(x, mode="drop")  # noqa: E731
    spec_row = (num_spec > 0) & ~done
    counts = counts.at[:, 0].add((~done).astype(jnp.int32))
    counts = counts.at[:, 1].add(spec_row.astype(jnp.int32))
    counts = counts.at[:, 2].add(jnp.where(spec_row, num_spec, 0))
    counts = counts.at[:, 3:].add((spec_row[:, None] & (jnp.arange(counts.shape[1] - 3)[None, :] < drawn[:, None] - 1)
                                   ).astype(jnp.int32))
    out = StepOutputs(put(out.ids, ids), put(out.logprobs, lps), put(out.top_ids, top_ids),
                      put(out.top_logprobs, top_lps), out.num_drawn + drawn, out.next_tokens)
    emitted = jj < drawn[None, :]
    stopped = jnp.any(emitted[:, :, None] & (ids[:, :, None] == stop_ids[None]), axis=(0, 2))
    last = jnp.where(drawn > 0, ids[jnp.maximum(drawn - 1, 0), jnp.arange(s)], last)
    hist_cols = jnp.where(emitted.T, p[:, None] + 1 + jnp.arange(r)[None, :], b.history.shape[1])
    b = jax.lax.cond(reads_history,
                     lambda b: SamplingBatch(**{**vars(b), "history": b.history.at[
                         jnp.arange(s)[:, None], hist_cols].set(ids.T, mode="drop"),
                         "history_is_output": b.history_is_output.at[jnp.arange(s)[:, None], hist_cols].set(
                             True, mode="drop")}), lambda b: b, b)
    return out, counts, b, stopped, last


def _no_draws(n_out: int, s: int) -> StepOutputs:
    """A multi-round step's empty draws: n_out output rows for s rows, nothing drawn yet."""
    return StepOutputs(jnp.zeros((n_out, s), jnp.int32), jnp.zeros((n_out, s), jnp.float32),
                       jnp.zeros((n_out, s, MAX_LOGPROBS), jnp.int32), jnp.zeros((n_out, s, MAX_LOGPROBS), jnp.float32),
                       jnp.zeros((s,), jnp.int32), None)


def _run_rounds(body, carry: tuple, done_at: int, num_iters: jax.Array, rounds: int) -> tuple:
    """body over carry (its first item the round index, carry[done_at] the rows that stopped):
    once where the step is compiled for one round, else on the device while some row goes on, up to
    num_iters rounds (the first always)."""
    if rounds == 1:
        return body(carry)
    return jax.lax.while_loop(lambda c: (c[0] == 0) | ((c[0] < num_iters) & jnp.any(~c[done_at])), body, carry)


def _drawn_outputs(drawn: StepOutputs, counts: jax.Array, max_rows: int, proposals: jax.Array | None = None
                   ) -> StepOutputs:
    """A multi-round step's StepOutputs from its draws: next_tokens laid out at max_rows' stride."""
    n_out, s = drawn.ids.shape
    next_tokens = jnp.zeros((n_out, max_rows), jnp.int32).at[:, :s].set(drawn.ids).reshape(-1)
    return StepOutputs(drawn.ids, drawn.logprobs, drawn.top_ids, drawn.top_logprobs, drawn.num_drawn, next_tokens,
                       counts, proposals)


def _spec_step(params, kv_pages, inputs: StepInputs, prev_tokens: jax.Array, settings: StepSettings):
    """A speculative engine's step: one round (_spec_round), or, when nobody waits and every row
    either speculates with proposals made on the device (draft model, n-gram lookup) or decodes
    without proposals (multi-step decoding, as in `_step`: the load policy turned speculation off),
    up to num_iters rounds on the device: round r + 1 moves each row's chunk to just after the
    tokens it drew (its last drawn token, then the proposals' slots), so the host is not consulted
    between rounds. A row stops at a stop id, or when another round could draw past max_new; the
    loop when every row has stopped."""
    k, k1, rounds = settings.spec_tokens, settings.spec_tokens + 1, settings.max_iters
    draft = settings.draft_graphdef is not None
    model = nnx.merge(settings.graphdef, params[0] if draft else params)
    dmodel = nnx.merge(settings.draft_graphdef, params[1]) if draft else None
    tokens = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
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
        return StepInputs(tok, pos, m, li, b, inputs.stop_ids, inputs.max_new, inputs.num_iters, inputs.from_prev,
                          spec)

    def body(carry):
        i, pages, p, last, done, b, out, counts = carry
        ids, lps, top_ids, top_lps, drawn, ns, pages = _spec_round(model, dmodel, pages,
                                                                   round_inputs(i, p, last, done, b), settings)
        drawn = jnp.where(done, 0, jnp.minimum(drawn, inputs.max_new - out.num_drawn))
        # penalties and prompt lookup in later rounds see what this one drew
        reads_history = any_penalty(b) if sp.lookup is None else any_penalty(b) | jnp.any(sp.lookup)
        out, counts, b, stopped, last = _record_round(out, counts, b, p, last, (ids, lps, top_ids, top_lps), drawn,
                                                      ns, done, inputs.stop_ids, reads_history)
        p = p + drawn
        done = done | stopped | (drawn == 0) | (out.num_drawn + sp.num_spec + 1 > inputs.max_new)
        return i + 1, pages, p, last, done, b, out, counts

    out = _no_draws(n_out, s)

    def speculate(kv_pages):
        carry = (jnp.int32(0), kv_pages, inputs.positions[t0], tokens[t0], inputs.max_new <= 0, sb, out,
                 jnp.zeros((s, 3 + k), jnp.int32))
        _, kv_pages, _, _, _, _, drawn, counts = _run_rounds(body, carry, 4, inputs.num_iters, rounds)
        return _drawn_outputs(drawn, counts, settings.max_rows), kv_pages

    if not draft:
        return speculate(kv_pages)

    def catch_up(kv_pages):
        """A step of draft catch-up chunks alone (SpecInputs.run_target False): the draft writes their
        K/V, the target (which has it) does not run, nothing is drawn."""
        tpages, dpages = kv_pages
        dmeta = AttentionMetadata(**{**vars(meta), "slot_mapping": sp.draft_slots})
        _, dpages = dmodel.hidden_states(tokens, inputs.positions, dpages, dmeta, settings.attention)
        return _drawn_outputs(out, jnp.zeros((s, 3 + k), jnp.int32), settings.max_rows), (_pin_pages(tpages, settings), _pin_pages(dpages, settings, replicated=True))
    return jax.lax.cond(sp.run_target, speculate, catch_up, kv_pages)


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


def _tree_rows(inputs: StepInputs, tokens: jax.Array, t0: jax.Array, depth: jax.Array, n: int,
               block_size: int) -> _TreeRows:
    meta = inputs.meta
    row = meta.seq_ids
    off = jnp.arange(tokens.shape[0]) - t0[row]
    return _TreeRows(row, meta.slot_mapping != PAD_SLOT, off, depth[jnp.clip(off, 0, n)], tokens, block_size, n)


def _medusa_round_inputs(g: _TreeRows, inputs: StepInputs, i, p, last, nodes, done):
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
                      num_spec: jax.Array, settings: StepSettings):
    """The accepted nodes' K/V: from their tree slots to the slots right after the root (path [S, D+1]:
    the accepted path's node per depth; drawn [S]: tokens drawn this round)."""
    t, d1 = slot_mapping.shape[0], path.shape[1]
    j = jnp.arange(1, d1)[None, :]
    moving = (num_spec[:, None] > 0) & (j < drawn[:, None]) & (path[:, 1:] != j)
    src = slot_mapping[jnp.minimum(t0[:, None] + path[:, 1:], t - 1)]
    dst = jnp.where(moving, slot_mapping[jnp.minimum(t0[:, None] + j, t - 1)], PAD_SLOT)
    pages = jax.lax.cond(jnp.any(moving), lambda q: move_kv(q, src.reshape(-1), dst.reshape(-1)),
                         lambda q: q, _pin_pages(pages, settings))
    return _pin_pages(pages, settings)


def _medusa_step(params, kv_pages, inputs: StepInputs, prev_tokens: jax.Array, settings: StepSettings):
    """A Medusa engine's step (jaxinfer/medusa.py) while the load policy speculates: one forward over
    every row, a verifying row being its root and its tree's nodes (tree-masked: meta.tree), each
    verifying row's tree decided exactly (medusa.verify_tree), the accepted path's K/V moved to the
    slots after the root, and every row's next tree proposed by the heads from the hidden state
    whose logits drew its last token. When every row verifies a tree and nobody waits, up to
    num_iters such rounds run on the device (the scheduler's _plan_spec_rounds), as `_spec_step` runs
    chains: round r + 1 puts each row's root (its last drawn token) right after what it drew, its
    nodes (the heads' proposals of round r) in the slots after the root at positions root + depth,
    and moves the tree mask (meta.tree: slot indexes, the first node slot) with them, so the host is
    not consulted between rounds. A row stops at a stop id, or when another round could draw past
    max_new. The host gets every round's tokens and each row's last proposals. (Plain multi-step
    decoding does not run here: the policy's other steps run the plain program, runner.py.)"""
    arrays = medusa.tree_arrays(settings.tree)
    d1, n, n_out = settings.tree.depth + 1, len(settings.tree.paths), settings.out_rows
    rounds = max(1, n_out // d1)
    tparams, hparams = params
    model = nnx.merge(settings.graphdef, tparams)
    heads = nnx.merge(settings.medusa_graphdef, hparams)
    li, sp, sb = inputs.logits_indices, inputs.spec, inputs.sampling
    s = li.shape[0]
    tokens = jnp.where(inputs.from_prev >= 0, prev_tokens[jnp.maximum(inputs.from_prev, 0)], inputs.tokens)
    t = tokens.shape[0]
    t0 = li - sp.num_spec
    depth = jnp.asarray(arrays["depth"])
    g = _tree_rows(inputs, tokens, t0, depth, n, kv_pages[0].k.shape[-2])
    row, off = g.row, g.off
    # the most a row draws in a round: 1 + the depth of its tree (the host may have cut it)
    per_round = 1 + jnp.max(jnp.where(jnp.arange(n + 1)[None, :] <= sp.num_spec[:, None], depth[None, :], 0), axis=1)

    def body(carry):
        i, pages, p, last, nodes, done, b, out, counts, proposals = carry
        tok, pos, m = _medusa_round_inputs(g, inputs, i, p, last, nodes, done)
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
        out, counts, b, stopped, last = _record_round(out, counts, b, p, last, (ids, lps, top_ids, top_lps), drawn,
                                                      sp.num_spec, done, inputs.stop_ids, any_penalty(b) & (rounds > 1))
        p = p + drawn
        done = done | stopped | (drawn == 0) | (out.num_drawn + per_round > inputs.max_new)
        return i + 1, pages, p, last, nodes, done, b, out, counts, proposals

    carry = (jnp.int32(0), kv_pages, inputs.positions[t0], tokens[t0], jnp.full((s, n), -1, jnp.int32),
             inputs.max_new <= 0, sb, _no_draws(n_out, s), jnp.zeros((s, 2 + d1), jnp.int32),
             jnp.full((s, n), -1, jnp.int32))
    _, kv_pages, _, _, _, _, _, drawn, counts, proposals = _run_rounds(body, carry, 5, inputs.num_iters, rounds)
    return _drawn_outputs(drawn, counts, settings.max_rows, proposals), kv_pages


def jit_step(settings: StepSettings):
    """The jitted step(params, kv_pages, inputs, prev_tokens) for these settings, pages donated. Each
    runner owns its own: its executables then live and die with the engine. (A process-wide jit cache
    keeps every engine's programs forever, and XLA:CPU maps ~1,100 memory regions per program: a
    process that builds engines one after another, the test suite, hit the kernel's 65,530-mapping
    limit after ~60 programs and aborted.)"""
    return jax.jit(functools.partial(_step, settings=settings), donate_argnames="kv_pages")

