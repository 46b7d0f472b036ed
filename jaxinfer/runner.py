"""SchedulerOutput -> bucketed StepInputs -> one call of the jitted step (jaxinfer/step.py).

The host-to-device contract is `step.StepInputs` (its docstring has the table); this module packs
the scheduler's output into it as numpy arrays padded to a few bucketed shapes (the attention
metadata, work items included, from kv_cache.build_attention_metadata) and turns the StepOutputs
back into per-request samples. The KV pages live on the device and are donated to every step, so
they are updated in place.
T is bucketed to powers of two up to the token budget, S = min(T, max_num_seqs); B (blocks per
sequence) is the full max_model_len for the XLA attention (its work follows the step's work items,
whose array sizes depend on T alone) and powers of four for the Pallas kernel: each (T, B) pair of
kv_cache.attention_buckets compiles once at warm-up and never again (multi-step decoding runs
inside the same program, so it adds no shape).
A speculative engine's inputs, params and pages come from its SpecRunner (spec_decode/runner_side.py),
one call per concern; its steps run spec_decode's program, or the plain one where nothing speculates.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import perf
from jaxinfer.config import MAX_LOGIT_BIAS, ModelConfig
from jaxinfer.config.sampling import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, MAX_MIN_TOKENS_STOP_IDS
from jaxinfer.host.scheduler import SchedulerOutput, StepSample
from jaxinfer.host.structured import Grammars, mask_words
from jaxinfer.kv_cache import (StepRow, attention_buckets, build_attention_metadata, init_kv_pages, kv_storage_dtype,
                               with_states)
from jaxinfer.kv_transfer import HostKVStore, TransferResult
from jaxinfer.lora.execute import LoraInputs
from jaxinfer.models.decoder import Decoder
from jaxinfer.prompt_logprobs import PromptRows, prompt_targets
from jaxinfer.sampling import SamplingBatch
from jaxinfer.sharding import kv_sharding, model_mesh
from jaxinfer.spec_decode import jit_spec_step
from jaxinfer.spec_decode.contract import SpecStepInputs, SpecStepOutputs, TargetDraft, TargetHeads
from jaxinfer.spec_decode.runner_side import SpecRunner, target_state, with_target_pages
from jaxinfer.step import MAX_STOP_IDS, StepInputs, StepOutputs, StepSettings, jit_step


INT32_MAX = np.iinfo(np.int32).max


def key_seed(seed: int) -> int:
    """A request's seed (any integer in [0, 2**63)) -> the uint32 the sampler's keys start from
    (jax.random.key takes 32 bits without x64). Seeds below 2**32 are themselves; larger ones go
    through splitmix64's finaliser, folded to 32 bits, so that seeds differing only above bit 31
    (s and s + 2**32) draw different streams instead of one."""
    if seed < 2**32:
        return seed
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


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
    """A dispatched step: what the scheduler scheduled, the request each row samples for, and its
    (future) outputs."""
    scheduled: SchedulerOutput
    rows: list
    outputs: StepOutputs
    t_launch: float = 0.0
    samples: dict | None = None   # the step's tokens per request, once fetched
    t_fetched: float = 0.0        # when they reached the host
    spec_counts: object = None    # speculation: per row, rounds that proposed and accepted per position
    proposals: object = None      # Medusa: per row, its next tree's tokens [S, N]
    prompt_rows: PromptRows | None = None   # the step's tokens whose prompt logprobs some request asked for
    pooled_rows: list = field(default_factory=list)   # embeddings: (row, request, epoch) it pools for


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """The runner's settings: engine.runner_config derives them from the ResolvedConfig."""
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_dtype: str                        # the pages' format by name (config.KV_DTYPE_CHOICES)
    token_buckets: tuple[int, ...]       # the step sizes compiled, ascending (ResolvedConfig.token_buckets)
    attention: str = "xla"
    max_decode_steps: int = 1            # K: decode iterations one call may run (StepSettings.max_iters)
    eos_ids: tuple[int, ...] = ()        # end a row on device unless the request ignores EOS
    spec_tokens: int = 0                 # K > 0: speculative decoding with up to K proposals per row
    spec_rounds: int = 1                 # ... and up to this many rounds per step (StepSettings.max_iters)
    kv_offload_slots: int = 0            # blocks the prefix cache's host tier holds (0: no host tier)
    logprobs_mode: str = "raw_logprobs"  # SamplingBatch.logprobs_mode (config.LOGPROBS_MODES)


def _pow2_buckets(lo: int, hi: int, base: int = 2) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    return out + [hi]


class ModelRunner:
    def __init__(self, model: Decoder, cfg: RunnerConfig, draft: Decoder | None = None, medusa_heads=None,
                 grammars: Grammars | None = None, publish_step: Callable[..., None] | None = None):
        """draft: the draft model of speculative decoding (cfg.spec_tokens > 0): its params ride with
        the target's as TargetDraft, its KV pages (the same blocks) as (target, draft).
        medusa_heads: (MedusaHeads, Tree) of speculative_method="medusa" (cfg.spec_tokens: the tree's
        depth): params TargetHeads, the target's pages only. grammars: structured outputs'
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
        # conv layers' states are in the activations' dtype, the embedding's (a PipelinedDecoder has none)
        self._state_dtype = model.embed.get_value().dtype if mc.has_state else None
        self.kv_sharding, self.kv_pages = self._init_kv_pages(kv_dtype)
        self.kv_bytes_per_token = perf.kv_bytes_per_token(mc.n_attn_layers, mc.n_kv_heads, mc.head_dim, cfg.kv_dtype,
                                                           mc.kv_value_dim)
        self.token_buckets = list(cfg.token_buckets)
        max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.block_buckets = ([max_blocks] if cfg.attention == "xla"
                              else _pow2_buckets(min(4, max_blocks), max_blocks, base=4))
        self._no_history: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._no_mask: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}
        self._no_bans: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}
        self._no_grammar: dict[int, jax.Array] = {}
        self._no_targets: dict[int, jax.Array] = {}   # prompt_targets of a step where nobody asks, per T
        self._prompt_rows = PromptRows()   # those of the step being prepared
        self._no_pooling: dict[int, jax.Array] = {}
        self.mask_words = mask_words(self.model_cfg.vocab_size)
        self.grammars = grammars
        self.mask_time_s = 0.0   # host time spent filling grammar masks
        self._unfilled = None    # (rows' guides, the mask array) of the step being prepared
        replicate = (NamedSharding(self.mesh, PartitionSpec())
                     if self.mesh is not None and jax.process_count() > 1 else None)
        plain_settings = dict(graphdef=self.graphdef, attention=cfg.attention, max_rows=self.num_seqs_for(
            self.token_buckets[-1]), kv_sharding=self.kv_sharding, replicate_samples=replicate)
        self.spec: SpecRunner | None = None
        self.plain_step = None
        if cfg.spec_tokens:
            self._init_spec(draft, medusa_heads, kv_dtype, plain_settings)
        else:
            assert draft is None and medusa_heads is None
            self.settings = StepSettings(**plain_settings, max_iters=max(cfg.max_decode_steps, 1))
            self.step = jit_step(self.settings)
        self.out_rows = self.settings.out_rows
        # the prev_tokens of a step whose tokens the host all knows (no previous step in flight)
        self._no_prev = jax.device_put(np.zeros(self.out_rows * self.settings.max_rows, np.int32),
                                       jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh, PartitionSpec()))
        self.publish_step = publish_step
        # multi-LoRA: the adapters' device slots (jaxinfer.lora.execute.LoraSlotsDevice), once enabled;
        # every step then carries each token's slot (its request's Request.lora_slot, -1: none)
        self.lora = None
        # the host tier's buffers and transfer programs (kv_transfer.py), over every page: the draft's too
        self.host_kv = HostKVStore(self.kv_pages, cfg.kv_offload_slots) if cfg.kv_offload_slots else None
        self._blank_pages = None   # the pages' layout, from their first release (sleep)
        self.state_slots: dict[str, int] = {}   # request -> its conv state slot (the engine's BlockManager's)

    def _init_spec(self, draft: Decoder | None, medusa_heads, kv_dtype, plain_settings: dict) -> None:
        """A speculative engine's SpecRunner, paired params and pages, and two programs: the
        speculative step, and the plain step over the target alone for the steps where nothing
        speculative happens (the load policy's, prefill chunks): the speculative program costs more
        even where it speculates nowhere (its draft and verification scaffolding)."""
        cfg = self.cfg
        # the draft model and Medusa heads are small: one device holds them, or under tensor
        # parallelism every device a full copy (each computes the same proposals; no collectives)
        beside = jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        self.spec, self.params, self.kv_pages = SpecRunner.attach(
            cfg.spec_tokens, cfg.block_size, cfg.max_num_seqs, self.mask_words, self.params, self.kv_pages,
            draft=draft, medusa_heads=medusa_heads, beside=beside, kv_dtype=kv_dtype, num_blocks=cfg.num_blocks)
        # a speculative engine's steps loop over rounds: multi-step decoding where no row speculates,
        # speculation rounds otherwise
        self.settings = self.spec.step_settings(**plain_settings,
                                                max_iters=max(cfg.spec_rounds, cfg.max_decode_steps, 1))
        self.step = jit_spec_step(self.settings)
        # its next_tokens has the speculative step's rows, so that either program reads the other's
        self.plain_step = jit_step(StepSettings(**plain_settings, max_iters=max(cfg.max_decode_steps, 1),
                                                next_rows=self.settings.out_rows))

    def _init_kv_pages(self, kv_dtype):
        """(sharding or None, the zeroed KV pages: one LayerKV per attention layer, a ConvState or
        DeltaState (kv_cache.with_states) per state layer, with a state slot per sequence and slot 0 unused)."""
        mc, cfg = self.model_cfg, self.cfg

        def make_pages():
            pages = init_kv_pages(mc.n_attn_layers, mc.n_kv_heads, mc.head_dim, cfg.num_blocks, cfg.block_size,
                                  kv_dtype, mc.kv_value_dim)
            if not mc.has_state:
                return pages
            return with_states(pages, mc, cfg.max_num_seqs + 1, self._state_dtype)
        if self.mesh is None:
            # committed to the device like every step's output, so warm-up compiles the same executable
            # that serving uses (an uncommitted first input keys a different jit cache entry)
            return None, jax.device_put(make_pages(), jax.devices()[0])
        # allocated in place on every device: the global pool never sits on one device
        sharding = kv_sharding(self.mesh, mc.n_kv_heads)
        return sharding, jax.jit(make_pages, out_shardings=sharding)()

    # -------------------------------------------------------------------- weights and pages (weight_update.py)
    @property
    def target_params(self):
        """The served model's params (a speculative engine's target, without the draft or heads)."""
        return self.params.target if isinstance(self.params, (TargetDraft, TargetHeads)) else self.params

    @property
    def state_bytes_per_sequence(self) -> int:
        """One sequence's state slot in the dtype it is kept in (0 without state layers):
        perf.ModelCost's state traffic."""
        return 0 if self._state_dtype is None else self.model_cfg.state_bytes_per_slot(self._state_dtype.itemsize)

    def release_pages(self) -> None:
        """Free the KV pages (the draft's too); restore_pages allocates them again, zeroed."""
        from jaxinfer.weight_update import BlankPages, free
        if self.kv_pages is None:
            return
        jax.block_until_ready(self.kv_pages)    # no step still reads them
        if self._blank_pages is None:
            self._blank_pages = BlankPages(self.kv_pages)
        free(self.kv_pages)
        self.kv_pages = None

    def restore_pages(self) -> None:
        if self.kv_pages is None:
            self.kv_pages = self._blank_pages.make()

    # -------------------------------------------------------------------- buckets
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
        return max(1, max((-(-(seq.start + seq.num_tokens + seq.lookahead) // bs) for seq in seqs), default=1))

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
        constrained (a grammar, allowed_token_ids, one-token bad_words) or biased; otherwise arrays
        built once per bucket (no per-step transfer). A grammar row's mask is filled by fill_masks
        (its static mask, if any, ANDed in there: Grammars.fill)."""
        guided = [(req.guide, i) for i, req in enumerate(rows) if req is not None and req.guide is not None]
        static = [(i, req.static_mask) for i, req in enumerate(rows)
                  if req is not None and req.static_mask is not None and req.guide is None]
        biased = [(i, req.params.logit_bias) for i, req in enumerate(rows) if req is not None and req.params.logit_bias]
        if s not in self._no_mask:
            self._no_mask[s] = jax.device_put((np.full((s, self.mask_words), -1, np.int32),
                                               np.full((s, MAX_LOGIT_BIAS), -1, np.int32),
                                               np.zeros((s, MAX_LOGIT_BIAS), np.float32)))
        if not guided and not biased and not static:
            return self._no_mask[s]
        mask = self._no_mask[s][0]
        if guided or static:
            mask = np.full((s, self.mask_words), -1, np.int32)
            for i, words in static:
                mask[i] = words
        if guided:
            self._unfilled = (guided, mask)   # filled by fill_masks, just before dispatch
        if not biased:
            return (mask, *self._no_mask[s][1:])
        bias_ids = np.full((s, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
        for i, pairs in biased:
            bias_ids[i, :len(pairs)] = [t for t, _ in pairs]
            bias_values[i, :len(pairs)] = [v for _, v in pairs]
        return mask, bias_ids, bias_values

    def _bans(self, s: int, rows: list) -> tuple:
        """(stop_ban [S, M], min_pos [S], bad_words [S, B, L]) of SamplingBatch: each min_tokens row's
        stop ids (EOS, under ignore_eos too as in vLLM, and stop_token_ids) and the position its
        min_tokens-th draw ends at; each row's multi-token bad words. Numpy when some row has either;
        otherwise arrays built once per bucket (no per-step transfer)."""
        banning = [(i, req) for i, req in enumerate(rows) if req is not None
                   and (req.params.min_tokens > 0 or req.bad_word_ids is not None)]
        if s not in self._no_bans:
            self._no_bans[s] = jax.device_put((np.full((s, MAX_MIN_TOKENS_STOP_IDS), -1, np.int32), np.zeros(s, np.int32),
                                               np.full((s, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS), -1, np.int32)))
        if not banning:
            return self._no_bans[s]
        stop_ban = np.full((s, MAX_MIN_TOKENS_STOP_IDS), -1, np.int32)
        min_pos = np.zeros(s, np.int32)
        bad = np.full((s, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS), -1, np.int32)
        for i, req in banning:
            if req.params.min_tokens > 0:
                ids = req.params.min_tokens_stop_ids(self.cfg.eos_ids)
                stop_ban[i, :len(ids)] = ids
                min_pos[i] = len(req.prompt_ids) + req.params.min_tokens
            if req.bad_word_ids is not None:
                bad[i, :len(req.bad_word_ids)] = req.bad_word_ids
        return stop_ban, min_pos, bad

    # -------------------------------------------------------------------- host -> device
    def prepare(self, sched: SchedulerOutput, tables: dict[str, list[int]], buckets: tuple[int, int] | None = None,
                plain: bool | None = None) -> tuple[StepInputs, list]:
        """The step's StepInputs (numpy, padded to the (T, S, B) bucket; `buckets`: this (T, B) instead
        of the smallest that fits, as pipeline micro-batches share one) and its rows: the request
        each row samples for, or None. A speculative engine's step gets SpecStepInputs unless it has
        nothing speculative in it (`plain`, default: SpecRunner.is_plain): plain_step runs those."""
        speculative = self.spec is not None and not (self.spec.is_plain(sched) if plain is None else plain)
        t = self._bucket(max(sched.num_batched_tokens, 1), self.token_buckets)
        b = self._bucket(self.blocks_needed(sched.seqs), self.block_buckets)
        if buckets is not None:
            assert buckets[0] >= t and buckets[1] >= b, (buckets, t, b)
            t, b = buckets
        s = self.num_seqs_for(t)
        assert len(sched.seqs) <= s
        state = self.model_cfg.has_state
        meta = build_attention_metadata([StepRow(seq.start, seq.num_tokens, tables[seq.request.request_id],
                                                 seq.lookahead, self.state_slots[seq.request.request_id] if state else 0)
                                         for seq in sched.seqs], self.cfg.block_size, t, s, b,
                                        with_state=state)   # (T, S, B)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        logits_indices = np.zeros(s, np.int32)
        rows: list = [None] * s
        max_new = np.zeros(s, np.int32)
        from_prev = np.full(t, -1, np.int32)
        num_spec = np.zeros(s, np.int32)
        for i, seq in enumerate(sched.seqs):
            req, first, n = seq.request, meta.query_start_loc[i], seq.num_tokens
            known = req.all_ids[seq.start: seq.start + n - len(seq.spec)]
            if seq.spec:   # proposals follow the row's last token (-1: the draft model fills them in)
                known = known + [max(tok, 0) for tok in seq.spec]
                num_spec[i] = len(seq.spec)
            tokens[first: first + len(known)] = known
            if len(known) < n:   # the last token is still on the device (async scheduling)
                assert len(known) == n - 1 and req.inflight_index >= 0, (req.request_id, len(known), n)
                from_prev[first + n - 1] = req.inflight_index
            positions[first: first + n] = np.arange(seq.start, seq.start + n, dtype=np.int32)
            logits_indices[i] = first + n - 1
            if seq.sample:
                rows[i] = req
                max_new[i] = seq.max_draws
        stop_ids = self._stop_ids(rows)
        if not speculative:
            sb = self._sampling_batch(rows, positions[logits_indices] + 1)
            targets, self._prompt_rows = prompt_targets(sched.seqs, meta.query_start_loc, t)
            if targets is None:   # built once per bucket: no per-step transfer
                if t not in self._no_targets:
                    self._no_targets[t] = jax.device_put(np.full(t, -1, np.int32))
                targets = self._no_targets[t]
            return StepInputs(tokens, positions, meta, logits_indices, sb, stop_ids, max_new,
                              np.int32(sched.num_decode_iters), from_prev, prompt_targets=targets,
                              lora=self._lora_inputs(sched, meta, t),
                              pool_weights=self._pool_weights(sched, meta, t)), rows
        # the drawn token's position is one past the last computed token of its row (a speculating
        # row: one past its last drawn token; verification steps through the proposals)
        self.spec.tree_layout(sched, meta, positions)
        lookup = self.spec.lookup_rows(sched, s)   # n-gram: the device looks up in the rows' histories
        sb = self._sampling_batch(rows, positions[logits_indices - num_spec] + 1,
                                  lookup is not None and bool(lookup.any()))
        spec = self.spec.spec_inputs(sched, tables, num_spec, s, b, meta, lookup)
        return SpecStepInputs(tokens, positions, meta, logits_indices, sb, stop_ids, max_new,
                              np.int32(sched.num_decode_iters), from_prev, spec), rows

    def _lora_inputs(self, sched: SchedulerOutput, meta, t: int):
        """Each token's adapter slot (-1: the base model) and the slots' stacks; None without LoRA."""
        if self.lora is None:
            return None
        token_slots = np.full(t, -1, np.int32)
        for i, seq in enumerate(sched.seqs):
            first = meta.query_start_loc[i]
            token_slots[first: first + seq.num_tokens] = seq.request.lora_slot
        return LoraInputs(token_slots, self.lora.stacks)
    def _pool_weights(self, sched: SchedulerOutput, meta, t: int):
        """[T] float32: each token's weight in its embedding row's pooled sum (host/pooling.py); an
        array built once per bucket when no row embeds (no per-step transfer)."""
        pooling = [(i, seq) for i, seq in enumerate(sched.seqs) if seq.request.pooling is not None]
        if not pooling:
            if t not in self._no_pooling:
                self._no_pooling[t] = jax.device_put(np.zeros(t, np.float32))
            return self._no_pooling[t]
        weights = np.zeros(t, np.float32)
        for i, seq in pooling:
            first = meta.query_start_loc[i]
            weights[first: first + seq.num_tokens] = seq.request.pooling.weights(seq.start, seq.num_tokens)
        return weights

    @staticmethod
    def pooled_rows(sched: SchedulerOutput) -> list:
        """(row, request, its pooling's epoch) of the step's embedding rows whose chunk holds a pooled
        position (a preemption between launch and fetch starts a new epoch: the sum is then dropped)."""
        return [(i, seq.request, seq.request.pooling.epoch) for i, seq in enumerate(sched.seqs) if seq.request.pooling is not None
                and seq.request.pooling.weights(seq.start, seq.num_tokens).any()]

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
        grammar = np.zeros(s, bool)
        for i, req in enumerate(rows):
            if req is None:
                continue
            grammar[i] = req.guide is not None
            p = req.params
            # top_k past the vocabulary means "off" and may exceed int32 (the API takes any integer)
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, min(p.top_k, INT32_MAX), p.top_p, p.min_p
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            seed[i], index[i] = key_seed(req.seed), req.sample_index
            num_logprobs[i] = p.logprobs or 0
        bans = self._bans(s, rows)
        reads = any(req is not None and req.bad_word_ids is not None for req in rows)
        any_penalty = bool(np.any((rep != 1) | (pres != 0) | (freq != 0)))
        hist, is_out = self._history(s, rows, any_penalty or lookup or reads)
        return SamplingBatch(temp, top_k, top_p, min_p, rep, pres, freq, seed, index,
                             positions_of_rows.astype(np.int32), num_logprobs, hist, is_out,
                             *self._constraints(s, rows), *bans, grammar if grammar.any() else self._no_grammar_rows(s),
                             logprobs_mode=self.cfg.logprobs_mode)

    def _no_grammar_rows(self, s: int) -> jax.Array:
        """SamplingBatch.grammar_rows of a step without grammars: built once per bucket (no transfer)."""
        if s not in self._no_grammar:
            self._no_grammar[s] = jax.device_put(np.zeros(s, bool))
        return self._no_grammar[s]

    def execute(self, sched: SchedulerOutput, tables: dict[str, list[int]]) -> dict[str, list[StepSample]]:
        """Run one step and wait for its tokens."""
        return self.fetch(self.launch(sched, tables))

    def fill_masks(self) -> None:
        """The grammar masks of the step just prepared (its inputs hold the arrays): each constrained
        row's next-token mask, and the masks after each proposal of those that speculate."""
        t0 = time.perf_counter()
        if self._unfilled is not None:
            (guided, mask), self._unfilled = self._unfilled, None
            self.grammars.fill(guided, mask)
        if self.spec is not None:
            self.spec.fill_paths(self.grammars)
        self.mask_time_s += time.perf_counter() - t0

    def launch(self, sched: SchedulerOutput, tables: dict[str, list[int]], prev: Launched | None = None,
               before_dispatch: Callable[[], None] | None = None) -> Launched:
        """Dispatch one step without waiting for it. prev: the step still in flight, whose tokens on
        the device feed this step's rows that continue it (async scheduling). before_dispatch: called
        after the inputs are prepared and before the grammar masks are filled and the step dispatched
        (the engine feeds step N's tokens to the matchers there, so preparing N+1 overlaps step N)."""
        self._unfilled = None
        self._prompt_rows = PromptRows()
        if self.spec is not None:
            self.spec.unfilled_paths = None
        inputs, rows = self.prepare(sched, tables)
        prompt_rows = self._prompt_rows
        if before_dispatch is not None:
            before_dispatch()
        self.fill_masks()
        if self.publish_step is not None:
            self.publish_step(inputs)
        prev_tokens = self._no_prev if prev is None else prev.outputs.next_tokens
        outputs = self._dispatch(inputs, prev_tokens)
        for i, (seq, req) in enumerate(zip(sched.seqs, rows)):
            if req is not None:    # where this row's last draw will lie in outputs.next_tokens
                req.inflight_index = (seq.max_draws - 1) * self.settings.max_rows + i
        return Launched(sched, rows, outputs, prompt_rows=prompt_rows, pooled_rows=self.pooled_rows(sched))

    def _dispatch(self, inputs: StepInputs, prev_tokens) -> StepOutputs:
        """Run the step's program on its inputs: a speculative engine's plain StepInputs (prepare's
        plain steps) go to plain_step, every other to the engine's step."""
        if self._is_plain(inputs):
            return self._run_plain(inputs, prev_tokens)
        outputs, self.kv_pages = self.step(self.params, self.kv_pages, inputs, prev_tokens)
        return outputs

    def _is_plain(self, inputs: StepInputs) -> bool:
        """Whether plain_step runs `inputs`: a speculative engine's plain StepInputs."""
        return self.plain_step is not None and not isinstance(inputs, SpecStepInputs)

    def _run_plain(self, inputs: StepInputs, prev_tokens) -> StepOutputs:
        """plain_step over the target's params and pages (the draft's pages are left as they are)."""
        assert not isinstance(inputs, SpecStepInputs) and inputs.meta.tree is None
        params, pages = target_state(self.params, self.kv_pages)
        outputs, pages = self.plain_step(params, pages, inputs, prev_tokens)
        self.kv_pages = with_target_pages(self.params, self.kv_pages, pages)
        return outputs

    def move_kv_blocks(self, transfers) -> TransferResult:
        """Run a step's copies between the pool and the host tier (host_tier.KVTransfers), before the
        step: outside the step's program, so the step's contract does not change."""
        self.kv_pages, result = self.host_kv.run(self.kv_pages, transfers)
        return result

    def fetch(self, launched: Launched) -> dict[str, list[StepSample]]:
        """Wait for a launched step; its tokens per request (read from the device once)."""
        if launched.samples is None:
            launched.samples, launched.spec_counts, launched.proposals = self._results(launched.rows,
                                                                                      launched.outputs)
            if launched.prompt_rows is not None:
                launched.prompt_rows.collect(launched.outputs)
            if launched.pooled_rows:   # embeddings: add each row's weighted sum to its request's
                pooled = jax.device_get(launched.outputs.pooled)
                for i, req, epoch in launched.pooled_rows:
                    if not req.finished and req.pooling.epoch == epoch:
                        req.pooling.add(pooled[i])
        return launched.samples

    @staticmethod
    def _results(rows: list, outputs: StepOutputs) -> tuple[dict[str, list[StepSample]], object, object]:
        """Row i's drawn tokens -> its request's StepSamples (padding rows, None, are skipped), and the
        speculation counts and Medusa proposals (or None). One device-to-host copy: the ids, logprobs,
        counts, speculation counts and proposals (the top-N only when some row asked)."""
        counted = isinstance(outputs, SpecStepOutputs)
        ids, lps, drawn, spec_counts, proposals = jax.device_get(
            (outputs.ids, outputs.logprobs, outputs.num_drawn, outputs.spec_counts if counted else None,
             outputs.proposals if counted else None))
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
        used its cached empty history (or mask, or bias, or pooling weights), this process uses its own."""
        sb = inputs.sampling
        if sb.history is None:
            sb.history, sb.history_is_output = self._history(len(inputs.logits_indices), [], False)
        n = len(inputs.logits_indices)
        empty = (*self._constraints(n, []), *self._bans(n, []), self._no_grammar_rows(n))
        for name, value in zip(("token_mask", "bias_ids", "bias_values", "stop_ban", "min_pos", "bad_words",
                                "grammar_rows"), empty):
            if getattr(sb, name) is None:
                setattr(sb, name, value)
        if not isinstance(inputs, SpecStepInputs):   # speculative programs have neither
            t = len(inputs.tokens)
            if inputs.prompt_targets is None:   # nobody asked
                inputs.prompt_targets = self._no_targets.get(t)
                if inputs.prompt_targets is None:
                    inputs.prompt_targets = self._no_targets[t] = jax.device_put(np.full(t, -1, np.int32))
            if inputs.pool_weights is None:   # process 0's cached no-embedding weights
                inputs.pool_weights = self._pool_weights(SchedulerOutput(), None, t)
        self._dispatch(inputs, self._no_prev)

    def replay(self, inputs: StepInputs) -> None:
        """Profiling only: run the jitted step on `inputs` again and wait for it (the KV writes land
        where they landed the first time, so the cache's contents do not change)."""
        outputs = self._dispatch(inputs, self._no_prev)
        jax.block_until_ready(outputs)

    def compiled_step(self, inputs: StepInputs):
        """Profiling only: the step compiled for `inputs`' shapes (its HLO text, memory analysis)."""
        if self._is_plain(inputs):
            params, pages = target_state(self.params, self.kv_pages)
            return self.plain_step.lower(params, pages, inputs, self._no_prev).compile()
        return self.step.lower(self.params, self.kv_pages, inputs, self._no_prev).compile()

    def step_hlo(self, inputs: StepInputs) -> str:
        """Profiling only: the optimized HLO text of the step compiled for `inputs`' shapes."""
        return self.compiled_step(inputs).as_text()

    def empty_inputs(self, t: int, b: int, plain: bool = False) -> StepInputs:
        """A step of bucket (T, B) with no tokens: what warm-up runs (and the follower's treedef);
        plain: a speculative engine's plain_step layout (StepInputs)."""
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
        if self.host_kv is not None:
            self.kv_pages = self.host_kv.warmup(self.kv_pages)
        return len(buckets)
