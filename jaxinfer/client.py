"""EngineClient: the one driver of an Engine (DESIGN.md, "The shape of the engine").

Every front door (Generator.generate / stream, the server's async bridge, the batch script, the
benchmarks) talks to the engine through this class and nothing else:

    client = EngineClient(engine)
    rids = client.submit([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8), route=deltas.append)
    while client.has_unfinished():
        client.step()                 # one engine step under the lock; deltas go to their routes
    client.release(rid)               # forget the request (aborting it first if it still runs)

It owns the lock that serialises access to the engine, submits several prompts all-or-nothing
(a ValueError for one prompt rolls back the ones already added), routes each delta to the
callback its request was submitted with, aggregates finished outputs (Completion), and exposes
what adapters need (queued sequences, per-request metrics, stats, step observers, the resolved
configuration) as public methods, so no adapter reads the engine's internals (its scheduler,
runner, block manager, step functions or counters) or the lock. The step below the request API
(the profiler's and benchmarks' hooks, the multi-host follower's step) is `client.debug`, a
jaxinfer.debug.StepDebugger under the same lock. The client itself goes no further than the
engine's public methods. Its public output types: RequestOutput (one step's delta of one sample)
and Completion.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from jaxinfer.config import ResolvedConfig, SamplingParams
from jaxinfer.debug import StepDebugger
from jaxinfer.engine import Engine, StepTrace
from jaxinfer.host.beam_search import BeamSearch, BeamSearchParams
from jaxinfer.output_processor import RequestOutput
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxinfer.host.request import LatencyMetrics

__all__ = ["Completion", "EngineClient", "EngineFailedError", "RequestMetrics", "RequestOutput", "Route",
           "SubmitError"]

Route = Callable[[RequestOutput], None]


class EngineFailedError(RuntimeError):
    """An engine step raised: its state (the step in flight, the KV pages donated to it) is gone,
    so every request waiting on it, and every later one, gets this error; build a new engine."""

    def __init__(self, cause: BaseException):
        super().__init__(f"the engine stopped: a step raised {type(cause).__name__}: {cause}; build a new "
                         "Generator (or restart the server)")
        self.cause = cause


class SubmitError(ValueError):
    """A prompt of a submission was refused (nothing of the submission stays queued)."""

    def __init__(self, index: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.index, self.message, self.param, self.code = index, message, param, code


@dataclass
class Completion:
    """One sample's finished output, aggregated from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0      # prompt tokens its request found in the prefix cache
    # SamplingParams.prompt_logprobs: None, then (logprob, rank, top-N) per prompt token after the first
    prompt_logprobs: list | None = None
    embedding: object = None        # an embedding request's pooled vector (np.float32 [D])
    stop_reason: str | int | None = None   # the stop string or stop token id that ended it (vLLM's)

    def add(self, d: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.embedding = d.embedding


@dataclass(frozen=True)
class RequestMetrics(LatencyMetrics):
    """One sample's timestamps (time.monotonic, seconds) and token counts: the field's per-request
    metrics (TTFT = first token - arrival, TPOT = (last - first) / (n - 1), ITL = token gaps)."""
    request_id: str
    sample_index: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    finished: bool


class EngineClient:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.RLock()   # re-entrant: a submit's check() may read queued_sequences()
        self._routes: dict[str, Route | None] = {}
        self._samples: dict[str, list] = {}     # request id -> its n host Requests (metrics)
        self.error: BaseException | None = None   # what a step raised: the engine is dead from then on
        # aborts not yet applied: the next holder of the lock applies them (abort's own turn, or the next
        # step's first). A thread that steps back to back re-takes the lock before a waiting abort() is
        # scheduled on a loaded machine (the lock is not fair), so the stepper applies them too: an abort
        # ends its request at the next step, never after the request has run to its end.
        self._aborts: deque[str] = deque()
        # the step below the request API (profiling, benchmarks' memory accounting, multi-host
        # followers), under this client's lock: the one copy of that surface
        self.debug = StepDebugger(engine, self._lock)

    # ---------------------------------------------------------------- what adapters read
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a request (unless it ignores EOS): the tokenizer's, else the model's."""
        return self.engine.eos_ids

    @property
    def resolved(self) -> ResolvedConfig:
        """The settings the engine runs with, every "auto" and None decided (config.resolve_config)."""
        return self.engine.resolved

    def warmup(self) -> None:
        """Compile every step shape now; afterwards serving compiles nothing."""
        with self._lock:
            self.engine.warmup()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    def queued_sequences(self) -> int:
        """Sequences admitted but not yet running (a request with n samples counts n)."""
        with self._lock:
            return self.engine.num_queued_sequences()

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def metrics(self, request_id: str) -> list[RequestMetrics]:
        """Per-sample metrics of a submitted (not yet released) request, in sample order."""
        with self._lock:
            return [_snapshot(request_id, r) for r in self._samples[request_id]]

    def add_step_observer(self, callback: Callable[[StepTrace], None]) -> None:
        with self._lock:
            self.engine.add_step_observer(callback)

    def remove_step_observer(self, callback: Callable[[StepTrace], None]) -> None:
        with self._lock:
            self.engine.remove_step_observer(callback)

    # ---------------------------------------------------------------- LoRA adapters
    def load_lora(self, name: str, path) -> None:
        """Register a PEFT adapter (jaxinfer.lora.adapter.LoraError: nothing registered)."""
        with self._lock:
            self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown); its running requests finish."""
        with self._lock:
            self.engine.unload_lora(name)

    def lora_names(self) -> list[str]:
        with self._lock:
            return self.engine.lora_names()

    def lora_single(self, name: str) -> list:
        """One adapter's weights as single-slot stacks (gen.logits); KeyError if unknown."""
        with self._lock:
            return self.engine.lora_single(name)

    # ---------------------------------------------------------------- new weights, sleep mode
    def update_weights(self, params, what: str) -> None:
        with self._lock:
            self.engine.update_weights(params, what)

    def sleep(self, level: int) -> None:
        with self._lock:
            self.engine.sleep(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        with self._lock:
            self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        with self._lock:
            return self.engine.sleeping

    def weights_on_device(self) -> bool:
        with self._lock:
            return self.engine.residency.weights_on_device

    def served_params(self):
        """The served model's params as the engine holds them (what a full forward takes)."""
        with self._lock:
            return self.engine.runner.target_params

    def locked(self, fn: Callable[[], object]) -> object:
        """Run fn() while holding the engine lock (multi-host: publish and run in one order)."""
        with self._lock:
            return fn()

    # ---------------------------------------------------------------- submitting
    def compile_grammar(self, params: SamplingParams) -> None:
        """Build a request's grammar ahead of submit, outside the lock (the engine caches it for the
        request's add_request): a server calls this on a worker thread, so that a large grammar
        (seconds of llguidance work) stalls neither its event loop nor the steps. RequestError
        (param structured_outputs) when the grammar is refused."""
        self.engine.compile_grammar(params)

    def submit(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
               route: Route | None = None, arrival_time: float | None = None,
               check: Callable[[], None] | None = None, cache_salt: str | None = None,
               max_tokens_must_fit: bool = False, priority: int | Sequence[int] = 0,
               lora: str | None | Sequence[str | None] = None, poolings: Sequence | None = None) -> list[str]:
        """Queue one engine request per prompt, all or nothing: a ValueError for any prompt aborts
        the ones already added and is raised as a SubmitError naming the prompt's index. Each delta
        of these requests is passed to `route` by the thread that steps, under the lock (keep it
        short). check() runs under the lock first: an adapter's admission control, it raises to
        refuse. cache_salt: these requests share cached prefix blocks only under the same salt.
        priority: lower runs first under scheduling_policy="priority" (one for all prompts, or one
        per prompt; vLLM's). lora: the loaded adapter these requests run with (None: the base model),
        or one per prompt.
        poolings: embedding requests, one host/pooling.PoolingState per prompt (params are then unused:
        each runs its prompt only; its final delta holds the embedding)."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"got {len(prios)} priorities for {len(prompts)} prompts")
        llist = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(llist) != len(prompts):
            raise ValueError(f"got {len(llist)} LoRA names for {len(prompts)} prompts")
        rids: list[str] = []
        with self._lock:
            if check is not None:     # (an adapter's own dead-engine answer first: the server's 503)
                check()
            self._check_alive()
            try:
                for i, (ids, p, prio, name) in enumerate(zip(prompts, plist, prios, llist)):
                    rid = self.engine.add_request(ids, p, arrival_time=arrival_time, cache_salt=cache_salt,
                                                  max_tokens_must_fit=max_tokens_must_fit, priority=prio,
                                                  lora=name, pooling=None if poolings is None else poolings[i])
                    rids.append(rid)
                    self._routes[rid] = route
                    self._samples[rid] = self.engine.samples(rid)
            except ValueError as e:
                for rid in rids:
                    self._release_locked(rid, abort=True)
                raise SubmitError(len(rids), str(e), getattr(e, "param", None), getattr(e, "code", None)) from None
        return rids

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """One engine step under the lock (nothing when no request is unfinished); each delta is
        handed to its request's route before the lock is released, so a request's deltas arrive in
        step order even when several threads step. Returns every delta of the step."""
        with self._lock:
            self._check_alive()
            self._apply_aborts()
            if not self.engine.has_unfinished():
                return []
            try:
                deltas = self.engine.step()
            except BaseException as e:      # the thread that stepped gets e itself, every other caller
                self.error = e              # EngineFailedError (KeyboardInterrupt included: the step's
                raise                       # in-flight state is lost either way)
            self._route(deltas)
        return deltas

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineFailedError(self.error) from self.error

    def _route(self, deltas: list[RequestOutput]) -> None:
        for d in deltas:
            route = self._routes.get(d.request_id)
            if route is not None:
                route(d)

    def run_until_done(self) -> None:
        """Step until no request is unfinished (the batch script's and the benchmarks' loop)."""
        while self.has_unfinished():
            self.step()

    # ---------------------------------------------------------------- ending
    def abort(self, request_id: str) -> None:
        """Abort a request; its final deltas (finish_reason "abort") go to its route, so a caller
        waiting on it from another thread returns. Applied by whichever comes first: this call's turn
        at the lock or the next step (self._aborts)."""
        self._aborts.append(request_id)
        with self._lock:
            self._apply_aborts()

    def _apply_aborts(self) -> None:
        """Under the lock: every abort asked for so far, each request's final deltas to its route."""
        while self._aborts:
            request_id = self._aborts.popleft()
            if self.error is None:
                self._route(self.engine.abort(request_id))

    def release(self, request_id: str, abort: bool = True) -> list[RequestMetrics]:
        """The adapter is done with a request: abort it if it still runs (abort=False: leave the
        engine alone, e.g. it has died), forget its route; returns its per-sample metrics."""
        with self._lock:
            return self._release_locked(request_id, abort)

    def _release_locked(self, request_id: str, abort: bool) -> list[RequestMetrics]:
        if abort and self.error is None:
            self.engine.abort(request_id)
        self._routes.pop(request_id, None)
        return [_snapshot(request_id, r) for r in self._samples.pop(request_id, [])]

    def detach_routes(self) -> list[Route]:
        """Forget every route (the engine died); returns them so the adapter can fail each once."""
        with self._lock:
            routes = [r for r in self._routes.values() if r is not None]
            self._routes.clear()
            return routes

    # ---------------------------------------------------------------- synchronous callers
    def stream_deltas(self, request_id: str, n: int, queue: deque) -> Iterator[RequestOutput]:
        """Deltas of a request submitted with route=queue.append until its n samples finish,
        stepping the engine whenever the queue is empty (several threads share every step).
        A caller that stops early aborts the request."""
        done = 0
        try:
            while done < n:
                while queue:
                    d = queue.popleft()
                    done += d.finished
                    yield d
                if done < n and not self.step():
                    time.sleep(0.0005)   # dynamic batching: waiting for its window to close
        finally:
            self.release(request_id, abort=done < n)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 cache_salt: str | None = None, priority: int | Sequence[int] = 0,
                 lora: str | None | Sequence[str | None] = None
                 ) -> tuple[list[str], list[list[Completion]]]:
        """Submit all prompts (all or nothing), run them to the end; (request ids, completions per
        prompt with one Completion per sample). lora: submit's."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        queues: dict[str, deque] = defaultdict(deque)
        rids = self.submit(prompts, plist, route=lambda d: queues[d.request_id].append(d), cache_salt=cache_salt,
                           priority=priority, lora=lora)
        results = [[Completion() for _ in range(p.n)] for p in plist]
        with self._releasing(rids):
            for rid, p, samples in zip(rids, plist, results):
                for d in self.stream_deltas(rid, p.n, queues[rid]):
                    samples[d.sample_index].add(d)
        return rids, results

    def beam_search(self, prompts: Sequence[list[int]], params: BeamSearchParams, cache_salt: str | None = None,
                    priority: int = 0, lora: str | None = None) -> list[list[RequestOutput]]:
        """Beam search over each prompt (host/beam_search.py): every round one request per live beam
        of every prompt, run together; per prompt its beam_width best hypotheses, best first, each
        one finished RequestOutput (beam_outputs). A prompt whose beams cannot reach max_tokens
        within the context is a SubmitError naming max_tokens, before anything runs. Each prompt's
        result is beam_outputs': one delta per token of each hypothesis."""
        self.check_beam_fits(prompts, params)
        searches = [BeamSearch(list(p), params, self.eos_ids) for p in prompts]
        while live := [s for s in searches if not s.done]:
            batch = [seq for s in live for seq in s.prompts()]
            _, results = self.generate(batch, params.round_params(), cache_salt=cache_salt, priority=priority,
                                       lora=lora)
            advance_all(live, [r[0].top_logprobs[0] for r in results])
        return [beam_outputs(s, str(i), self.engine.tokenizer) for i, s in enumerate(searches)]

    def check_beam_fits(self, prompts: Sequence[list[int]], params: BeamSearchParams) -> None:
        """A SubmitError naming max_tokens for the first prompt whose beams cannot reach max_tokens
        within the context (the engine's own check of a request, made before any round runs)."""
        for i, p in enumerate(prompts):
            total = len(p) + params.max_tokens
            if total > self.max_model_len:
                raise SubmitError(i, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                     f"you requested {total} tokens ({len(p)} in the prompt, {params.max_tokens} for "
                                     f"the completion), {total - self.max_model_len} too many. Please reduce the "
                                     "prompt or max_tokens.", "max_tokens", "context_length_exceeded")

    @contextlib.contextmanager
    def _releasing(self, rids: list[str]):
        """Whatever ends the block (an error, Ctrl-C), the requests it has not released yet are
        aborted and released: none is left running for no caller."""
        try:
            yield
        finally:
            with self._lock:
                for rid in rids:
                    if rid in self._samples:
                        self._release_locked(rid, abort=True)


    def embed(self, prompts: Sequence[list[int]], poolings: Sequence) -> list:
        """Submit embedding requests (all or nothing; one PoolingState per prompt), run them to the
        end; their vectors (np.float32 [D] each), in order."""
        queues: dict[str, deque] = defaultdict(deque)
        rids = self.submit(prompts, SamplingParams(), route=lambda d: queues[d.request_id].append(d),
                           poolings=poolings)
        out = []
        with self._releasing(rids):
            for rid in rids:
                done = Completion()
                for d in self.stream_deltas(rid, 1, queues[rid]):
                    done.add(d)
                out.append(done.embedding)
        return out


def _snapshot(request_id: str, req) -> RequestMetrics:
    return RequestMetrics(request_id, req.sample_index, req.arrival_time, req.first_token_time, req.finish_time,
                          tuple(req.token_times), len(req.prompt_ids), len(req.output_ids), req.finish_reason,
                          req.finished)


def advance_all(searches: list[BeamSearch], tops: list[list[tuple[int, float]]]) -> None:
    """One round's top logprobs, one list per beam in the order of the searches' prompts(), to each."""
    k = 0
    for s in searches:
        n = len(s.beams)
        s.advance(tops[k:k + n])
        k += n


def beam_outputs(search: BeamSearch, request_id: str, tokenizer: Tokenizer | None) -> list[RequestOutput]:
    """A finished search's best hypotheses (sample_index = rank) as the engine's deltas are made: one
    per output token (at least one), its text decoded after the prompt and what precedes it, its
    logprob and its round's top; the last one finished."""
    out = []
    k = search.params.logprobs
    for rank, beam in enumerate(search.best()):
        ids, n_text = search.output_ids(beam), len(search.text_ids(beam))
        detok = (IncrementalDetokenizer(tokenizer, beam.tokens[:search.prompt_len], search.params.skip_special_tokens)
                 if tokenizer is not None else None)
        for j in range(max(len(ids), 1)):
            last = j >= len(ids) - 1
            text = detok.add(ids[j]) if detok is not None and j < n_text else ""
            text += detok.flush() if detok is not None and last else ""
            out.append(RequestOutput(request_id, rank, text, ids[j:j + 1], beam.logprobs[j:j + 1],
                                     [top[:k] for top in beam.top_logprobs[j:j + 1]] if k else [], last,
                                     beam.finish_reason if last else None))
    return out
