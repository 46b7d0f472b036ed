"""What the chain (chain_step.py) and tree (medusa_step.py) steps share: a multi-round step's
draws, recorded round after round on the device, and its outputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.sampling import MAX_LOGPROBS, SamplingBatch
from jaxinfer.spec_decode.contract import SpecStepOutputs
from jaxinfer.step import StepOutputs


def record_round(out: StepOutputs, counts: jax.Array, b: SamplingBatch, p: jax.Array, last: jax.Array,
                 drew: tuple, drawn: jax.Array, num_spec: jax.Array, done: jax.Array, stop_ids: jax.Array,
                 reads_history: jax.Array):
    """One speculation round's draws (ids, logprobs, top ids, top logprobs, each [R, S]: up to R a
    row) into a multi-round step's state (chain_step, medusa_step): each row's drawn tokens after
    its earlier rounds' in `out`; `counts` (SpecStepOutputs.spec_counts: rounds run, rounds proposed,
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


def no_draws(n_out: int, s: int) -> StepOutputs:
    """A multi-round step's empty draws: n_out output rows for s rows, nothing drawn yet."""
    return StepOutputs(jnp.zeros((n_out, s), jnp.int32), jnp.zeros((n_out, s), jnp.float32),
                       jnp.zeros((n_out, s, MAX_LOGPROBS), jnp.int32), jnp.zeros((n_out, s, MAX_LOGPROBS), jnp.float32),
                       jnp.zeros((s,), jnp.int32), None)


def drawn_outputs(drawn: StepOutputs, counts: jax.Array, max_rows: int, proposals: jax.Array | None = None
                   ) -> SpecStepOutputs:
    """A multi-round step's outputs from its draws: next_tokens laid out at max_rows' stride."""
    n_out, s = drawn.ids.shape
    next_tokens = jnp.zeros((n_out, max_rows), jnp.int32).at[:, :s].set(drawn.ids).reshape(-1)
    return SpecStepOutputs(drawn.ids, drawn.logprobs, drawn.top_ids, drawn.top_logprobs, drawn.num_drawn,
                           next_tokens, counts, proposals)
