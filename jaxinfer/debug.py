"""StepDebugger: the one door to the engine's step below the request API, reached as
`EngineClient.debug` (bench/profile_step.py, bench/gpu/, the multi-host follower):

    inputs, iterations = client.debug.next_step_inputs()   # plan the next step, do not run it
    client.debug.replay_step(inputs)                        # run it (again), wait for it
    hlo = client.debug.step_hlo(inputs)                     # its optimized HLO
    client.debug.kv_pool_bytes(); client.debug.free_kv_pages()
    client.debug.run_published_step(arrays)                 # multi-host: process 0's step

Every call holds the client's lock, so it never interleaves with a step. It reaches the engine's
scheduler, block manager and runner directly: that is its job, and why adapters may not import it
or build one themselves (tests/test_engine_client.py: they use client.debug).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from jaxinfer.engine import Engine

__all__ = ["StepDebugger"]


class StepDebugger:
    def __init__(self, engine: Engine, lock: threading.RLock):
        self._engine = engine
        self._lock = lock
        self._published_treedef = None   # multi-host followers: the StepInputs pytree structure

    def next_step_inputs(self):
        """Profiling only: schedule the next step and return (its device StepInputs, its decode
        iterations) without running it; the engine must not step again."""
        with self._lock:
            engine = self._engine
            assert not engine.step_in_flight, "next_step_inputs needs a synchronous engine (async_scheduling=False)"
            sched = engine.scheduler.schedule()
            inputs = engine.runner.prepare(sched, engine.blocks.tables)[0]
            engine.runner.fill_masks()
            return inputs, sched.num_decode_iters

    def replay_step(self, inputs) -> None:
        """Profiling only: run the step of next_step_inputs() (again) and wait for it."""
        with self._lock:
            self._engine.runner.replay(inputs)

    def step_hlo(self, inputs) -> str:
        """Profiling only: the compiled step's optimized HLO for next_step_inputs()' shapes."""
        with self._lock:
            return self._engine.runner.step_hlo(inputs)

    def kv_pool_bytes(self) -> int:
        """Device bytes the KV pages take (every layer's K, V and scales, a draft model's too): a
        benchmark's memory accounting."""
        with self._lock:
            return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._engine.runner.kv_pages)))

    def free_kv_pages(self) -> None:
        """Delete the KV pages now (a benchmark sizing the next engine from free device memory);
        this engine cannot step afterwards."""
        with self._lock:
            self._engine.runner.release_pages()

    def run_published_step(self, arrays: list) -> None:
        """Multi-host followers: run the step process 0 published, its StepInputs as the flat host
        arrays of jaxinfer.distributed.step_arrays (same executable, pages donated)."""
        from jaxinfer.distributed import step_inputs
        with self._lock:
            runner = self._engine.runner
            if self._published_treedef is None:
                empty = runner.empty_inputs(runner.token_buckets[0], runner.block_buckets[0])
                self._published_treedef = jax.tree.structure(empty)
            runner.run_published(step_inputs(list(arrays), self._published_treedef))
