"""The engine's live step accounting: the counters Engine.stats() reports (served on /metrics) about
the steps that ran: their host and device time, their tokens, and the bytes they read as
jaxinfer.perf's cost model counts them, so the live MBU, a benchmark's (bench/metrics.py) and
`jaxinfer plan` count the same bytes.

Host-side numbers only: never imports jax (the engine hands it finished steps' records).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jaxinfer import perf

__all__ = ["StepStats"]


@dataclass
class StepStats:
    step_times: deque = field(default_factory=lambda: deque(maxlen=1024))
    host_times: deque = field(default_factory=lambda: deque(maxlen=1024))   # engine.step() less waiting
    bandwidth: deque = field(default_factory=lambda: deque(maxlen=64))   # bytes/s of recent steps
    bytes_read: float = 0.0              # by every step that ran the model (perf.ModelCost.step_bytes)
    device_time_s: float = 0.0           # those steps' device time
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    compilations_after_warmup: int = 0   # XLA compilations inside this engine's steps

    def count_step(self, cost: perf.ModelCost, step: perf.StepRecord, iterations: int) -> None:
        """Add one completed step's bytes (the cost model's, as the benchmarks and `jaxinfer plan`
        count them) and device time to the live MBU figures; iterations: the most any row ran."""
        nbytes = cost.step_bytes(step)
        self.step_times.append(step.time_s / iterations)
        self.bandwidth.append(nbytes / step.time_s)
        self.bytes_read += nbytes
        self.device_time_s += step.time_s

    def median_step_time_s(self) -> float | None:
        return float(np.median(self.step_times)) if self.step_times else None

    def median_host_time_s(self) -> float | None:
        return float(np.median(self.host_times)) if self.host_times else None

    def achieved_bandwidth(self) -> float | None:
        """The median achieved bandwidth of recent steps, bytes/s (None before any step)."""
        return float(np.median(self.bandwidth)) if self.bandwidth else None

    def mbu(self, device: perf.Device | None) -> float | None:
        """Recent steps' achieved bandwidth over the datasheet's peak (None when either is unknown)."""
        return perf.mbu(self.achieved_bandwidth(), None if device is None else device.bandwidth)
