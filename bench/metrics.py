"""The field's serving metrics, computed from request timestamps and an engine step log.

Per request (definitions of vLLM's benchmarks/benchmark_serving.py; times in one clock, seconds):
    TTFT  = first_token - arrival                      time to first token
    E2EL  = finish - arrival                           end-to-end latency (finish = last token)
    TPOT  = (E2EL - TTFT) / (output_tokens - 1)        only requests with > 1 output token
    ITL   = gaps between consecutive output tokens (client side: SSE chunks), pooled over requests
Each is summarised as n, mean, std, p50, p90, p99 (np.percentile, linear interpolation) in ms.
Over the run (duration = the benchmark's wall time, first submission to last completion):
    request_throughput     = completed requests / duration          (req/s)
    output_throughput      = total output tokens / duration         (tok/s)
    total_token_throughput = (input + output tokens) / duration     (tok/s)

From the engine's step log (StepLog; offline mode only): bytes, FLOPs, MBU and MFU per step are
jaxinfer.perf's cost model (ModelCost, utilization; formulas in its docstring), built from the engine's
own stats() (ModelCost.from_stats), so the benchmark, Engine.stats() / GET /metrics and `jaxinfer plan`
count the same bytes for the same run. MBU = sum bytes / sum step time / peak bandwidth (time-weighted
over steps); `_decode` variants use only the steps in which every sequence computed one token. Step
time is the wall time of `engine.step()` (schedule + host prep + device + detokenize), so host
overhead lowers MBU/MFU. The schedule is read exactly: StepLog is an engine step observer
(Engine.add_step_observer), which hands it, per engine.step() call, the (start, num_tokens) pairs of
the step whose tokens the call applied, the iterations the device ran each (a multi-step decode runs
several), and timing; it does not change what the engine does.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from jaxinfer import perf
from jaxinfer.perf import ModelCost, StepRecord

PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------------------- per-request metrics
@dataclass
class RequestRecord:
    """One request's timestamps (seconds, one clock) and token counts."""
    arrival: float                              # submitted (offline) / sent (client)
    first_token: float | None                   # first output token (client: first SSE chunk with choices)
    finish: float | None                        # last output token
    token_times: list[float] = field(default_factory=list)   # each output token (client: each chunk)
    prompt_tokens: int = 0
    output_tokens: int = 0
    success: bool = True
    error: str = ""

    @classmethod
    def from_metrics(cls, m: Any) -> "RequestRecord":
        """From a jaxinfer.client.RequestMetrics (engine clock: time.monotonic)."""
        finish = m.token_times[-1] if m.token_times else m.finish_time
        return cls(m.arrival_time, m.first_token_time, finish, list(m.token_times), m.num_prompt_tokens,
                   m.num_output_tokens, success=m.first_token_time is not None)

    @classmethod
    def from_request(cls, req: Any) -> "RequestRecord":
        """From a finished jaxinfer.host.request.Request (engine clock: time.monotonic)."""
        finish = req.token_times[-1] if req.token_times else req.finish_time
        return cls(req.arrival_time, req.first_token_time, finish, list(req.token_times),
                   len(req.prompt_ids), len(req.output_ids), success=req.first_token_time is not None)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2el(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def distribution(values: Iterable[float], scale: float = 1.0,
                 percentiles: Sequence[int] = PERCENTILES) -> dict[str, float | int | None]:
    """n, mean, std and percentiles (np.percentile, linear) of values * scale; None when empty."""
    v = np.asarray([x for x in values if x is not None], np.float64) * scale
    out: dict[str, float | int | None] = {"n": int(v.size)}
    empty = v.size == 0
    out["mean"] = None if empty else float(v.mean())
    out["std"] = None if empty else float(v.std())
    for p in percentiles:
        out[f"p{p}"] = None if empty else float(np.percentile(v, p))
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float,
              percentiles: Sequence[int] = PERCENTILES) -> dict[str, Any]:
    """The run's metrics (vLLM benchmark_serving definitions); latencies in ms."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ms = 1000.0
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": total_out / duration_s if duration_s > 0 else None,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else None,
        "ttft_ms": distribution((r.ttft for r in ok), ms, percentiles),
        "tpot_ms": distribution((r.tpot for r in ok), ms, percentiles),
        "itl_ms": distribution((g for r in ok for g in r.itl), ms, percentiles),
        "e2el_ms": distribution((r.e2el for r in ok), ms, percentiles),
    }


# --------------------------------------------------------------------------- step log, MBU / MFU
class StepLog:
    """Log each engine step's plan and wall time, from the engine's step-observer hook.

        log = StepLog(gen.client)          # an EngineClient (or anything with add/remove_step_observer)
        while gen.client.has_unfinished():
            outputs = log.step()
        log.detach()
    """

    def __init__(self, client: Any):
        self.client = client
        self.steps: list[StepRecord] = []
        client.add_step_observer(self._observe)

    def _observe(self, trace: Any) -> None:
        self.steps.append(StepRecord(trace.wall_s, list(trace.spans), trace.device_s,
                                     list(trace.iterations) if trace.spans else None))

    def step(self) -> list:
        return self.client.step()

    def detach(self) -> None:
        self.client.remove_step_observer(self._observe)


def utilization(steps: Sequence[StepRecord], cost: ModelCost, peak_bandwidth: float | None,
                peak_flops: float | None) -> dict[str, Any]:
    """jaxinfer.perf.utilization (MBU / MFU over all steps and over pure-decode steps) and the
    distribution of step times."""
    return perf.utilization(steps, cost, peak_bandwidth, peak_flops) | {
        "step_time_ms": distribution((s.time_s for s in steps), 1000.0)}


# --------------------------------------------------------------------------- device peaks
def measure_cpu_bandwidth(mib: int = 256, reps: int = 7, threads: int | None = None) -> dict[str, Any]:
    """Host memory bandwidth: a numpy copy of a `mib` MiB array split over `threads` threads
    (numpy releases the GIL while copying); bytes read + written / time, median of `reps`."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or os.cpu_count() or 1
    n = mib * (1 << 20) // 8
    src = np.ones(n, np.float64)
    dst = np.empty_like(src)
    bounds = np.linspace(0, n, threads + 1).astype(int)
    chunks = [(dst[a:b], src[a:b]) for a, b in zip(bounds, bounds[1:])]
    samples = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda c: np.copyto(*c), chunks))
            samples.append(2 * src.nbytes / (time.perf_counter() - t0))
    samples = samples[1:]   # the first copy faults the destination pages in
    return {"bandwidth_Bps": float(np.median(samples)), "samples": samples, "threads": threads,
            "method": f"numpy copy of {mib} MiB, {threads} threads, (read + write bytes) / time, median of {reps}"}


def measure_cpu_flops(n: int = 2048, reps: int = 5) -> dict[str, Any]:
    """Peak FLOP/s: a jitted n x n float32 matmul on jax's CPU backend, 2 n^3 / time, median of `reps`."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        samples.append(2.0 * n ** 3 / (time.perf_counter() - t0))
    return {"flops": float(np.median(samples)), "samples": samples,
            "method": f"jax.jit float32 matmul {n}x{n} on CPU, 2n^3 / time, median of {reps}"}


def device_peaks(device_kind: str, platform: str, dtype: str = "bfloat16", bandwidth: float | None = None,
                 flops: float | None = None) -> dict[str, Any]:
    """Peaks for MBU / MFU: user values, else the table, else (CPU or unknown) measured here."""
    out = perf.table_peaks(device_kind, dtype) if platform != "cpu" else None
    out = dict(out or {"name": device_kind, "bandwidth_Bps": None, "flops": None, "source": "measured"})
    if bandwidth is None and out["bandwidth_Bps"] is None and platform == "cpu":
        m = measure_cpu_bandwidth()
        out["bandwidth_Bps"], out["bandwidth_measurement"] = m["bandwidth_Bps"], m
    if flops is None and out["flops"] is None and platform == "cpu":
        m = measure_cpu_flops()
        out["flops"], out["flops_measurement"] = m["flops"], m
        out["flops_dtype"] = "float32"
    if bandwidth is not None:
        out["bandwidth_Bps"], out["bandwidth_source"] = bandwidth, "user"
    if flops is not None:
        out["flops"], out["flops_source"] = flops, "user"
    return out

