"""The n-gram proposer on the device: prompt lookup (Saxena 2023; vLLM's "ngram" method) over
each row's sampling history, so that a step runs several rounds of n-gram speculation without the
host (host/speculative.ngram_proposal is the same rule on the host, for rows under a grammar).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.sampling import SamplingBatch
from jaxinfer.spec_decode.contract import SpecInputs, SpecStepSettings


def ngram_lookup(history: jax.Array, length: jax.Array, k: int, max_n: int, min_n: int
                 ) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup on the device, host/speculative.ngram_proposal row by row: row s's tokens are
    history[s, :length[s]] (prompt + output, its last token included); the longest suffix of
    max_n down to min_n tokens that occurred earlier, its latest earlier occurrence, and the up to k
    tokens that followed it. -> (drafts [S, k] (0 past num), num [S])."""
    s, h = history.shape
    i = jnp.arange(h)[None, :]
    found = jnp.zeros((s,), jnp.bool_)
    start = jnp.zeros((s,), jnp.int32)
    for n in range(max_n, min_n - 1, -1):
        match = (i + n <= length[:, None] - 1) & (n <= length[:, None] - 1)   # a token follows the window
        for j in range(n):
            suffix = jnp.take_along_axis(history, jnp.maximum(length - n + j, 0)[:, None], axis=1)   # [S, 1]
            shifted = jnp.pad(history[:, j:], ((0, 0), (0, j)), constant_values=-1)                # [S, H]
            match &= shifted == suffix
        last = jnp.max(jnp.where(match, i, -1), axis=1)
        start = jnp.where(~found & (last >= 0), last + n, start)
        found |= last >= 0
    num = jnp.where(found, jnp.clip(length - start, 0, k), 0)
    at = jnp.minimum(start[:, None] + jnp.arange(k)[None, :], h - 1)
    drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], jnp.take_along_axis(history, at, axis=1), 0)
    return drafts.astype(jnp.int32), num.astype(jnp.int32)


def propose(sp: SpecInputs, sb: SamplingBatch, length: jax.Array, drafts: jax.Array, settings: SpecStepSettings):
    """The n-gram rows' proposals from prompt lookup over their histories (length [S]: tokens up to
    and including the row's last drawn one), at most the row's slots; other rows keep the host's.
    -> (drafts [S, k], num_spec [S])."""
    def look(_):
        d, n = ngram_lookup(sb.history, length, settings.spec_tokens, *settings.ngram)
        return (jnp.where(sp.lookup[:, None], d, drafts),
                jnp.where(sp.lookup, jnp.minimum(n, sp.num_spec), sp.num_spec))
    return jax.lax.cond(jnp.any(sp.lookup), look, lambda _: (drafts, sp.num_spec), None)
