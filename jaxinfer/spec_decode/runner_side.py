"""The runner's half of speculative decoding: what ModelRunner (runner.py) asks of it, one call per
concern, so that the runner holds no speculative code.

  SpecRunner.attach          the draft model's or Medusa heads' params beside the target's
                             (TargetDraft / TargetHeads), and the draft's KV pages (target, draft)
  SpecRunner.step_settings   the speculative program's settings; jit_spec_step jits it
  SpecRunner.is_plain        a step with nothing speculative in it (the plain program runs it)
  SpecRunner.tree_layout     Medusa: the verifying rows' node positions and meta.tree
  SpecRunner.spec_inputs     the step's SpecInputs (numpy): proposals, grammar masks per node,
                             the draft model's proposal layout
  SpecRunner.fill_paths      the grammar masks after each proposal, just before dispatch
  target_state / with_target_pages: the target's params and pages, for the plain program

Host side, numpy; the arrays built here go to the device with the step's inputs.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxinfer.host.scheduler import SchedulerOutput
from jaxinfer.host.speculative import MAX_GUIDED_ROWS, NGRAM_MAX_N, NGRAM_MIN_N
from jaxinfer.kv_cache import PAD_SLOT, TREE_NONE, StepRow, build_attention_metadata, init_kv_pages
from jaxinfer.spec_decode.contract import SpecInputs, SpecStepSettings, TargetDraft, TargetHeads
from jaxinfer.spec_decode.medusa import tree_arrays


class SpecRunner:
    """One speculative engine's runner side: its method, the Medusa tree, and the arrays it caches so
    that steps without proposals or grammars transfer nothing."""

    def __init__(self, spec_tokens: int, block_size: int, max_num_seqs: int, mask_words: int,
                 draft_graphdef: nnx.GraphDef | None = None, heads_graphdef: nnx.GraphDef | None = None,
                 tree=None):
        assert spec_tokens > 0
        self.method = "draft" if draft_graphdef is not None else "medusa" if tree is not None else "ngram"
        self.spec_tokens, self.block_size, self.max_num_seqs = spec_tokens, block_size, max_num_seqs
        self.mask_words = mask_words
        self.draft_graphdef, self.heads_graphdef, self.tree = draft_graphdef, heads_graphdef, tree
        self.tree_arrays = tree_arrays(tree) if tree is not None else None
        self.unfilled_paths = None   # (speculating rows' guides and paths, node_masks) of the step being prepared
        self._no_node_masks: dict[int, jax.Array] = {}   # 0: the all-allowed table; S: no slots
        self._no_draft_meta: dict[tuple[int, int], object] = {}   # (S, B): the draft's empty proposal layout

    @classmethod
    def attach(cls, spec_tokens: int, block_size: int, max_num_seqs: int, mask_words: int, params, kv_pages,
               draft=None, medusa_heads=None, beside=None, kv_dtype=None, num_blocks: int = 0):
        """-> (SpecRunner, params, kv_pages) of an engine that speculates: a draft model's params
        (TargetDraft) and pages (the target's blocks; (target, draft): contract.py), Medusa heads' params
        (TargetHeads; the target's pages alone), or n-gram's (the target's alone). beside: where the
        small model lives (one device, or replicated over the target's mesh)."""
        draft_graphdef = heads_graphdef = tree = None
        if draft is not None:
            draft_graphdef, draft_params = nnx.split(draft)
            dc = draft.cfg
            draft_pages = jax.device_put(init_kv_pages(dc.n_layers, dc.n_kv_heads, dc.head_dim, num_blocks,
                                                       block_size, kv_dtype, dc.kv_value_dim), beside)
            params = TargetDraft(params, jax.device_put(draft_params, beside))
            kv_pages = (kv_pages, draft_pages)
        if medusa_heads is not None:
            heads, tree = medusa_heads
            heads_graphdef, heads_params = nnx.split(heads)
            params = TargetHeads(params, jax.device_put(heads_params, beside))
        runner = cls(spec_tokens, block_size, max_num_seqs, mask_words, draft_graphdef, heads_graphdef, tree)
        return runner, params, kv_pages

    def step_settings(self, **plain) -> SpecStepSettings:
        """The speculative program's settings: the plain step's (`plain`) and this method's."""
        return SpecStepSettings(**plain, method=self.method, spec_tokens=self.spec_tokens,
                                draft_graphdef=self.draft_graphdef, medusa_graphdef=self.heads_graphdef,
                                tree=self.tree,
                                # n-gram: prompt lookup on the device
                                ngram=(NGRAM_MAX_N, NGRAM_MIN_N) if self.method == "ngram" else ())

    def is_plain(self, sched: SchedulerOutput) -> bool:
        """A step with nothing speculative in it: no row has proposals, the draft model does not run
        (nor catches up), Medusa's heads propose no next trees."""
        if any(seq.spec for seq in sched.seqs):
            return False
        if self.method == "medusa":
            return not sched.speculating
        if self.method == "draft":
            return not sched.run_draft and sched.run_target
        return True

    def tree_layout(self, sched: SchedulerOutput, meta, positions: np.ndarray) -> None:
        """Medusa: a verifying row's nodes sit at positions root + depth (their slots follow the root
        in tree order), and meta.tree gives every token its slot index, its row's first node slot and
        the nodes it sees (medusa.py)."""
        if self.tree is None:
            return
        t = len(positions)
        tree = np.zeros((t, 3), np.int32)
        tree[:, 0] = positions
        tree[:, 1] = TREE_NONE
        a = self.tree_arrays
        for i, seq in enumerate(sched.seqs):
            if seq.spec:
                root = int(meta.query_start_loc[i]) + seq.num_tokens - len(seq.spec) - 1
                nodes = slice(root + 1, root + 1 + len(seq.spec))
                tree[root: nodes.stop, 1] = positions[root] + 1
                tree[nodes, 2] = a["ancestors"][1: 1 + len(seq.spec)]
                positions[nodes] = positions[root] + a["depth"][1: 1 + len(seq.spec)]
        meta.tree = tree

    def lookup_rows(self, sched: SchedulerOutput, s: int) -> np.ndarray | None:
        """n-gram: [S] the rows with placeholders, whose proposals the device looks up in their
        histories; None for the other methods."""
        if self.method != "ngram":
            return None
        lookup = np.zeros(s, np.bool_)
        lookup[:len(sched.seqs)] = [bool(seq.spec) and seq.spec[0] == -1 for seq in sched.seqs]
        return lookup

    def spec_inputs(self, sched: SchedulerOutput, tables: dict[str, list[int]], num_spec: np.ndarray, s: int,
                    b: int, meta, lookup: np.ndarray | None) -> SpecInputs:
        """The step's SpecInputs (numpy, S rows, B blocks per row); meta: the target's metadata, whose
        slot_mapping a catching-up draft pads (draft_inputs)."""
        node_masks, mask_slot = self._node_masks(sched, s)
        if self.method == "draft":
            return self._draft_inputs(sched, tables, num_spec, s, b, node_masks, mask_slot, meta)
        return SpecInputs(num_spec, propose=np.bool_(sched.speculating) if self.method == "medusa" else None,
                          node_masks=node_masks, mask_slot=mask_slot, lookup=lookup)

    def _node_masks(self, sched: SchedulerOutput, s: int) -> tuple:
        """(node_masks [C, N, W], mask_slot [S]) of SpecInputs: the constrained speculating rows' slots
        and a table filled by fill_paths (after their matchers have seen every drawn token); a
        cached all-allowed pair when there are none (no per-step transfer)."""
        n = len(self.tree.paths) if self.tree is not None else self.spec_tokens
        c = min(MAX_GUIDED_ROWS, self.max_num_seqs)      # slots: the scheduler's cap, or fewer rows
        jobs, slot = [], np.full(s, -1, np.int32)
        for i, seq in enumerate(sched.seqs):
            if seq.spec and seq.request.guide is not None:
                assert len(jobs) < c, "the scheduler caps constrained speculating rows"
                slot[i] = len(jobs)
                jobs.append((seq.request.guide, len(jobs), self._paths(seq.spec)))
        if not jobs:
            if not self._no_node_masks:   # the table once, the slots per bucket
                self._no_node_masks[0] = jax.device_put(np.full((c, n, self.mask_words), -1, np.int32))
            if s not in self._no_node_masks:
                self._no_node_masks[s] = jax.device_put(np.full(s, -1, np.int32))
            return self._no_node_masks[0], self._no_node_masks[s]
        table = np.full((c, n, self.mask_words), -1, np.int32)
        self.unfilled_paths = (jobs, table)
        return table, slot

    def _paths(self, spec: list[int]) -> list[list[int]]:
        """The proposals from a row's last token to each of its nodes: d_1..d_j for a chain, the
        tokens along the tree path to node j for a Medusa tree (medusa.tree_arrays' path_nodes)."""
        if self.tree is None:
            return [spec[:j] for j in range(1, len(spec) + 1)]
        nodes = self.tree_arrays["path_nodes"]
        return [[spec[m - 1] for m in nodes[j, 1:] if m > 0] for j in range(1, len(spec) + 1)]

    def _draft_inputs(self, sched: SchedulerOutput, tables: dict[str, list[int]], num_spec: np.ndarray, s: int,
                      b: int, node_masks, mask_slot, meta) -> SpecInputs:
        """The draft model's proposal iterations: one token per speculating row (its first proposal,
        at t0's position + 1; later iterations advance it on the device), in row order; and where the
        draft writes the step's tokens: every token's slot, while the target skips (PAD_SLOT in
        meta.slot_mapping) the positions of a catching-up draft whose target K/V is cached."""
        if any(seq.spec for seq in sched.seqs):
            rows = [StepRow(seq.start + seq.num_tokens - len(seq.spec), 1, tables[seq.request.request_id],
                            seq.max_draws - 2)
                    if seq.spec else StepRow(0, 0, ()) for seq in sched.seqs]
            dm = build_attention_metadata(rows, self.block_size, s, s, b)
        else:   # no proposal iterations (the load policy's steps): the same empty layout every time
            if (s, b) not in self._no_draft_meta:
                self._no_draft_meta[s, b] = build_attention_metadata([], self.block_size, s, s, b)
            dm = self._no_draft_meta[s, b]
        positions = np.zeros(s, np.int32)
        draft_slots = meta.slot_mapping.copy()
        for i, seq in enumerate(sched.seqs):
            positions[i] = seq.start + seq.num_tokens - len(seq.spec)   # t0's position + 1
            if seq.draft_only:
                first = int(meta.query_start_loc[i])
                meta.slot_mapping[first: first + seq.draft_only] = PAD_SLOT
        return SpecInputs(num_spec, dm, positions, node_masks=node_masks, mask_slot=mask_slot,
                          draft_slots=draft_slots, run_target=np.bool_(sched.run_target))

    def fill_paths(self, grammars) -> None:
        """The grammar masks after each proposal of the constrained rows that speculate in the step
        just prepared (host/structured.Grammars.fill_paths)."""
        if self.unfilled_paths is not None:
            (jobs, table), self.unfilled_paths = self.unfilled_paths, None
            grammars.fill_paths(jobs, table)


def target_state(params, kv_pages) -> tuple:
    """(params, KV pages) of the target alone: a speculative engine holds them paired with the
    draft's (params and pages) or the Medusa heads' (params)."""
    if isinstance(params, TargetDraft):
        return params.target, kv_pages[0]
    return (params.target if isinstance(params, TargetHeads) else params), kv_pages


def with_target_pages(params, kv_pages, target_pages):
    """kv_pages with the target's replaced (the draft's, if any, left as they are)."""
    return (target_pages, kv_pages[1]) if isinstance(params, TargetDraft) else target_pages
