"""The engine: step() = schedule -> execute -> update; add_request, abort, stats.

One engine serves all three front doors (Generator, HTTP server, batch script), each through
jaxinfer.client.EngineClient, whose lock serialises access (the engine is not thread-safe by
itself). The engine only orchestrates: the scheduler (host/scheduler.py) plans a step, the runner
(runner.py) runs it on the device, the scheduler applies its tokens; what a client sees of them
(text, stop strings, deltas) is jaxinfer.output_processor's, the live cost accounting is
jaxinfer.step_stats's, the memory the KV pool is sized from is jaxinfer.memory's, and the step
surface below the request API (profiling, multi-host followers) is jaxinfer.debug's.
"""
from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import jax
from flax import nnx

from jaxinfer.config import EngineConfig, ResolvedConfig, SamplingParams, resolve_config
from jaxinfer.config.sampling import MAX_MIN_TOKENS_STOP_IDS
from jaxinfer import perf
from jaxinfer.host.block_manager import BlockManager
from jaxinfer.host.host_tier import HostTier
from jaxinfer.host.pooling import PoolingState
from jaxinfer.host.request import Request
from jaxinfer.host.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxinfer.host.speculative import Proposer, SpecStats
from jaxinfer.host.structured import Grammars, StructuredOutputError
from jaxinfer.host.token_bans import TokenBanError, bad_word_sequences, multi_token_array, static_mask
from jaxinfer.memory import pool_inputs
from jaxinfer.models.decoder import Decoder, set_matmul_impl, weight_bytes
from jaxinfer.output_processor import OutputProcessor, RequestOutput
from jaxinfer.pipeline import PipelinedDecoder, PipelineRunner
from jaxinfer.runner import CompileCounter, Launched, ModelRunner, RunnerConfig
from jaxinfer.sharding import model_mesh
from jaxinfer.spec_decode.checks import check_draft, check_medusa
from jaxinfer.step_stats import StepStats
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weight_update import Residency

# RequestOutput (output_processor) and StepStats (step_stats) stay importable from here
__all__ = ["Engine", "RequestError", "RequestOutput", "StepStats", "StepTrace", "runner_config", "scheduler_config"]


# an embedding request draws one token (its logits row costs one LM-head row) and finishes there
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class RequestError(ValueError):
    """A request the engine refuses: param names the field at fault (code: OpenAI's error code)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineSleepingError(RuntimeError):
    """A request sent while the engine sleeps (its weights or KV pages are off the device)."""


class EngineBusyError(RuntimeError):
    """update_weights or sleep while requests are unfinished (they run between requests)."""


def check_priority(priority: int, policy: str) -> None:
    """vLLM's rule: a priority is an integer (lower runs first); one other than 0 needs the priority
    scheduling policy (fcfs would silently ignore it)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"priority must be an integer, got {priority!r}", "priority")
    if priority != 0 and policy != "priority":
        raise RequestError(f"Got priority {priority} but priority scheduling is not enabled (start the engine "
                           "with --scheduling-policy priority, or scheduling_policy=\"priority\")", "priority")


@dataclass(frozen=True)
class StepTrace:
    """What one Engine.step() call did, for step observers (bench/metrics.StepLog): the step whose
    tokens it applied, as (start, num_tokens) per sequence and how many iterations the device ran
    each (a multi-step decode runs several; empty when it applied none, e.g. the first call under
    async scheduling, or a draft catch-up step, which reads none of the target's bytes), the call's
    wall time, and the applied step's device time per iteration (None when it applied none). These
    are what Engine.stats() counts bytes from, so a benchmark's MBU counts the same bytes."""
    spans: tuple[tuple[int, int], ...]
    wall_s: float
    device_s: float | None
    iterations: tuple[int, ...] = ()


class Engine:
    # Test-only hook: called with no arguments at the very start of every step() (a fault injector
    # raises, a step log records, a slow-down sleeps). None in production.
    fault_injector: Callable[[], None] | None = None

    def __init__(self, model: Decoder, tokenizer: Tokenizer | None, cfg: EngineConfig,
                 draft_model: Decoder | None = None, medusa_heads: tuple | None = None,
                 publish_step: Callable[..., None] | None = None, generates: bool = True):
        """draft_model: the draft of speculative_method="draft" (same vocabulary; its KV pages use
        the target's blocks). medusa_heads: (MedusaHeads, Tree) of speculative_method="medusa"
        (medusa.load_heads checked them against this model). publish_step: multi-host, process 0:
        called with every step's host inputs before the step runs (runner.ModelRunner). generates:
        False for an embedding model without an LM head (only embedding requests are taken)."""
        self.model_cfg = model.cfg
        self.tokenizer = tokenizer
        self.generates = generates
        self.cfg = cfg   # the settings as given; everything the engine runs with reads self.resolved
        check_draft(model, draft_model, cfg)
        medusa_heads = check_medusa(model, medusa_heads, cfg)
        weights = weight_bytes(model)   # before the pool is sized: the weights are in memory already
        # every setting decided once ("auto" dtype: the dtype the weights are in); everything below reads it
        self.resolved = r = _resolve(model, cfg, draft_model)
        self.max_model_len = r.max_model_len
        set_matmul_impl(model, r.matmul)   # before the runner splits the model: the graph holds it
        self.blocks = BlockManager(r.num_blocks, r.block_size, enable_caching=r.enable_prefix_caching,
                                   host_tier=_host_tier(r, model.cfg, draft_model),
                                   state_slots=r.max_num_seqs if model.cfg.has_state else 0)
        eos = tuple(tokenizer.eos_ids) if tokenizer is not None else ()
        eos = eos or self.model_cfg.eos_token_ids
        self.eos_ids = tuple(eos)
        # structured outputs: grammars compiled against this tokenizer, masks filled by the runner
        self.grammars = Grammars(tokenizer, self.model_cfg.vocab_size, eos)
        self.device_spec = perf.device_for_kind(jax.devices()[0].device_kind)   # None: peak unknown (CPU)
        self.scheduler = _build_scheduler(r, self.blocks, eos, draft_model is not None,
                                          None if medusa_heads is None else medusa_heads[1],
                                          _compute_bound_tokens(model, weights, r.dtype, self.device_spec))
        self.spec_stats = SpecStats(r.spec_tokens)
        if isinstance(model, PipelinedDecoder):
            if self.blocks.host is not None:   # (the setting is refused with pipeline_parallel > 1; a
                raise ValueError("kv_offload_gb (the host tier) is not available with pipeline_parallel > 1")  # direct build)
            self.runner = PipelineRunner(model, runner_config(r, eos), r.pipeline_microbatches or model.pp,
                                         grammars=self.grammars)
        else:
            self.runner = ModelRunner(model, runner_config(r, eos, self.blocks.host), draft_model, medusa_heads,
                                      self.grammars, publish_step)
        self.runner.state_slots = self.blocks.state_of   # each request's conv state slot (models with conv layers)
        if self.blocks.host is not None:   # the tier's slots are sized in the bytes the runner moves
            assert self.runner.host_kv.block_bytes == self.blocks.host.block_bytes
        self.weights = weights
        self.cost = perf.ModelCost.build(self.model_cfg, weights, self.runner.kv_bytes_per_token,
                                         self.runner.state_bytes_per_sequence)
        self.output = OutputProcessor(tokenizer)   # text, stop strings and deltas of every sample
        self._ids = itertools.count()
        self.stats_ = StepStats()
        self.warmed_up = False
        # async scheduling needs the device to feed in-flight tokens: not across pipeline stages (one
        # step at a time) nor multi-host (followers run published steps: the Generator turns it off)
        self.async_scheduling = r.async_scheduling
        self._inflight: Launched | None = None
        self._waited = 0.0
        self._last_done = 0.0
        self._step_observers: list[Callable[[StepTrace], None]] = []
        self._device_s: float | None = None   # device time of the step applied by this step()
        self._applied: list[tuple[tuple[int, int], int]] = []   # (span, iterations) applied by this step()
        self.num_constrained_requests = 0
        # multi-LoRA (jaxinfer/lora/): enabled with the first adapter, at start (cfg.lora_modules) or
        # by load_lora while serving; until then steps carry no LoRA input and compile no LoRA work
        self.lora = None
        self._model = model
        self.residency = Residency(self.runner)   # where the weights and pages are (sleep mode)
        for name, path in cfg.lora_modules or ():
            self.load_lora(name, path)

    def warmup(self) -> None:
        """Compile every step shape now; afterwards serving must compile nothing (counted per step)."""
        if self.residency.sleeping:
            raise EngineSleepingError("the engine is sleeping (sleep mode): wake_up() first")
        self.runner.warmup()
        if self.lora is not None:
            self.lora.warmup()
        self.warmed_up = True

    # ---------------------------------------------------------------- LoRA adapters
    def _enable_lora(self) -> None:
        """Device slots for max_loras adapters; a warmed-up engine compiles its LoRA steps now (once)."""
        from jaxinfer.lora.adapter import LoraError
        from jaxinfer.lora.manager import LoraManager
        if isinstance(self._model, PipelinedDecoder):
            raise LoraError("LoRA adapters are not available with pipeline_parallel > 1")
        if self.resolved.spec_tokens:
            raise LoraError("LoRA adapters are not available with speculative decoding (speculative_method)")
        rules = None
        if self.runner.mesh is not None:
            from jaxinfer.sharding import rules_for
            rules = rules_for(self._model.cfg, self.runner.mesh)
        self.lora = LoraManager(self._model, self.cfg.max_loras, self.cfg.max_lora_rank, self.runner.mesh, rules)
        self.scheduler.lora_slots = self.lora.slots
        self.runner.lora = self.lora.device
        if self.warmed_up:
            self.warmup()

    def load_lora(self, name: str, path) -> None:
        """Register the PEFT adapter at path under name. A LoraError (a ValueError naming the file and
        what is wrong) registers nothing."""
        from jaxinfer.lora.adapter import LoraError
        if not isinstance(name, str) or not name:
            raise LoraError("a LoRA adapter needs a non-empty name")
        if self.lora is not None:
            self.lora.load(name, path)
            return
        if self.residency.sleeping:   # the first adapter compiles the LoRA steps: weights and pages needed
            raise LoraError("the engine is sleeping (sleep mode): wake_up() before loading its first LoRA adapter")
        self._enable_lora()
        try:
            self.lora.load(name, path)
        except Exception:
            if not self.lora.names:   # nothing registered: the engine stays as it was
                self.scheduler.lora_slots = self.runner.lora = self.lora = None
            raise

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (KeyError if none has that name); requests already added with it finish."""
        if self.lora is None or name not in self.lora.ids:
            raise KeyError(name)
        self.lora.unload(name, self._lora_in_use())

    def lora_single(self, name: str) -> list:
        """One adapter's stacks alone, slot 0 (KeyError if unknown): what gen.logits(lora=) runs with."""
        if self.lora is None:
            raise KeyError(name)
        return self.lora.device.single(self.lora.adapters[self.lora.lora_id(name)])

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else self.lora.names

    def _lora_stats(self) -> dict:
        """vLLM's lora_requests_info: the adapters of the running and of the waiting requests (names,
        sorted) and the device slots (max_loras); None for all three while no adapter was ever loaded."""
        if self.lora is None:
            return {"running_lora_adapters": None, "waiting_lora_adapters": None, "max_loras": None}

        def names(reqs) -> list[str]:
            return sorted({self.lora.adapters[r.lora_id].name for r in reqs
                           if r.lora_id is not None and r.lora_id in self.lora.adapters})
        return {"running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting), "max_loras": self.cfg.max_loras}

    def _lora_in_use(self) -> set[int]:
        return {r.lora_id for r in self.scheduler.requests.values() if r.lora_id is not None and not r.finished} | {
            c.lora_id for r in self.scheduler.requests.values() for c in r.pending_forks if c.lora_id is not None}

    def _lora_id(self, lora: str | None) -> int | None:
        """A loaded adapter's load id (None: the base model); an unknown name is a RequestError."""
        if lora is None:
            return None
        if self.lora is None or lora not in self.lora.ids:
            raise RequestError(f"the LoRA adapter {lora!r} does not exist (loaded: {self.lora_names()})",
                               "model", "model_not_found")
        return self.lora.lora_id(lora)

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    max_tokens_must_fit: bool = False, lora: str | None = None,
                    pooling: PoolingState | None = None) -> str:
        """Queue a request (n samples); returns its id. Raises ValueError (RequestError, naming the
        field) for prompts that cannot fit. The prompt must leave room for one new token; generation
        stops at the context's end ("length"), as vLLM's LLM does. max_tokens_must_fit: prompt +
        max_tokens must fit the context (what OpenAI's API promises; the server and batch script ask
        for it). cache_salt: requests share cached prefix blocks only with requests of the same salt.
        lora: a loaded adapter's name (None: the base model; an unknown name is a RequestError with
        code "model_not_found").
        pooling: an embedding request (host/pooling.py): prefill only, it finishes at its last prompt
        token (its one draw is discarded) with the pooled vector; a prompt may fill the context."""
        if self.residency.sleeping:
            raise EngineSleepingError("the engine is sleeping (sleep mode): wake_up() first")
        lora_id = self._lora_id(lora)
        prompt_ids = [int(t) for t in prompt_ids]
        check_priority(priority, self.resolved.scheduling_policy)
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if pooling is not None:
            params = self._check_pooling(prompt_ids, pooling)
        elif not self.generates:
            raise RequestError("this model is an embedding model (it has no LM head): it serves embeddings, "
                               "not generation", "model", "model_not_generative")
        total = len(prompt_ids) + params.max_tokens
        if max_tokens_must_fit and pooling is None and total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion), "
                f"{total - self.max_model_len} too many. Please reduce the prompt or max_tokens.",
                "max_tokens" if len(prompt_ids) < self.max_model_len else "prompt", "context_length_exceeded")
        self._check_token_ids(prompt_ids, params)
        if len(prompt_ids) >= self.max_model_len + (pooling is not None):
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len}, "
                               f"so it is {len(prompt_ids) - self.max_model_len + 1} tokens too long", "prompt")
        need = self.blocks.blocks_for(min(len(prompt_ids) + params.max_tokens, self.max_model_len))
        if need > self.blocks.num_blocks - 1:
            raise ValueError(f"the request needs {need} KV blocks but the cache has {self.blocks.num_blocks - 1}")
        if params.prompt_logprobs is not None and (self.resolved.spec_tokens or isinstance(self.runner, PipelineRunner)):
            raise RequestError("prompt_logprobs is not available with speculative decoding or pipeline_parallel > 1 "
                               "(their step programs do not score prompt tokens)", "prompt_logprobs")
        grammar = self.compile_grammar(params)
        mask, bad_words = self._token_bans(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        sample_ids = self._sample_ids(request_id, params.n)
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        now = time.monotonic() if arrival_time is None else arrival_time
        make = lambda i, rid: Request(rid, list(prompt_ids), params, seed, sample_index=i,  # noqa: E731
                                      priority=priority, arrival_time=now, cache_salt=cache_salt, lora_id=lora_id,
                                      pooling=pooling, static_mask=mask, bad_word_ids=bad_words)
        leader = make(0, request_id)
        leader.pending_forks = [make(i, sample_ids[i]) for i in range(1, params.n)]
        if params.prompt_logprobs is not None:   # one prompt, one set of prompt logprobs for all samples
            shared: dict = {}
            for r in [leader, *leader.pending_forks]:
                r.prompt_logprobs = shared
        if grammar is not None:   # each sample walks the grammar on its own
            self.num_constrained_requests += 1
            for r in [leader, *leader.pending_forks]:
                r.guide = self.grammars.guide(grammar)
                r.guide.static = mask
        # the samples share the prompt's full blocks, except the one holding the last prompt token
        # (none with conv layers: a block holds no conv state, so each sample computes its prompt)
        leader.fork_at = 0 if self.model_cfg.has_state else (len(prompt_ids) - 1) // self.blocks.block_size * \
            self.blocks.block_size
        self.output.add_request(request_id, [r.request_id for r in [leader, *leader.pending_forks]], prompt_ids,
                                params.stop, params.skip_special_tokens, params.include_stop_str_in_output,
                                params.min_tokens)
        self.scheduler.add(leader)
        return request_id

    def _token_bans(self, params: SamplingParams) -> tuple:
        """(the request's static token mask, its multi-token bad words): host/token_bans.py; a
        RequestError names min_tokens, allowed_token_ids or bad_words where they cannot be served."""
        if params.min_tokens > 0 and len(params.min_tokens_stop_ids(self.eos_ids)) > MAX_MIN_TOKENS_STOP_IDS:
            raise RequestError(f"min_tokens bans the EOS ids and stop_token_ids on device, at most "
                               f"{MAX_MIN_TOKENS_STOP_IDS} of them; this request has "
                               f"{len(params.min_tokens_stop_ids(self.eos_ids))}", "min_tokens")
        if not params.bad_words and params.allowed_token_ids is None:
            return None, None
        if params.bad_words and self.tokenizer is None:
            raise RequestError("bad_words need the model's tokenizer (this engine has none)", "bad_words")
        v = self.model_cfg.vocab_size
        try:
            seqs = bad_word_sequences(params.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False), v)
            single = [s[0] for s in seqs if len(s) == 1]
            return static_mask(params.allowed_token_ids, single, v, self.runner.mask_words), multi_token_array(seqs)
        except TokenBanError as e:
            raise RequestError(str(e), e.field) from None

    def _check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every token id a request names (its prompt, stop_token_ids, logit_bias, allowed_token_ids)
        is in the vocabulary, or a RequestError names the field."""
        v = self.model_cfg.vocab_size
        for field, what, ids in (("prompt", "prompt token ids", prompt_ids),
                                 ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                 ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or ()),
                                 ("logit_bias", "logit_bias token ids", [t for t, _ in params.logit_bias or ()])):
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise RequestError(f"{what} {bad[:5]} are outside the vocabulary [0, {v})", field)

    def _sample_ids(self, request_id: str, n: int) -> list[str]:
        """The ids of a new request's n samples ("id", "id#1", ...), none of them a live sample's: a
        sample of another request may hold "id#1", or a waiting request's sample not yet forked
        the id given now."""
        sample_ids = [request_id] + [f"{request_id}#{i}" for i in range(1, n)]
        taken = next((r for r in sample_ids if r in self.scheduler.requests or self.output.is_live(r)), None)
        if taken is not None:
            raise ValueError(f"request id {request_id!r} is already in use"
                             + ("" if taken == request_id else f" (by a sample of another request: {taken!r})"))
        return sample_ids

    def _check_pooling(self, prompt_ids: list[int], pooling: PoolingState) -> SamplingParams:
        """An embedding request's SamplingParams (one greedy draw, discarded), once the engine is one
        whose step pools (the plain step: not a speculative or pipelined engine's)."""
        if self.resolved.speculative_method is not None or isinstance(self.runner, PipelineRunner):
            raise RequestError("embeddings are not available with speculative decoding or pipeline_parallel > 1",
                               "input")
        if len(prompt_ids) > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the input has "
                f"{len(prompt_ids)} tokens, {len(prompt_ids) - self.max_model_len} too many.", "input",
                "context_length_exceeded")
        assert pooling.num_tokens == len(prompt_ids), (pooling.num_tokens, len(prompt_ids))
        return EMBEDDING_PARAMS

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every sample of a request; returns their final (empty) deltas."""
        outs = []
        # samples before their leader: finishing the leader also ends its not-yet-forked samples
        for rid in reversed(self.output.pop_samples(request_id)):
            req = self.scheduler.requests.get(rid)
            if req is not None and not req.finished:
                self.scheduler.abort(rid)
                outs.append(self.output.delta(req, 0))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (e.g. after swapping weights); returns how many."""
        return self.blocks.reset_cache()

    # ---------------------------------------------------------------- new weights, sleep (weight_update.py)
    def _check_idle(self, what: str) -> None:
        """EngineBusyError unless no request is unfinished. A step dispatched ahead (async scheduling)
        after the one whose tokens finished the last request is still in flight, with nothing left to
        schedule: it is collected here (it draws nothing anyone waits for)."""
        if self.step_in_flight and not self.scheduler.has_unfinished():
            self.step()
        n = self.scheduler.num_unfinished()
        if n or self.step_in_flight:
            raise EngineBusyError(f"{what} runs between requests: {n} sequences are unfinished (wait for them to "
                                  "finish, or abort them)")

    def _weights_changed(self) -> None:
        """The model object (LoRA slots read it) holds the arrays the runner serves."""
        if self.residency.weights_on_device:
            nnx.update(self._model, self.runner.target_params)

    def update_weights(self, params, what: str) -> None:
        """Serve `params` (the served model's params in its own layout: same paths, shapes and dtypes,
        else a CheckpointError and nothing changes) from now on, without compiling anything. The
        prefix cache and its host tier are emptied: their K/V came from the old weights."""
        self._check_idle("update_weights")
        self.residency.update(params, what)
        self._weights_changed()
        self.blocks.reset_cache()

    def sleep(self, level: int) -> None:
        """vLLM's sleep: free the KV pages and the weights on the device (level 1: the weights kept
        in host memory; 2: discarded). Requests are refused until wake_up."""
        self._check_idle("sleep")
        self.residency.sleep(level)
        self.blocks.reset_cache()

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Put back the weights ("weights") and / or the KV pages, zeroed ("kv_cache");
        weight_update.WeightsAsleep if the weights were discarded (sleep level 2)."""
        self.residency.wake_up(tags)
        self._weights_changed()

    @property
    def sleeping(self) -> bool:
        return self.residency.sleeping

    def samples(self, request_id: str) -> list[Request]:
        """A just-added request's n samples in sample order, forked already or not (a prompt within
        its first block forks when it is added: only the leader was listed, so its other samples
        went unmeasured)."""
        leader = self.scheduler.requests[request_id]
        pending = {r.request_id: r for r in leader.pending_forks}
        return [pending.get(s) or self.scheduler.requests[s] for s in self.output.sample_ids(request_id)]

    def num_queued_sequences(self) -> int:
        """Sequences admitted but not running yet (a request with n samples counts n)."""
        return self.scheduler.num_unfinished() - len(self.scheduler.running)

    @property
    def step_in_flight(self) -> bool:
        """A step is dispatched and its tokens not yet applied (async scheduling, between steps)."""
        return self._inflight is not None

    def add_step_observer(self, callback: Callable[[StepTrace], None]) -> None:
        """callback(StepTrace) after every step() that scheduled sequences (benchmarks' step log)."""
        self._step_observers.append(callback)

    def remove_step_observer(self, callback: Callable[[StepTrace], None]) -> None:
        self._step_observers.remove(callback)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One engine step; returns one delta per new token (and a final empty one for requests that
        finish without a token). Synchronous: schedule, run, update. Async scheduling: schedule and
        dispatch step N+1 (its decode rows read step N's tokens on the device), then wait for step N
        and apply it while the device runs N+1, so the deltas returned are step N's."""
        if self.fault_injector is not None:
            self.fault_injector()
        t0 = time.perf_counter()
        self._device_s = None
        prev, self._inflight = self._inflight, None
        deltas = []
        if prev is not None and self._needs_tokens_first(prev):
            deltas += self._complete(prev)
            prev = None
        sched = self.scheduler.schedule()
        if self.blocks.host is not None:
            self._move_host_blocks(sched)
        feed = None
        if prev is not None and any(seq.sample and seq.request.guide is not None for seq in prev.scheduled.seqs):
            # a grammar's next mask follows from the token just drawn: prepare step N+1 while the
            # device runs N, then wait for N's tokens and feed them to the matchers only, fill N+1's
            # masks and dispatch it, then apply step N on the host (text, stop strings, deltas)
            # while the device runs N+1
            feed = functools.partial(self._feed_guides, prev)
        launched = self._launch(sched, prev, feed) if sched.seqs else None
        if launched is not None and not self.async_scheduling:
            deltas += self._complete(launched)
            launched = None
        if prev is not None:
            deltas += self._complete(prev)
        self._inflight = launched
        if self.lora is not None and self.lora.has_retired:   # unloaded adapters whose last request ended
            self.lora.collect(self._lora_in_use())
        t1 = time.perf_counter()
        self.stats_.host_times.append(t1 - t0 - self._waited)
        self._waited = 0.0
        applied, self._applied = self._applied, []
        if self._step_observers and (sched.seqs or applied):
            trace = StepTrace(tuple(span for span, _ in applied), t1 - t0, self._device_s,
                              tuple(its for _, its in applied))
            for observe in self._step_observers:
                observe(trace)
        return deltas

    def _move_host_blocks(self, sched: SchedulerOutput) -> None:
        """The host tier's copies the plan needs, before its step: blocks evicted to the tier, blocks
        restored from it. A failed copy drops its entries; a failed restore's requests recompute."""
        transfers = self.blocks.take_transfers()
        if not transfers:
            return
        c0 = CompileCounter.count
        result = self.runner.move_kv_blocks(transfers)
        if self.warmed_up:
            self.stats_.compilations_after_warmup += CompileCounter.count - c0
        self.blocks.host.drop(result.failed_slots)
        if result.failed_blocks:
            logging.getLogger("jaxinfer").warning("host tier: %d block restores failed; recomputing them",
                                                  len(result.failed_blocks))
            self.blocks.restore_failed(result.failed_blocks)
            self.scheduler.recompute(sched, result.failed_blocks)

    def _needs_tokens_first(self, prev: Launched) -> bool:
        """Whether the in-flight step's tokens must reach the host before the next step is planned.
        Penalties and multi-token bad words read the host's history, and proposals follow the last
        token: both need step N's
        tokens on the host before step N+1 is planned (not a row that cannot be proposed for, e.g.
        under a grammar with the draft model); so does a row that speculated in step N whatever the
        policy says now (a request arriving meanwhile turns it off): how many tokens it drew, so
        where its last one lies, is known only then."""
        return any(seq.spec or (seq.sample and (seq.request.params.uses_history
                                                or seq.request.bad_word_ids is not None
                                                or self.scheduler.may_propose(seq.request)))
                   for seq in prev.scheduled.seqs)

    def _launch(self, sched: SchedulerOutput, prev: Launched | None, before_dispatch=None) -> Launched:
        c0 = CompileCounter.count
        if self.lora is not None:   # adapters placed in slots by this schedule() reach the device first
            self.lora.apply_pending()
        launched = self.runner.launch(sched, self.blocks.tables, prev, before_dispatch)
        launched.t_launch = time.perf_counter()
        if self.warmed_up:
            self.stats_.compilations_after_warmup += CompileCounter.count - c0
        self.scheduler.launched(sched)
        self.stats_.num_steps += 1
        # prompt positions whose target K/V the step computes (a draft catch-up's are cached already)
        self.stats_.prompt_tokens += sum(
            max(0, min(seq.start + seq.num_tokens, len(seq.request.prompt_ids)) - seq.start - seq.draft_only)
            for seq in sched.seqs)
        return launched

    def _fetch(self, launched: Launched) -> dict:
        if launched.samples is None:
            t_wait = time.perf_counter()
            self.runner.fetch(launched)
            launched.t_fetched = time.perf_counter()
            self._waited += launched.t_fetched - t_wait
        return launched.samples

    def _feed_guides(self, launched: Launched) -> None:
        """Advance the constrained rows' matchers past a step's tokens before the host applies
        them (Guide.at answers again when the update reaches those tokens)."""
        samples = self._fetch(launched)
        for seq in launched.scheduled.seqs:
            req = seq.request
            if seq.sample and req.guide is not None and not req.finished:
                for j, s in enumerate(samples.get(req.request_id, ())):
                    if req.guide.at(len(req.output_ids) + j, s.token):
                        break

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them: stop conditions, text, deltas."""
        sched = launched.scheduled
        samples = self._fetch(launched)
        done = launched.t_fetched
        # the device's time for this step: from its dispatch, or from the end of the step before it
        dt = max(done - max(launched.t_launch, self._last_done), 1e-9)
        self._last_done = done
        # bytes read (perf.ModelCost): per iteration the weights and each sequence's KV context, which
        # grows by one token per iteration of a multi-step decode
        counts = launched.spec_counts
        its = [int(counts[i, 0]) or 1 if seq.spec else max(1, len(samples.get(seq.request.request_id, ())))
               for i, seq in enumerate(sched.seqs)]
        for i, seq in enumerate(sched.seqs):
            if seq.spec and seq.request.request_id in samples:
                self.spec_stats.add(counts[i])
        iters = max(its)
        self._device_s = dt / iters
        if sched.run_target:   # (a draft catch-up step reads none of the target's weights or K/V)
            spans = [(seq.start, seq.num_tokens) for seq in sched.seqs]
            self.stats_.count_step(self.cost, perf.StepRecord(dt, spans, iterations=its), iters)
            self._applied += zip(spans, its)
        before = {seq.request.request_id: len(seq.request.output_ids) for seq in sched.seqs}
        self.output.begin_step(seq.request.request_id for seq in sched.seqs)
        updated = self.scheduler.update(sched, samples, stop_check=self._stop_check)
        if launched.proposals is not None:   # Medusa: each row's next tree (-1: none this step)
            for i, seq in enumerate(sched.seqs):
                req = seq.request
                if seq.sample and not req.finished and launched.proposals[i, 0] >= 0:
                    req.proposals = (len(req.all_ids), launched.proposals[i].tolist())
        deltas = []
        for req in updated:
            new = len(req.output_ids) - before[req.request_id]
            self.stats_.generation_tokens += new
            deltas += self.output.deltas(req, new)
        return deltas

    def compile_grammar(self, params: SamplingParams):
        """The request's grammar (None without structured outputs), built now or found in the cache;
        RequestError naming structured_outputs if it is refused. Thread-safe (Grammars locks)."""
        if params.structured_outputs is None:
            return None
        try:
            return self.grammars.compile(params.structured_outputs)
        except StructuredOutputError as e:
            raise RequestError(str(e), "structured_outputs") from None

    def _stop_check(self, req: Request) -> bool:
        """Whether the request's newest token completes one of its stop strings (the output processor
        detokenizes it and cuts the text where the stop string begins) or its grammar (nothing more
        may follow)."""
        grammar_done = req.guide is not None and req.guide.at(len(req.output_ids) - 1, req.output_ids[-1])
        return self.output.stop_check(req) or grammar_done

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Counters and gauges (served on /metrics). MBU: the median achieved bandwidth of recent steps
        (perf.ModelCost bytes over device time) over the datasheet's peak (None when unknown)."""
        s = self.stats_
        return {
            "compilations_after_warmup": s.compilations_after_warmup if self.warmed_up else None,
            "kv_blocks_total": self.blocks.num_blocks - 1,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_free": self.blocks.num_free,
            # vLLM's kv_cache_usage_perc: the share of the pool not free (cached-and-evictable is free)
            "kv_cache_usage": self.blocks.num_used / max(1, self.blocks.num_blocks - 1),
            **self._lora_stats(),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": s.num_steps,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "prefix_caching": self.blocks.enable_caching,
            "structured_output_requests": self.num_constrained_requests,
            "grammar_mask_time_s": self.runner.mask_time_s,
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "prefix_cache_hit_rate": (self.scheduler.prefix_hits / self.scheduler.prefix_queries
                                      if self.scheduler.prefix_queries else None),
            "prefix_cache_blocks": self.blocks.num_cached,
            "prefix_cache_evictions": self.blocks.num_evictions,
            "median_step_time_s": s.median_step_time_s(),
            "median_host_time_per_step_s": s.median_host_time_s(),
            "async_scheduling": self.async_scheduling,
            "achieved_bandwidth_bytes_per_s": s.achieved_bandwidth(),
            "mbu": s.mbu(self.device_spec),
            "bytes_read": s.bytes_read,
            "device_time_s": s.device_time_s,
            "weight_bytes": self.weights.total,
            "embedding_table_bytes": self.weights.tables,
            "embedding_row_bytes": self.weights.row,
            "expert_weight_bytes": self.weights.experts,
            "kv_bytes_per_token": self.cost.kv_bytes_per_token,
            "state_bytes_per_sequence": self.cost.state_bytes_per_sequence,
            "max_model_len": self.max_model_len,
            "block_size": self.resolved.block_size,
            "speculative_method": self.resolved.speculative_method,
            "num_speculative_tokens": self.resolved.spec_tokens,
            **self.spec_stats.as_dict(),
            # speculative_method="draft": positions the draft recomputed to catch up with the target
            # after steps that skipped it (the load policy had speculation off)
            "spec_decode_draft_catchup_tokens": self.scheduler.num_draft_catchup_tokens,
            **self._host_tier_stats(),
        }

    def _host_tier_stats(self) -> dict:
        """The prefix cache's host tier: hits and misses in blocks (of admitted requests' prompts, past
        the device's cached prefix), what it holds, bytes moved each way, restore time (zeros: none)."""
        host, store = self.blocks.host, getattr(self.runner, "host_kv", None)
        return {
            "kv_host_budget_bytes": self.resolved.kv_offload_bytes,
            "kv_host_hits": host.hits if host else 0,
            "kv_host_misses": host.misses if host else 0,
            "kv_host_blocks": host.num_held if host else 0,
            "kv_host_bytes": host.bytes_held if host else 0,
            "kv_host_blocks_dropped": host.blocks_dropped if host else 0,
            "kv_host_bytes_offloaded": store.bytes_offloaded if store else 0,
            "kv_host_bytes_restored": store.bytes_restored if store else 0,
            "kv_host_restore_time_s": store.restore_time_s if store else 0.0,
            "kv_host_offload_time_s": store.offload_time_s if store else 0.0,
        }


# ------------------------------------------------------------------------------ building the engine
def _resolve(model, cfg: EngineConfig, draft_model: Decoder | None) -> ResolvedConfig:
    """resolve_config for this model on this backend: the weights' dtype is what dtype="auto" means,
    and with num_blocks=None the device's memory is gathered first (pool_inputs) so that config
    sizes the pool from it. Logs how the pool was sized."""
    embed_dtype = model.embed.get_value().dtype if hasattr(model, "embed") else None
    memory = pool_inputs(model, draft_model, embed_dtype) if cfg.num_blocks is None else None
    r = resolve_config(cfg, model.cfg, backend=jax.default_backend(),
                       weight_dtype=None if embed_dtype is None else str(embed_dtype), memory=memory,
                       pipelined=isinstance(model, PipelinedDecoder))
    if r.pool is not None:
        log = logging.getLogger("jaxinfer")
        log.info("KV pool: %s", r.pool.describe())
        if r.pool.allocator_bound:
            log.warning(
                "JAX's allocator may use %.2f GiB of this device's %.2f GiB, less than memory_fraction %g of it: "
                "set XLA_CLIENT_MEM_FRACTION=%g before jax starts (the jaxinfer commands do) for a larger KV pool",
                r.pool.allocator_limit / 2**30, r.pool.device_bytes / 2**30, r.memory_fraction, r.memory_fraction)
    return r


def scheduler_config(r: ResolvedConfig, lazy_draft: bool = False, medusa_tree=None,
                     compute_bound_tokens: float = 0.0) -> SchedulerConfig:
    """The scheduler's settings from the resolved ones. lazy_draft: a draft model whose pages may
    lag; medusa_tree: the Medusa tree (cut to num_speculative_tokens), whose nodes a row proposes;
    compute_bound_tokens: the padding-aware chunking's ridge (_compute_bound_tokens; 0: no cut)."""
    return SchedulerConfig(policy=r.batching, max_num_seqs=r.max_num_seqs,
                           max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len,
                           batch_window_s=r.batch_window_s, scheduling_policy=r.scheduling_policy,
                           # multi-step decoding runs the model in a device loop; pipeline stages do not loop
                           max_decode_steps=r.max_decode_steps,
                           spec_tokens=len(medusa_tree.paths) if medusa_tree is not None else r.spec_tokens,
                           spec_max_batch=r.spec_max_batch, spec_rounds=r.spec_rounds,
                           lazy_draft=lazy_draft, step_proposes=medusa_tree is not None,
                           token_buckets=r.token_buckets, compute_bound_tokens=compute_bound_tokens)


def _compute_bound_tokens(model, weights: perf.WeightBytes, dtype: str, device: perf.Device | None) -> float:
    """Tokens per step at which a step turns compute-bound here (perf.compute_bound_tokens: the
    datasheet's peaks, the host-CPU assumptions on CPU), for the scheduler's padding-aware chunking
    (Scheduler._fit_bucket). 0, no cut: an accelerator of unknown peak, and pipeline stages, which pad
    each group of micro-batches to its own bucket."""
    if device is None and jax.default_backend() == "cpu":
        device = perf.host_cpu_device()
    if device is None or isinstance(model, PipelinedDecoder):
        return 0.0
    return perf.compute_bound_tokens(device, dtype, weights.total / model.cfg.num_params(), model.cfg)


def _host_tier(r: ResolvedConfig, model_cfg, draft_model: Decoder | None) -> HostTier | None:
    """The prefix cache's host tier of kv_offload_bytes (None: 0); a budget under one block (every
    layer's K/V of block_size tokens, the draft's and int8/fp8 scales included) is refused here."""
    if not r.kv_offload_bytes:
        return None
    if jax.process_count() > 1:
        raise ValueError("kv_offload_gb (the host tier) is not available across several processes (multi-host)")
    block_bytes = r.block_size * sum(perf.kv_bytes_per_token(c.n_attn_layers, c.n_kv_heads, c.head_dim, r.kv_dtype,
                                                             c.kv_value_dim)
                                     for c in [model_cfg] + ([draft_model.cfg] if draft_model is not None else []))
    return HostTier(r.kv_offload_bytes, block_bytes)


def runner_config(r: ResolvedConfig, eos_ids: tuple[int, ...], host: HostTier | None = None) -> RunnerConfig:
    """The runner's settings from the resolved ones (eos_ids: what ends a row on the device; host:
    the prefix cache's host tier, whose slots the runner holds the bytes of)."""
    return RunnerConfig(block_size=r.block_size, num_blocks=r.num_blocks, max_num_seqs=r.max_num_seqs,
                        max_num_batched_tokens=r.max_num_batched_tokens, max_model_len=r.max_model_len,
                        token_buckets=r.token_buckets, kv_dtype=r.kv_dtype, attention=r.attention,
                        max_decode_steps=r.max_decode_steps, eos_ids=tuple(eos_ids), spec_tokens=r.spec_tokens,
                        spec_rounds=r.spec_rounds, kv_offload_slots=host.num_slots if host is not None else 0,
                        logprobs_mode=r.logprobs_mode)


def _build_scheduler(r: ResolvedConfig, blocks: BlockManager, eos_ids: tuple[int, ...], lazy_draft: bool,
                     medusa_tree, compute_bound_tokens: float) -> Scheduler:
    """The scheduler with its proposer when the engine speculates (the draft model's or n-gram's
    placeholders, or Medusa's trees)."""
    proposer = None
    if r.spec_tokens:
        depths = tuple(len(p) for p in medusa_tree.paths) if medusa_tree is not None else ()
        proposer = Proposer(r.speculative_method, tree_depths=depths, on_device=True)
    return Scheduler(scheduler_config(r, lazy_draft, medusa_tree, compute_bound_tokens), blocks, eos_ids=eos_ids, propose=proposer,
                     spec_draws=None if proposer is None else proposer.draws)
