"""The async bridge: the engine steps on its own thread; each HTTP request gets an asyncio.Queue.

The loop thread holds the Generator's lock for one engine step at a time, then hands each delta to
the event loop of the request that owns it (call_soon_threadsafe). Adding and aborting requests
take the same lock, so the engine is only ever touched by one thread at a time.

If the loop thread dies (an exception out of a step), every waiting queue receives an
`EngineDeadError` at once and every later submit() is refused with a 503: no request ever waits
on a loop that will not run again.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from jaxinfer.config import SamplingParams
from jaxinfer.engine import RequestOutput
from jaxinfer.generator import Generator
from jaxinfer.host.request import Request
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
        self.gen, self.engine, self.lock = gen, gen.engine, gen._lock
        self.metrics, self.max_queue = metrics, max_queue
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._requests: dict[str, list[Request]] = {}
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
        scheduler = self.engine.scheduler
        return scheduler.num_unfinished() - len(scheduler.running)

    def submit(self, prompts: list[list[int]], params: SamplingParams, cache_salt: str | None = None) -> Submission:
        """Queue one engine request per prompt; all their deltas arrive on one asyncio.Queue.
        Raises OpenAIError: 503 when the engine has stopped, 400 for what can never fit the queue,
        429 when the queue is full now."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        rids: list[str] = []
        sequences = len(prompts) * params.n
        if sequences > self.max_queue:
            raise OpenAIError(400, f"this request has {sequences} sequences ({len(prompts)} prompt(s) x n={params.n}) "
                                   f"but the server queues at most {self.max_queue}; split it",
                              param="n" if params.n > 1 else "prompt")
        with self.lock:
            if self.error is not None or not self._thread.is_alive():
                raise EngineDeadError(self.error)
            waiting = self.queued_sequences()
            if waiting + sequences > self.max_queue:
                raise OpenAIError(429, f"the server is at capacity ({waiting} sequences waiting); retry later",
                                  type_="rate_limit_error", headers={"Retry-After": "1"})
            try:
                for p in prompts:
                    rid = self.engine.add_request(p, params, cache_salt=cache_salt)
                    rids.append(rid)
                    self._routes[rid] = (loop, queue)
                    group = [self.engine.scheduler.requests[rid], *self.engine.scheduler.requests[rid].pending_forks]
                    self._requests[rid] = group
            except ValueError as e:
                for rid in rids:
                    self._release_locked(rid)
                raise OpenAIError(400, str(e), param="prompt") from None
        self._wake.set()
        return Submission(rids, queue, params.n)

    def release(self, sub: Submission, finished: bool) -> None:
        """The HTTP side is done with a submission: abort what is still running (client gone)."""
        with self.lock:
            for rid in sub.request_ids:
                self._release_locked(rid, abort=not finished)

    def _release_locked(self, rid: str, abort: bool = True) -> None:
        if abort and self.error is None:   # a dead engine's state is not touched again
            self.engine.abort(rid)
        self._routes.pop(rid, None)
        reqs = self._requests.pop(rid, None)
        if reqs and all(r.finished for r in reqs):
            for r in reqs:
                self.metrics.observe_finished(r)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self.lock:
                    busy = self.engine.has_unfinished()
                    deltas: list[RequestOutput] = self.engine.step() if busy else []
                    self.metrics.observe_step(self.engine)
                    routes = [(self._routes.get(d.request_id), d) for d in deltas]
                for route, d in routes:
                    if route is not None:
                        route[0].call_soon_threadsafe(route[1].put_nowait, d)
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                elif not deltas:
                    time.sleep(0.0005)
        except BaseException as e:  # surfaced by /health; every request in flight gets a 503 now
            self._fail_all(e)
            raise

    def _fail_all(self, cause: BaseException) -> None:
        with self.lock:
            self.error = cause
            queues = {id(q): (loop, q) for loop, q in self._routes.values()}
            self._routes.clear()
        for loop, q in queues.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(cause))
            except RuntimeError:   # that request's event loop is already closed
                pass
