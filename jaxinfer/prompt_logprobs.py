"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs; OpenAI completions' `echo` with `logprobs`):
each prompt token's logprob given the tokens before it, its rank, and the top-N at its position,
computed from the prefill step itself.

  host (numpy)   prompt_targets(): for every token of the step whose next token is a prompt token of a
                 request that asks, that next token's id (else -1): StepInputs.prompt_targets [T]. A
                 prompt chunk's last token's target is the first token of the next chunk, known on
                 the host, so chunked prefill needs nothing more.
  device (jax)   step_prompt_logprobs(): the LM head over every token of the step [T, V] (only when some
                 target is set: a lax.cond, so a step where nobody asks computes the last tokens'
                 logits only, as before), log_softmax, each target's logprob and rank, the top
                 MAX_LOGPROBS: StepOutputs.prompt_logprobs / prompt_ranks [T], prompt_top_* [T, 20].
  host (numpy)   PromptRows.collect(): back to each request's `prompt_logprobs` {position: entry}.

Logprobs are the model's raw distribution (log_softmax of the logits, no temperature, penalty or
bias: vLLM's default), so they are the same whatever the request samples with.

Prefix caching: a cached block has K/V but no logits. A request that asks for prompt logprobs is
admitted without looking up the cache (host/scheduler.py `_cache_hits`), so its whole prompt is
computed; its blocks are still registered for later requests. Recomputing the prefix is what the
logits cost anyway (the forward over those positions is the work; its K/V is a by-product), so
bypassing costs no more than any scheme that recomputes only the logits, and the prefix's K/V then
comes from the same step that made its logits. The n samples of a request share one dict: the
leader computes the positions before the fork, each sample the rest (identical values). A request
preempted and recomputed skips the positions it already has.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import MAX_LOGPROBS

# (logprob of the prompt token, its rank (1 = the most likely), [(token id, logprob)] top-N)
PromptEntry = tuple[float, int, list[tuple[int, float]]]


@dataclass
class PromptRows:
    """The step's tokens that have prompt targets: per request, (first token index in the step, the
    position of that token, how many)."""
    spans: list[tuple[object, int, int, int]] = field(default_factory=list)

    def collect(self, outputs) -> None:
        """Store the step's prompt logprobs (StepOutputs, fetched from the device once) into each
        request's `prompt_logprobs` dict, keyed by the position whose next token they score."""
        if not self.spans:
            return
        lps, ranks, top_ids, top_lps = jax.device_get((outputs.prompt_logprobs, outputs.prompt_ranks,
                                                       outputs.prompt_top_ids, outputs.prompt_top_logprobs))
        for req, first, pos, count in self.spans:
            k = req.params.prompt_logprobs
            store = req.prompt_logprobs
            for j in range(count):
                t = first + j
                store[pos + j] = (float(lps[t]), int(ranks[t]),
                                  [(int(a), float(b)) for a, b in zip(top_ids[t, :k], top_lps[t, :k])])


def prompt_targets(seqs, query_start_loc: np.ndarray, t: int) -> tuple[np.ndarray | None, PromptRows]:
    """targets [T] int32 (-1: nothing to score; None when no token of the step has a target) and the
    rows they belong to. A request's positions already scored (it was preempted after) are skipped."""
    rows = PromptRows()
    targets = None
    for i, seq in enumerate(seqs):
        req = seq.request
        if req.params.prompt_logprobs is None:
            continue
        n_prompt = len(req.prompt_ids)
        lo, hi = seq.start, min(seq.start + seq.num_tokens, n_prompt - 1)   # positions p with a token p + 1
        have = req.prompt_logprobs
        while lo < hi and lo in have:
            lo += 1
        if lo >= hi:
            continue
        if targets is None:
            targets = np.full(t, -1, np.int32)
        first = int(query_start_loc[i]) + lo - seq.start
        targets[first: first + hi - lo] = req.prompt_ids[lo + 1: hi + 1]
        rows.spans.append((req, first, lo, hi - lo))
    return targets, rows


def step_prompt_logprobs(model, h: jax.Array, targets: jax.Array, otherwise: tuple) -> tuple:
    """h [T, D] final hidden states, targets [T] -> (logprob [T], rank [T], top ids [T, 20], top
    logprobs [T, 20]); `otherwise` (what the outputs hold already) without computing anything when no
    target is set."""
    def compute():
        logprobs = jax.nn.log_softmax(model.logits(h), axis=-1)                 # (T, V) f32
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)   # (T, 1)
        rank = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)
        top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        return chosen[:, 0], rank, top_ids.astype(jnp.int32), top_lp

    return jax.lax.cond(jnp.any(targets >= 0), compute, lambda: tuple(otherwise))


def prompt_logprob_list(req) -> list[PromptEntry | None]:
    """The request's prompt logprobs in prompt order: None for the first token (nothing precedes it),
    then one entry per later prompt token."""
    store = req.prompt_logprobs
    return [None] + [store[p] for p in range(len(req.prompt_ids) - 1)]
