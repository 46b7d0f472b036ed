"""SchedulerOutput -> bucketed StepInputs -> one call of the jitted step (jaxinfer/step.py).

The host-to-device contract is `step.StepInputs` (its docstring has the table); this module packs
the scheduler's plan into it as numpy arrays padded to a few bucketed shapes (the attention
metadata, work items included, from kv_cache.build_attention_metadata) and turns the StepOutputs
back into per-request samples. The KV pages live on the device and are donated to every step, so
they are updated in place.
T is bucketed to powers of two up to the token budget, S = min(T, max_num_seqs); B (blocks per
sequence) is the full max_model_len for the XLA attention (its work follows the step's work items,
whose array sizes depend on T alone) and powers of four for the Pallas kernel: each (T, B) pair of
kv_cache.attention_buckets compiles once at warm-up and never again (multi-step decoding runs
inside the same program, so it adds no shape).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import perf
from jaxinfer.config import MAX_LOGIT_BIAS, ModelConfig
from jaxinfer.host.scheduler import SchedulerOutput, StepSample
from jaxinfer.host.speculative import MAX_GUIDED_ROWS, NGRAM_MAX_N, NGRAM_MIN_N
from jaxinfer.host.structured import Grammars, mask_words
from jaxinfer.kv_cache import (PAD_SLOT, TREE_NONE, StepRow, attention_buckets, build_attention_metadata,
                               init_kv_pages, kv_storage_dtype)
from jaxinfer.medusa import tree_arrays
from jaxinfer.models.decoder import Decoder
from jaxinfer.sampling import SamplingBatch
from jaxinfer.sharding import kv_sharding, model_mesh
from jaxinfer.step import MAX_STOP_IDS, SpecInputs, StepInputs, StepOutputs, StepSettings, jit_step


INT32_MAX = np.iinfo(np.int32).max


class CompileCounter:
    """Counts XLA backend compilations in this process (every jit, eager op or kernel)."""
    _lock = threading.Lock()
    count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


@dataclass
class Launched:
    """A dispatched step: its plan, the request each row samples for, and its (future) outputs."""
    plan: SchedulerOutput
    rows: list
    outputs: StepOutputs
    t_launch: float = 0.0
    samples: dict | None = None   # the step's tokens per request, once fetched
    t_fetched: float = 0.0        # when they reached the host
    spec_counts: object = None    # speculation: per row, rounds that proposed and accepted per position
    proposals: object = None      # Medusa: per row, its next tree's tokens [S, N]


@dataclass(frozen=True)
class RunnerConfig:
    """The runner's settings: engine.runner_config derives them from the ResolvedConfig."""
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_dtype: str                        # the pages' format by name (config.KV_DTYPE_CHOICES)
    attention: str = "xla"
    max_decode_steps: int = 1            # K: decode iterations one call may run (StepSettings.max_iters)
    eos_ids: tuple[int, ...] = ()        # end a row on device unless the request ignores EOS
    spec_tokens: int = 0                 # K > 0: speculative decoding with up to K proposals per row
    spec_rounds: int = 1                 # ... and up to this many rounds per step (StepSettings.max_iters)


def _pow2_buckets(lo: int, hi: int, base: int = 2) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    return out + [hi]


class ModelRunner:
    def __init__(self, model: Decoder, cfg: RunnerConfig, draft: Decoder | None = None, medusa_heads=None,
                 grammars: Grammars | None = None, publish_step: Callable[..., None] | None = None):
        """draft: the draft model of speculative decoding (cfg.spec_tokens > 0): its params and KV
        pages ride with the target's as (target, draft) pairs; its pages use the same blocks.
        medusa_heads: (MedusaHeads, Tree) of speculative_method="medusa" (cfg.spec_tokens: the tree's
        depth): params (target, heads), the target's pages only. grammars: structured outputs'
        grammars, which fill the masks of constrained rows. publish_step: multi-host, on process 0:
        called with each step's host inputs before the step runs, so that the other processes run
        the same step (run_published; jaxinfer.distributed)."""
        CompileCounter.install()
        self.model_cfg: ModelConfig = model.cfg
        self.cfg = cfg
        kv_dtype = kv_storage_dtype(cfg.kv_dtype)   # the pages' storage dtype, from the one name
        self.graphdef, self.params = nnx.split(model)
        mc = self.model_cfg
        self.mesh = model_mesh(self.params)   # None unless the model was sharded (sharding.shard_decoder)
        self.kv_sharding, self.kv_pages = self._init_kv_pages(kv_dtype)
        # the draft model and Medusa heads are small: one device holds them, or under tensor
        # parallelism every device a full copy (each computes the same proposals; no collectives)
        beside = jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        draft_graphdef = None
        if draft is not None:
            assert cfg.spec_tokens > 0
            draft_graphdef, draft_params = nnx.split(draft)
            dc = draft.cfg
            draft_pages = jax.device_put(init_kv_pages(dc.n_layers, dc.n_kv_heads, dc.head_dim, cfg.num_blocks,
                                                       cfg.block_size, kv_dtype), beside)
            self.params = (self.params, jax.device_put(draft_params, beside))
            self.kv_pages = (self.kv_pages, draft_pages)
        medusa_graphdef, self.tree, self.tree_arrays = None, None, None
        if medusa_heads is not None:
            assert cfg.spec_tokens > 0
            heads, self.tree = medusa_heads
            self.tree_arrays = tree_arrays(self.tree)
            medusa_graphdef, heads_params = nnx.split(heads)
            self.params = (self.params, jax.device_put(heads_params, beside))
        self.kv_bytes_per_token = perf.kv_bytes_per_token(mc.n_layers, mc.n_kv_heads, mc.head_dim, cfg.kv_dtype)
        self.token_buckets = _pow2_buckets(min(8, cfg.max_num_batched_tokens), cfg.max_num_batched_tokens)
        max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.block_buckets = ([max_blocks] if cfg.attention == "xla"
                              else _pow2_buckets(min(4, max_blocks), max_blocks, base=4))
        self._no_history: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._no_mask: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}
        self.mask_words = mask_words(self.model_cfg.vocab_size)
        self.grammars = grammars
        self.mask_time_s = 0.0   # host time spent filling grammar masks
        self._unfilled = None    # (rows' guides, the mask array) of the step being prepared
        self._unfilled_paths = None   # (speculating rows' guides and paths, node_masks) of that step
        self._no_node_masks: dict[int, jax.Array] = {}   # 0: the all-allowed table; S: no slots
        self._no_draft_meta: dict[tuple[int, int], object] = {}   # (S, B): the draft's empty proposal layout
        replicate = (NamedSharding(self.mesh, PartitionSpec())
                     if self.mesh is not None and jax.process_count() > 1 else None)
        self.settings = StepSettings(graphdef=self.graphdef, attention=cfg.attention,
                                     # a speculative engine's steps loop over rounds: multi-step
                                     # decoding where no row speculates, speculation rounds otherwise
                                     max_iters=max(cfg.spec_rounds, cfg.max_decode_steps, 1),
                                     max_rows=self.num_seqs_for(self.token_buckets[-1]),
                                     kv_sharding=self.kv_sharding, replicate_samples=replicate,
                                     spec_tokens=cfg.spec_tokens, draft_graphdef=draft_graphdef,
                                     medusa_graphdef=medusa_graphdef, tree=self.tree,
                                     # n-gram: prompt lookup on the device
                                     ngram=(NGRAM_MAX_N, NGRAM_MIN_N) if cfg.spec_tokens and draft is None
                                     and medusa_heads is None else ())
        self.out_rows = self.settings.out_rows
        self.step = jit_step(self.settings)
        # a speculative engine's steps where nothing speculative happens (the load policy's, prefill
        # chunks): the plain engine's program over the target alone. The speculative program costs
        # more even where it speculates nowhere (its draft and verification scaffolding: 0.84x of no
        # speculation at 16 and 64 sequences with the draft method, bench/speculative.py)
        self.plain_step = None
        if cfg.spec_tokens:
            self.plain_step = jit_step(StepSettings(graphdef=self.graphdef, attention=cfg.attention,
                                                    max_iters=max(cfg.max_decode_steps, 1),
                                                    max_rows=self.settings.max_rows, kv_sharding=self.kv_sharding,
                                                    replicate_samples=replicate, next_rows=self.out_rows))
        # the prev_tokens of a step whose tokens the host all knows (no previous step in flight)
        self._no_prev = jax.device_put(np.zeros(self.out_rows * self.settings.max_rows, np.int32),
                                       jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh, PartitionSpec()))
        self.publish_step = publish_step

    def _init_kv_pages(self, kv_dtype):
        """(sharding or None, the zeroed KV pages: one LayerKV per layer)."""
        mc, cfg = self.model_cfg, self.cfg
        make_pages = lambda: init_kv_pages(mc.n_layers, mc.n_kv_heads, mc.head_dim, cfg.num_blocks,  # noqa: E731
                                           cfg.block_size, kv_dtype)
        if self.mesh is None:
            # committed to the device like every step's output, so warm-up compiles the same executable
            # that serving uses (an uncommitted first input keys a different jit cache entry)
            return None, jax.device_put(make_pages(), jax.devices()[0])
        # allocated in place on every device: the global pool never sits on one device
        sharding = kv_sharding(self.mesh, mc.n_kv_heads)
        return sharding, jax.jit(make_pages, out_shardings=sharding)()

    # -------------------------------------------------------------------- buckets
    def choose_token_buckets(self, smallest: int) -> None:
        """Start the token buckets at `smallest` (a benchmark measuring what a step padded to it
        costs); before warm-up, which compiles the buckets there are then."""
        self.token_buckets = [smallest] + [b for b in self.token_buckets if b > smallest]

    def num_seqs_for(self, t: int) -> int:
        return min(t, self.cfg.max_num_seqs)

    @staticmethod
    def _bucket(n: int, buckets: list[int]) -> int:
        for b in buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

    def blocks_needed(self, seqs) -> int:
        """Block-table width a step needs: both attentions read every key, this step's included,
        through the pages; multi-step decoding also positions start + 1 .. start + max_draws - 1."""
        bs = self.cfg.block_size
        return max(1, max((-(-(q.start + q.num_tokens + q.lookahead) // bs) for q in seqs), default=1))

    def _history(self, s: int, rows: list, any_penalty: bool) -> tuple[jax.Array, jax.Array]:
        h = self.cfg.max_model_len
        if not any_penalty:
            if s not in self._no_history:   # built once per bucket at warm-up: no per-step transfer
                self._no_history[s] = jax.device_put((np.full((s, h), -1, np.int32), np.zeros((s, h), np.bool_)))
            return self._no_history[s]
        hist = np.full((s, h), -1, np.int32)
        is_out = np.zeros((s, h), np.bool_)
        for i, req in enumerate(rows):
            if req is None:
                continue
            ids = req.all_ids
            hist[i, : len(ids)] = ids
            is_out[i, len(req.prompt_ids): len(ids)] = True
        return hist, is_out   # numpy: the jitted step transfers it (jnp.asarray would compile a copy)

    def _constraints(self, s: int, rows: list) -> tuple:
        """(token_mask [S, W], bias_ids [S, B], bias_values [S, B]): numpy when some row is
        constrained or biased; otherwise arrays built once per bucket (no per-step transfer)."""
        guided = [(req.guide, i) for i, req in enumerate(rows) if req is not None and req.guide is not None]
        biased = [(i, req.params.logit_bias) for i, req in enumerate(rows) if req is not None and req.params.logit_bias]
        if s not in self._no_mask:
            self._no_mask[s] = jax.device_put((np.full((s, self.mask_words), -1, np.int32),
                                               np.full((s, MAX_LOGIT_BIAS), -1, np.int32),
                                               np.zeros((s, MAX_LOGIT_BIAS), np.float32)))
        if not guided and not biased:
            return self._no_mask[s]
        mask = self._no_mask[s][0]
        if guided:
            mask = np.full((s, self.mask_words), -1, np.int32)
            self._unfilled = (guided, mask)   # filled by fill_masks, just before dispatch
        if not biased:
            return (mask, *self._no_mask[s][1:])
        bias_ids = np.full((s, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
        for i, pairs in biased:
            bias_ids[i, :len(pairs)] = [t for t, _ in pairs]
            bias_values[i, :len(pairs)] = [v for _, v in pairs]
        return mask, bias_ids, bias_values

    # -------------------------------------------------------------------- host -> device
    def prepare(self, out: SchedulerOutput, tables: dict[str, list[int]], buckets: tuple[int, int] | None = None,
                plain: bool | None = None) -> tuple[StepInputs, list]:
        """The step's StepInputs (numpy, padded to the (T, S, B) bucket; `buckets`: this (T, B) instead
        of the smallest that fits, as pipeline micro-batches share one) and its rows: the request
        each row samples for, or None. A speculative engine's step with nothing speculative in it
        (`plain`, default: `_plain(out)`) gets no SpecInputs (spec None): plain_step runs it."""
        plain = self._plain(out) if plain is None else plain
        t = self._bucket(max(out.num_batched_tokens, 1), self.token_buckets)
        b = self._bucket(self.blocks_needed(out.seqs), self.block_buckets)
        if buckets is not None:
            assert buckets[0] >= t and buckets[1] >= b, (buckets, t, b)
            t, b = buckets
        s = self.num_seqs_for(t)
        assert len(out.seqs) <= s
        meta = build_attention_metadata([StepRow(q.start, q.num_tokens, tables[q.request.request_id], q.lookahead)
                                         for q in out.seqs], self.cfg.block_size, t, s, b)   # (T, S, B)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        logits_indices = np.zeros(s, np.int32)
        rows: list = [None] * s
        max_new = np.zeros(s, np.int32)
        from_prev = np.full(t, -1, np.int32)
        num_spec = np.zeros(s, np.int32)
        for i, q in enumerate(out.seqs):
            req, first, n = q.request, meta.query_start_loc[i], q.num_tokens
            known = req.all_ids[q.start: q.start + n - len(q.spec)]
            if q.spec:   # proposals follow the row's last token (-1: the draft model fills them in)
                known = known + [max(t, 0) for t in q.spec]
                num_spec[i] = len(q.spec)
            tokens[first: first + len(known)] = known
            if len(known) < n:   # the last token is still on the device (async scheduling)
                assert len(known) == n - 1 and req.inflight_index >= 0, (req.request_id, len(known), n)
                from_prev[first + n - 1] = req.inflight_index
            positions[first: first + n] = np.arange(q.start, q.start + n, dtype=np.int32)
            logits_indices[i] = first + n - 1
            if q.sample:
                rows[i] = req
                max_new[i] = q.max_draws
        # the drawn token's position is one past the last computed token of its row (a speculating
        # row: one past its last drawn token; speculative.verify steps through the proposals)
        if self.tree is not None and not plain:
            self._tree_layout(out, meta, positions)
        # n-gram rows with placeholders: the device looks up their proposals in their histories
        lookup = np.zeros(s, np.bool_)
        if self.settings.ngram:
            lookup[:len(out.seqs)] = [bool(q.spec) and q.spec[0] == -1 for q in out.seqs]
        sb = self._sampling_batch(rows, positions[logits_indices - num_spec] + 1, bool(lookup.any()))
        spec = None
        if self.cfg.spec_tokens and not plain:
            node_masks, mask_slot = self._node_masks(out, s)
            spec = SpecInputs(num_spec, propose=np.bool_(out.speculating) if self.tree is not None else None,
                              node_masks=node_masks, mask_slot=mask_slot,
                              lookup=lookup if self.settings.ngram else None)
            if self.settings.draft_graphdef is not None:
                spec = self._draft_inputs(out, tables, num_spec, s, b, node_masks, mask_slot, meta)
        inputs = StepInputs(tokens, positions, meta, logits_indices, sb, self._stop_ids(rows), max_new,
                            np.int32(out.num_decode_iters), from_prev, spec)
        return inputs, rows

    def _tree_layout(self, out: SchedulerOutput, meta, positions: np.ndarray) -> None:
        """Medusa: a verifying row's nodes sit at positions root + depth (their slots follow the root
        in tree order), and meta.tree gives every token its slot index, its row's first node slot and
        the nodes it sees (medusa.py)."""
        t = len(positions)
        tree = np.zeros((t, 3), np.int32)
        tree[:, 0] = positions
        tree[:, 1] = TREE_NONE
        a = self.tree_arrays
        for i, q in enumerate(out.seqs):
            if q.spec:
                root = int(meta.query_start_loc[i]) + q.num_tokens - len(q.spec) - 1
                nodes = slice(root + 1, root + 1 + len(q.spec))
                tree[root: nodes.stop, 1] = positions[root] + 1
                tree[nodes, 2] = a["ancestors"][1: 1 + len(q.spec)]
                positions[nodes] = positions[root] + a["depth"][1: 1 + len(q.spec)]
        meta.tree = tree

    def _node_masks(self, out: SchedulerOutput, s: int) -> tuple:
        """(node_masks [C, N, W], mask_slot [S]) of SpecInputs: the constrained speculating rows' slots
        and a table filled by fill_masks (after their matchers have seen every drawn token); a
        cached all-allowed pair when there are none (no per-step transfer)."""
        n = len(self.tree.paths) if self.tree is not None else self.cfg.spec_tokens
        c = min(MAX_GUIDED_ROWS, self.cfg.max_num_seqs)      # slots: the scheduler's cap, or fewer rows
        jobs, slot = [], np.full(s, -1, np.int32)
        for i, q in enumerate(out.seqs):
            if q.spec and q.request.guide is not None:
                assert len(jobs) < c, "the scheduler caps constrained speculating rows"
                slot[i] = len(jobs)
                jobs.append((q.request.guide, len(jobs), self._paths(q.spec)))
        if not jobs:
            if not self._no_node_masks:   # the table once, the slots per bucket
                self._no_node_masks[0] = jax.device_put(np.full((c, n, self.mask_words), -1, np.int32))
            if s not in self._no_node_masks:
                self._no_node_masks[s] = jax.device_put(np.full(s, -1, np.int32))
            return self._no_node_masks[0], self._no_node_masks[s]
        table = np.full((c, n, self.mask_words), -1, np.int32)
        self._unfilled_paths = (jobs, table)
        return table, slot

    def _paths(self, spec: list[int]) -> list[list[int]]:
        """The proposals from a row's last token to each of its nodes: d_1..d_j for a chain, the
        tokens along the tree path to node j for a Medusa tree (medusa.tree_arrays' path_nodes)."""
        if self.tree is None:
            return [spec[:j] for j in range(1, len(spec) + 1)]
        nodes = self.tree_arrays["path_nodes"]
        return [[spec[m - 1] for m in nodes[j, 1:] if m > 0] for j in range(1, len(spec) + 1)]

    def _draft_inputs(self, out: SchedulerOutput, tables: dict[str, list[int]], num_spec: np.ndarray, s: int,
                      b: int, node_masks, mask_slot, meta) -> SpecInputs:
        """The draft model's proposal iterations: one token per speculating row (its first proposal,
        at t0's position + 1; later iterations advance it on the device), in row order; and where the
        draft writes the step's tokens: every token's slot, while the target skips (PAD_SLOT in
        meta.slot_mapping) the positions of a catching-up draft whose target K/V is cached."""
        if any(q.spec for q in out.seqs):
            rows = [StepRow(q.start + q.num_tokens - len(q.spec), 1, tables[q.request.request_id], q.max_draws - 2)
                    if q.spec else StepRow(0, 0, ()) for q in out.seqs]
            dm = build_attention_metadata(rows, self.cfg.block_size, s, s, b)
        else:   # no proposal iterations (the load policy's steps): the same empty layout every time
            if (s, b) not in self._no_draft_meta:
                self._no_draft_meta[s, b] = build_attention_metadata([], self.cfg.block_size, s, s, b)
            dm = self._no_draft_meta[s, b]
        positions = np.zeros(s, np.int32)
        draft_slots = meta.slot_mapping.copy()
        for i, q in enumerate(out.seqs):
            positions[i] = q.start + q.num_tokens - len(q.spec)   # t0's position + 1
            if q.draft_only:
                first = int(meta.query_start_loc[i])
                meta.slot_mapping[first: first + q.draft_only] = PAD_SLOT
        return SpecInputs(num_spec, dm, positions, node_masks=node_masks, mask_slot=mask_slot,
                          draft_slots=draft_slots, run_target=np.bool_(out.run_target))

    def _stop_ids(self, rows: list) -> np.ndarray:
        """[S, MAX_STOP_IDS]: the ids that end each row on device (-1 padded). Ids beyond the first
        MAX_STOP_IDS are left to the host, which discards what a row drew after its stop."""
        out = np.full((len(rows), MAX_STOP_IDS), -1, np.int32)
        for i, req in enumerate(rows):
            if req is not None:
                ids = (() if req.params.ignore_eos else self.cfg.eos_ids) + req.params.stop_token_ids
                ids = ids[:MAX_STOP_IDS]
                out[i, :len(ids)] = ids
        return out

    def _sampling_batch(self, rows: list, positions_of_rows: np.ndarray, lookup: bool = False) -> SamplingBatch:
        """lookup: the step reads the rows' histories for prompt lookup too (not only penalties)."""
        s = len(rows)
        f = lambda v: np.full(s, v, np.float32)  # noqa: E731
        temp, top_p, min_p, rep, pres, freq = f(0.0), f(1.0), f(0.0), f(1.0), f(0.0), f(0.0)
        top_k, seed, index = np.zeros(s, np.int32), np.zeros(s, np.uint32), np.zeros(s, np.int32)
        num_logprobs = np.zeros(s, np.int32)
        for i, req in enumerate(rows):
            if req is None:
                continue
            p = req.params
            # top_k past the vocabulary means "off" and may exceed int32 (the API takes any integer)
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, min(p.top_k, INT32_MAX), p.top_p, p.min_p
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            seed[i], index[i] = req.seed & 0xFFFFFFFF, req.sample_index
            num_logprobs[i] = p.logprobs or 0
        any_penalty = bool(np.any((rep != 1) | (pres != 0) | (freq != 0)))
        hist, is_out = self._history(s, rows, any_penalty or lookup)
        return SamplingBatch(temp, top_k, top_p, min_p, rep, pres, freq, seed, index,
                             positions_of_rows.astype(np.int32), num_logprobs, hist, is_out,
                             *self._constraints(s, rows))

    def execute(self, out: SchedulerOutput, tables: dict[str, list[int]]) -> dict[str, list[StepSample]]:
        """Run one step and wait for its tokens."""
        return self.fetch(self.launch(out, tables))

    def fill_masks(self) -> None:
        """The grammar masks of the step just prepared (its inputs hold the arrays): each constrained
        row's next-token mask, and the masks after each proposal of those that speculate."""
        t0 = time.perf_counter()
        if self._unfilled is not None:
            (guided, mask), self._unfilled = self._unfilled, None
            self.grammars.fill(guided, mask)
        if self._unfilled_paths is not None:
            (jobs, table), self._unfilled_paths = self._unfilled_paths, None
            self.grammars.fill_paths(jobs, table)
        self.mask_time_s += time.perf_counter() - t0

    def launch(self, out: SchedulerOutput, tables: dict[str, list[int]], prev: Launched | None = None,
               before_dispatch: Callable[[], None] | None = None) -> Launched:
        """Dispatch one step without waiting for it. prev: the step still in flight, whose tokens on
        the device feed this step's rows that continue it (async scheduling). before_dispatch: called
        after the inputs are prepared and before the grammar masks are filled and the step dispatched
        (the engine feeds step N's tokens to the matchers there, so preparing N+1 overlaps step N)."""
        self._unfilled = self._unfilled_paths = None
        inputs, rows = self.prepare(out, tables)
        if before_dispatch is not None:
            before_dispatch()
        self.fill_masks()
        if self.publish_step is not None:
            self.publish_step(inputs)
        prev_tokens = self._no_prev if prev is None else prev.outputs.next_tokens
        outputs = self._dispatch(inputs, prev_tokens)
        for i, (q, req) in enumerate(zip(out.seqs, rows)):
            if req is not None:    # where this row's last draw will lie in outputs.next_tokens
                req.inflight_index = (q.max_draws - 1) * self.settings.max_rows + i
        return Launched(out, rows, outputs)

    def _plain(self, out: SchedulerOutput) -> bool:
        """A speculative engine's step with nothing speculative in it: no row has proposals, the draft
        model does not run (nor catches up), Medusa's heads propose no next trees."""
        if self.plain_step is None or any(q.spec for q in out.seqs):
            return False
        if self.tree is not None:
            return not out.speculating
        if self.settings.draft_graphdef is not None:
            return not out.run_draft and out.run_target
        return True

    def _dispatch(self, inputs: StepInputs, prev_tokens) -> StepOutputs:
        """Run the step's program on its inputs: a speculative engine's inputs without SpecInputs
        (prepare's plain steps) go to plain_step, every other to the engine's step."""
        if self._is_plain(inputs):
            return self._run_plain(inputs, prev_tokens)
        outputs, self.kv_pages = self.step(self.params, self.kv_pages, inputs, prev_tokens)
        return outputs

    def _is_plain(self, inputs: StepInputs) -> bool:
        """Whether plain_step runs `inputs`: a speculative engine's step without SpecInputs."""
        return self.plain_step is not None and inputs.spec is None

    def _target_state(self):
        """(params, KV pages) of the target alone: a speculative engine holds them paired with the
        draft's (params and pages) or the Medusa heads' (params)."""
        draft = self.settings.draft_graphdef is not None
        params = self.params[0] if draft or self.tree is not None else self.params
        return params, (self.kv_pages[0] if draft else self.kv_pages)

    def _run_plain(self, inputs: StepInputs, prev_tokens) -> StepOutputs:
        """plain_step over the target's params and pages (the draft's pages are left as they are)."""
        assert inputs.spec is None and inputs.meta.tree is None
        params, pages = self._target_state()
        outputs, pages = self.plain_step(params, pages, inputs, prev_tokens)
        self.kv_pages = (pages, self.kv_pages[1]) if self.settings.draft_graphdef is not None else pages
        return outputs

    def fetch(self, launched: Launched) -> dict[str, list[StepSample]]:
        """Wait for a launched step; its tokens per request (read from the device once)."""
        if launched.samples is None:
            launched.samples, launched.spec_counts, launched.proposals = self._results(launched.rows,
                                                                                      launched.outputs)
        return launched.samples

    @staticmethod
    def _results(rows: list, outputs: StepOutputs) -> tuple[dict[str, list[StepSample]], object, object]:
        """Row i's drawn tokens -> its request's StepSamples (padding rows, None, are skipped), and the
        speculation counts and Medusa proposals (or None). One device-to-host copy: the ids, logprobs,
        counts, speculation counts and proposals (the top-N only when some row asked)."""
        ids, lps, drawn, spec_counts, proposals = jax.device_get(
            (outputs.ids, outputs.logprobs, outputs.num_drawn, outputs.spec_counts, outputs.proposals))
        want_top = any(r is not None and r.params.logprobs for r in rows)
        if want_top:
            top_ids, top_lps = jax.device_get((outputs.top_ids, outputs.top_logprobs))
        result = {}
        for i, req in enumerate(rows):
            if req is None:
                continue
            k = req.params.logprobs or 0
            result[req.request_id] = [
                StepSample(int(ids[j, i]), float(lps[j, i]),
                           [(int(a), float(b)) for a, b in zip(top_ids[j, i, :k], top_lps[j, i, :k])] if k else None)
                for j in range(int(drawn[i]))]
        return result, spec_counts, proposals

    def run_published(self, inputs: StepInputs) -> None:
        """Multi-host followers: run the step process 0 prepared (same executable, pages donated).
        The results stay on the devices; only process 0 reads them. A None penalty history: process 0
        used its cached empty history (or mask, or bias), this process uses its own."""
        sb = inputs.sampling
        if sb.history is None:
            sb.history, sb.history_is_output = self._history(len(inputs.logits_indices), [], False)
        empty = self._constraints(len(inputs.logits_indices), [])   # any of the three sent as None
        for name, value in zip(("token_mask", "bias_ids", "bias_values"), empty):
            if getattr(sb, name) is None:
                setattr(sb, name, value)
        self._dispatch(inputs, self._no_prev)

    def replay(self, inputs: StepInputs) -> None:
        """Profiling only: run the jitted step on `inputs` again and wait for it (the KV writes land
        where they landed the first time, so the cache's contents do not change)."""
        outputs = self._dispatch(inputs, self._no_prev)
        jax.block_until_ready(outputs)

    def step_hlo(self, inputs: StepInputs) -> str:
        """Profiling only: the optimized HLO text of the step compiled for `inputs`' shapes."""
        if self._is_plain(inputs):
            params, pages = self._target_state()
            return self.plain_step.lower(params, pages, inputs, self._no_prev).compile().as_text()
        return self.step.lower(self.params, self.kv_pages, inputs, self._no_prev).compile().as_text()

    def empty_inputs(self, t: int, b: int, plain: bool = False) -> StepInputs:
        """A step of bucket (T, B) with no tokens: what warm-up runs (and the follower's treedef);
        plain: a speculative engine's plain_step layout (no SpecInputs)."""
        return self.prepare(SchedulerOutput(), {}, buckets=(t, b), plain=plain)[0]

    def warmup(self) -> int:
        """Compile every (T, B) bucket; returns the number of shapes. Penalties need no variant:
        lax.cond compiles both branches, and the history's shape never changes."""
        buckets = attention_buckets(self.token_buckets, self.block_buckets)
        for t, b in buckets:
            outputs, self.kv_pages = self.step(self.params, self.kv_pages, self.empty_inputs(t, b), self._no_prev)
            outputs.ids.block_until_ready()
            if self.plain_step is not None:
                self._run_plain(self.empty_inputs(t, b, plain=True), self._no_prev).ids.block_until_ready()
        return len(buckets)
