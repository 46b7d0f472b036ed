"""Embedding requests on the host: how a request's hidden states are pooled into one vector.

An embedding request is a prefill-only request: the engine runs its prompt (in chunks under the
token budget, batched with everything else) and it finishes at its last prompt token. Pooling
is a weighted sum over its positions, so it splits across chunks: every step the runner sends one
weight per token (StepInputs.pool_weights), the device returns each row's weighted sum of the
final-norm hidden states (StepOutputs.pooled), and the host adds it to the request's running sum
here, in float64. At the end: mean divides by the number of pooled positions, then the vector is
L2-normalized where the model lists a Normalize module (sentence-transformers' semantics:
sentence_transformer/modules/pooling.py and normalize.py).

  last  weight 1 on the last prompt token (sentence-transformers' "lasttoken")
  mean  weight 1 on every position from `skip` on (skip: the instruction prompt's tokens when the
        Pooling module has include_prompt=false)
  cls   weight 1 on position `skip` (the first token, or the first after the instruction)

Pure Python + numpy, never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POOLING_METHODS = ("last", "mean", "cls")


@dataclass
class PoolingState:
    """One embedding request's pooling: its method, where pooling starts, and the running sum."""
    method: str                 # one of POOLING_METHODS
    num_tokens: int             # the request's prompt length
    normalize: bool = False     # L2-normalize the pooled vector (a Normalize module is listed)
    skip: int = 0               # positions before this are not pooled (mean, cls: include_prompt=false)
    dimensions: int | None = None   # Matryoshka: keep the first `dimensions` values (before normalizing)
    total: np.ndarray | None = None   # float64 [D]: the weighted sum so far
    epoch: int = 0              # preemptions so far: a step launched before one adds nothing after it

    def __post_init__(self) -> None:
        assert self.method in POOLING_METHODS, self.method
        assert 0 <= self.skip < max(self.num_tokens, 1) or self.method == "last", (self.skip, self.num_tokens)

    @property
    def needs_every_token(self) -> bool:
        """Whether pooling reads positions before the last one, so no cached prefix may stand in for
        computing them (the prefix cache holds K/V, not hidden states)."""
        return self.method != "last"

    def weights(self, start: int, n: int) -> np.ndarray:
        """float32 [n]: the pooling weight of positions start .. start + n - 1."""
        pos = np.arange(start, start + n)
        if self.method == "last":
            w = pos == self.num_tokens - 1
        elif self.method == "cls":
            w = pos == self.skip
        else:
            w = pos >= self.skip
        return w.astype(np.float32)

    def add(self, pooled: np.ndarray) -> None:
        """Add one step's weighted sum [D] of this request's chunk."""
        pooled = np.asarray(pooled, np.float64)
        self.total = pooled if self.total is None else self.total + pooled

    def reset(self) -> None:
        """The request was preempted: its positions will be computed again from the start."""
        self.total = None
        self.epoch += 1

    def embedding(self) -> np.ndarray:
        """float32 [D]: the pooled (mean: averaged) vector, cut to `dimensions`, L2-normalized if asked."""
        assert self.total is not None, "the request finished without a pooled step"
        v = self.total
        if self.method == "mean":
            v = v / max(self.num_tokens - self.skip, 1)
        if self.dimensions is not None:
            v = v[: self.dimensions]
        if self.normalize:   # torch.nn.functional.normalize: x / max(||x||, 1e-12)
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)
