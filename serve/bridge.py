"""The async bridge: the engine steps on its own thread; each HTTP request gets an asyncio.Queue.

A thin adapter over the Generator's EngineClient (jaxinfer.client): the loop thread calls
client.step(), which routes each delta to the event loop of the request that owns it
(call_soon_threadsafe); submitting and releasing go through the same client, whose lock keeps
the engine to one thread at a time.

If the loop thread dies (an exception out of a step), every waiting queue receives an
`EngineDeadError` at once and every later submit() is refused with a 503: no request ever waits
on a loop that will not run again.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

from jaxinfer.client import SubmitError
from jaxinfer.config import SamplingParams
from jaxinfer.generator import Generator
from serve.metrics import ServerMetrics
from serve.protocol import OpenAIError


class EngineDeadError(OpenAIError):
    """The engine loop has stopped; what is in flight cannot finish and nothing new can run."""

    def __init__(self, cause: BaseException | None):
        super().__init__(503, f"the inference engine has stopped ({type(cause).__name__}: {cause}); "
                              "restart the server", type_="server_error", code="engine_dead")


@dataclass
class Submission:
    request_ids: list[str]
    queue: asyncio.Queue      # RequestOutput deltas, or one EngineDeadError
    n: int


class AsyncEngine:
    def __init__(self, gen: Generator, metrics: ServerMetrics, max_queue: int = 1024):
        self.gen, self.client = gen, gen.client
        self.metrics, self.max_queue = metrics, max_queue
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def queued_sequences(self) -> int:
        """Sequences admitted but not yet running (a request with n samples counts n)."""
        return self.client.queued_sequences()

    def submit(self, prompts: list[list[int]], params: SamplingParams, cache_salt: str | None = None,
               request_field: Callable[[str], str] | None = None, priority: int = 0,
               lora: str | None = None, poolings: list | None = None) -> Submission:
        """Queue one engine request per prompt; all their deltas arrive on one asyncio.Queue.
        Raises OpenAIError: 503 when the engine has stopped, 400 for what can never fit the queue
        or what the engine refuses (its param mapped by request_field to this request's field name,
        e.g. structured_outputs -> response_format), 429 when the queue is full now. lora: the LoRA
        adapter the requests run with (None: the base model). poolings: embedding requests
        (EngineClient.submit), one PoolingState per prompt."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        sequences = len(prompts) * params.n
        if sequences > self.max_queue:
            raise OpenAIError(400, f"this request has {sequences} sequences ({len(prompts)} prompt(s) x n={params.n}) "
                                   f"but the server queues at most {self.max_queue}; split it",
                              param="n" if params.n > 1 else "prompt")

        def admit() -> None:   # under the client's lock: nothing steps or submits meanwhile
            if self.error is not None or not self._thread.is_alive():
                raise EngineDeadError(self.error)
            if self.client.is_sleeping():
                raise OpenAIError(503, "the engine is sleeping (POST /wake_up)", type_="server_error",
                                  code="engine_sleeping")
            waiting = self.client.queued_sequences()
            if waiting + sequences > self.max_queue:
                raise OpenAIError(429, f"the server is at capacity ({waiting} sequences waiting); retry later",
                                  type_="rate_limit_error", headers={"Retry-After": "1"})

        route = _Route(loop, queue)
        try:
            rids = self.client.submit(prompts, params, route=route, check=admit,
                                      cache_salt=cache_salt, max_tokens_must_fit=True, priority=priority,
                                      lora=lora, poolings=poolings)
        except SubmitError as e:   # the engine's own validation (Engine.add_request), field named
            param = (request_field or str)(e.param) if e.param else "prompt"
            raise OpenAIError(400, e.message, param=param, code=e.code) from None
        self._wake.set()
        return Submission(rids, queue, params.n)

    def release(self, sub: Submission, finished: bool) -> None:
        """The HTTP side is done with a submission: abort what is still running (client gone)."""
        for rid in sub.request_ids:
            samples = self.client.release(rid, abort=not finished and self.error is None)
            if samples and all(m.finished for m in samples):
                for m in samples:
                    self.metrics.observe_finished(m)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.client.has_unfinished()
                deltas = self.client.step() if busy else []
                self.metrics.observe_step(self.client.stats())
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                elif not deltas:
                    time.sleep(0.0005)
        except BaseException as e:  # surfaced by /health; every request in flight gets a 503 now
            self._fail_all(e)
            raise

    def _fail_all(self, cause: BaseException) -> None:
        self.error = cause
        queues = {id(r.queue): r for r in self.client.detach_routes()}
        for r in queues.values():
            try:
                r.loop.call_soon_threadsafe(r.queue.put_nowait, EngineDeadError(cause))
            except RuntimeError:   # that request's event loop is already closed
                pass


@dataclass(frozen=True)
class _Route:
    """Hands a delta from the engine thread to the asyncio.Queue of the request that owns it."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def __call__(self, d) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, d)
