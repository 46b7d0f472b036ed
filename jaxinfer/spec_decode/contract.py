"""What a speculative engine's step adds to the plain step's contract (jaxinfer/step.py): its inputs
(SpecInputs, carried by SpecStepInputs), its outputs (SpecStepOutputs: per-row counts, Medusa's
next trees), what it is compiled for (SpecStepSettings), and the pairs its params travel as
(TargetDraft, TargetHeads: named, so that no code indexes a tuple by position). A draft-model
engine's KV pages stay a plain (target, draft) tuple: they are the donated argument, which a
caller may replace (runner.kv_pages), and one pytree type whoever builds the pair means nothing
recompiles.

A subclass of each plain type keeps their fields first and in order, so a speculative step's
pytrees flatten to the plain step's leaves followed by its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.spec_decode.medusa import Tree
from jaxinfer.step import StepInputs, StepOutputs, StepSettings


class TargetDraft(NamedTuple):
    """A draft-model engine's params: the target's and the draft's."""
    target: Any
    draft: Any


class TargetHeads(NamedTuple):
    """A Medusa engine's params: the target's and its heads' (the heads keep no pages)."""
    target: Any
    heads: Any


@jax.tree_util.register_dataclass
@dataclass
class SpecInputs:
    """Speculative decoding: row s's last num_spec[s] tokens are proposals."""
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
class SpecStepInputs(StepInputs):
    spec: SpecInputs


@jax.tree_util.register_dataclass
@dataclass
class SpecStepOutputs(StepOutputs):
    # per row: [S, 3 + k] rounds run, rounds that proposed, tokens proposed, then how many rounds
    # accepted the proposal at each position (a Medusa tree: a node at each depth)
    spec_counts: jax.Array
    proposals: jax.Array | None = None     # Medusa: [S, N] each row's next tree, from what drew its last token


@dataclass(frozen=True, kw_only=True)
class SpecStepSettings(StepSettings):
    """What a speculative step is compiled for (static: hashable). max_iters: rounds per call."""
    method: str                                  # "draft" | "ngram" | "medusa" (host/speculative.METHODS)
    spec_tokens: int                             # K > 0: up to K proposals per row (Medusa: the tree's depth)
    draft_graphdef: nnx.GraphDef | None = None   # the draft model (params TargetDraft, pages (target, draft))
    medusa_graphdef: nnx.GraphDef | None = None  # Medusa heads (params: TargetHeads)
    tree: Tree | None = None                     # ... and their candidate tree
    ngram: tuple[int, ...] = ()                  # n-gram method: (max_n, min_n) of the device's prompt lookup

    @property
    def out_rows(self) -> int:
        """Rows of next_tokens (out_rows * max_rows) and of StepOutputs.ids: rounds of up to
        1 + K draws each (a Medusa tree: 1 + its depth), or multi-step decoding's next_rows."""
        per_round = (self.tree.depth if self.tree is not None else self.spec_tokens) + 1
        return max(self.max_iters * per_round, self.next_rows)
