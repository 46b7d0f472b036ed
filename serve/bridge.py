"""The async bridge: the engine steps on its own thread; each HTTP request gets an asyncio.Queue.

The loop thread holds the Generator's lock for one engine step at a time, then hands each delta to
the event loop of the request that owns it (call_soon_threadsafe). Adding and aborting requests
take the same lock, so the engine is only ever touched by one thread at a time.
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


@dataclass
class Submission:
    request_ids: list[str]
    queue: asyncio.Queue
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
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Submission:
        """Queue one engine request per prompt; all their deltas arrive on one asyncio.Queue."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        rids: list[str] = []
        with self.lock:
            waiting = len(self.engine.scheduler.waiting)
            if waiting + len(prompts) > self.max_queue:
                raise OpenAIError(429, f"the server is at capacity ({waiting} requests waiting); retry later",
                                  type_="rate_limit_error", headers={"Retry-After": "1"})
            try:
                for p in prompts:
                    rid = self.engine.add_request(p, params)
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
        if abort:
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
        except BaseException as e:  # surfaced by /health; requests in flight get a 500
            self.error = e
            raise
