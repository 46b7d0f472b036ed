"""Speculative decoding on the host: the proposer (placeholders the device fills in, n-gram chains
for rows under a grammar, Medusa trees) and the acceptance counters. Never imports jax
(jaxinfer/spec_decode/ holds the device side: the draft model's proposal loop, prompt lookup
and the exact verification).

Prompt lookup (Saxena 2023; vLLM's "ngram" method): take the last n tokens of the request (n from
`max_n` down to `min_n`), find their latest earlier occurrence in the request's own prompt and
output, and propose the k tokens that followed it. It costs no model and pays off where the
answer repeats or edits text it has seen (code edits, summaries quoting the source, RAG). The
engine looks up on the device (spec_decode.ngram.ngram_lookup, the same rule as `ngram_proposal` here),
so a step can run several rounds without the host; a row under a grammar is proposed for here,
its chain starting with the tokens the grammar forces next (host/structured.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .request import Request

METHODS = ("draft", "ngram", "medusa")
# structured outputs: constrained rows that may speculate in one step (the step's table of their
# masks after each proposal, StepInputs.spec.node_masks, has this many slots)
MAX_GUIDED_ROWS = 8
NGRAM_MAX_N, NGRAM_MIN_N = 4, 1   # prompt lookup: the suffix lengths tried, longest first


def ngram_proposal(tokens: list[int] | np.ndarray, k: int, max_n: int = NGRAM_MAX_N, min_n: int = NGRAM_MIN_N
                   ) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (max_n down to min_n tokens long) that occurred before; [] when none did."""
    arr = np.asarray(tokens, np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows starting at i < size - n: each has at least one token after it
        windows = sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start: start + k].tolist()
    return []


@dataclass
class Proposer:
    """propose(req, k, depth) for the scheduler: k placeholders (-1) the device fills in (the draft
    model's proposals; n-gram lookup when on_device, else the lookup here), or the Medusa tree the
    heads proposed in the request's last step (req.proposals; nothing when they are not for its
    current tokens) cut to its nodes of depth <= depth. tree_depths: the Medusa tree's node depths,
    in tree order."""
    method: str
    max_n: int = NGRAM_MAX_N
    min_n: int = NGRAM_MIN_N
    tree_depths: tuple[int, ...] = ()
    on_device: bool = False     # n-gram: the step looks up (spec_decode.ngram.ngram_lookup)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_method={self.method!r} is not one of {(None, *METHODS)}")

    def __call__(self, req: Request, k: int, depth: int) -> list[int]:
        """Under a grammar (req.guide, host/structured.py): a Medusa tree as the heads proposed it
        (a node the grammar rejects is never accepted); an n-gram chain that starts with the tokens
        the grammar forces next, cut at the first token it rejects; no draft-model proposals (they
        are made inside the step, where no matcher can check them)."""
        if self.method == "medusa":
            if req.proposals is None or req.proposals[0] != len(req.all_ids):
                return []
            nodes = sum(1 for d in self.tree_depths if d <= depth)
            return list(req.proposals[1][:min(k, nodes)])
        k = min(k, depth)
        if self.method == "draft":
            return [-1] * k if self.proposes_for(req) else []
        if req.guide is None:
            return [-1] * k if self.on_device else ngram_proposal(req.all_ids, k, self.max_n, self.min_n)
        forced = req.guide.forced()[:k]
        chain = forced + ngram_proposal(req.all_ids + forced, k - len(forced), self.max_n, self.min_n)
        return chain[:req.guide.valid_prefix(chain)]

    def proposes_for(self, req: Request) -> bool:
        """Whether this proposer ever proposes for req: not the draft model for a row under a grammar."""
        return not (self.method == "draft" and req.guide is not None)

    def draws(self, n: int) -> int:
        """The most tokens a row with n proposals draws: 1 + n for a chain, 1 + the depth of the
        n-th node for a tree (its nodes are in depth order)."""
        return 1 + (self.tree_depths[n - 1] if self.method == "medusa" and n > 0 else n)


@dataclass
class SpecStats:
    """Counters named like vLLM's spec_decode metrics: drafts (rows that proposed), draft tokens
    (proposed), accepted tokens, accepted per position (position i: the i-th proposal of a draft)."""
    num_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_tokens

    def add(self, counts) -> None:
        """One speculating row of a step, the device's counts (StepOutputs.spec_counts): counts[0]
        rounds run, counts[1] of them proposed, counts[2] tokens in all; counts[3 + i] rounds
        accepted the i-th proposal (a Medusa tree: a node at depth i + 1)."""
        self.num_drafts += int(counts[1])
        self.num_draft_tokens += int(counts[2])
        for i in range(min(len(counts) - 3, self.num_tokens)):
            self.accepted_per_pos[i] += int(counts[3 + i])
            self.num_accepted_tokens += int(counts[3 + i])

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a speculating row gains per step: 1 + accepted / drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                                if self.num_draft_tokens else None),
                "spec_decode_mean_acceptance_length": self.mean_acceptance_length}
