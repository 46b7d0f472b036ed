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

From the engine's step log (StepLog; offline mode only; the formulas are jaxinfer.perf's), per step with
sequences s, each computing
n_s tokens starting at position start_s (so its context after the step is c_s = start_s + n_s):
    bytes(step) = W + sum_s c_s * kv_bytes_per_token
        W = weight bytes one step reads: every parameter except an untied input-embedding table
            (a gather of T rows, not a read of the table); kv_bytes_per_token = 2*L*H_kv*d_head*itemsize.
            KV *writes* of the step's new tokens are not counted (vLLM/Databricks MBU convention).
    flops(step) = 2 * P_body * T + 2 * V * d_model * S + sum_s sum_layers 4 * H * d_head * sum_{i<n_s} k_{s,i}
        T = sum_s n_s tokens, S = number of sequences (the LM head runs on one row per sequence),
        P_body = parameters outside the embedding / LM-head tables (blocks + norms + biases),
        k_{s,i} = start_s + i + 1 keys seen by query i (causal), capped at the layer's sliding window;
        4 = 2 FLOPs per multiply-add x (QK^T + PV).
    MBU = sum bytes / sum step time / peak bandwidth;  MFU = sum flops / sum step time / peak FLOP/s
(time-weighted over steps, i.e. the aggregate achieved rate over peak). `_decode` variants use only
the steps in which every sequence computed one token (pure decode). Step time is the wall time of
`engine.step()` (schedule + host prep + device + detokenize), so host overhead lowers MBU/MFU.
The schedule is read exactly: StepLog is an engine step observer (Engine.add_step_observer), which
hands it each executed plan's (start, num_tokens) pairs and timing; it does not change what the
engine does.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from jaxinfer import perf

_KV_DTYPE_OF_ITEMSIZE = {4: "float32", 2: "bfloat16", 1: "int8"}

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
@dataclass
class StepRecord:
    """One engine step: its wall time and, per scheduled sequence, (start, num_tokens)."""
    time_s: float
    spans: list[tuple[int, int]]
    execute_s: float | None = None     # the engine's own timing of runner.execute, for reference

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def num_seqs(self) -> int:
        return len(self.spans)

    @property
    def context_lens(self) -> list[int]:
        return [s + n for s, n in self.spans]

    @property
    def is_decode(self) -> bool:
        return bool(self.spans) and all(n == 1 for _, n in self.spans)


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
        self.steps.append(StepRecord(trace.wall_s, list(trace.spans), trace.device_s))

    def step(self) -> list:
        return self.client.step()

    def detach(self) -> None:
        self.client.remove_step_observer(self._observe)


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model costs in bytes and FLOPs (formulas in the module docstring)."""
    n_layers: int
    n_heads: int
    head_dim: int
    d_model: int
    vocab_size: int
    body_params: int                      # parameters run on every token (all but embedding tables; MoE: active)
    weight_bytes_read: int                # W: bytes of weights one step reads
    kv_bytes_per_token: int               # K and V of one token, all layers
    windows: tuple[int | None, ...] = ()  # per layer sliding window (None = full causal)

    @classmethod
    def from_config(cls, cfg: Any, weight_itemsize: float, kv_itemsize: int) -> "ModelCost":
        table = cfg.vocab_size * cfg.d_model
        pos = cfg.max_position_embeddings * cfg.d_model if cfg.position == "learned" else 0
        total = cfg.num_params()
        # FLOPs: a token runs through its routed experts only (num_active_params); bytes: every weight,
        # which a mixture of experts reads in full only once a step's rows reach every expert
        body = cfg.num_active_params() - table * (1 if cfg.tie_embeddings else 2) - pos
        # read per step: the blocks + the LM head (the tied table is the head); not the input table
        read = total - table * (1 if cfg.tie_embeddings else 2) - pos + table
        kv = perf.kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, _KV_DTYPE_OF_ITEMSIZE[kv_itemsize])
        return cls(cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.d_model, cfg.vocab_size, body,
                   int(round(read * weight_itemsize)), kv,
                   tuple(cfg.layer_window(i) for i in range(cfg.n_layers)))

    @classmethod
    def from_stats(cls, cfg: Any, stats: dict) -> "ModelCost":
        """From the model's config and the engine's stats() (weight_bytes, kv_bytes_per_token)."""
        itemsize = stats["weight_bytes"] / cfg.num_params()
        return dataclasses.replace(cls.from_config(cfg, itemsize, 2), kv_bytes_per_token=stats["kv_bytes_per_token"])

    def _layer_windows(self) -> list[int | None]:
        return list(self.windows) if self.windows else [None] * self.n_layers

    def step_bytes(self, step: StepRecord) -> float:
        per_layer = self.kv_bytes_per_token / self.n_layers
        context = sum(c if w is None else min(c, w) for w in self._layer_windows() for c in step.context_lens)
        return perf.bytes_read(self.weight_bytes_read, per_layer, context)

    def step_flops(self, step: StepRecord) -> float:
        return perf.forward_flops(self.body_params, self.vocab_size, self.d_model, self.n_heads, self.head_dim,
                                  step.spans, self._layer_windows())


def utilization(steps: Sequence[StepRecord], cost: ModelCost, peak_bandwidth: float | None,
                peak_flops: float | None) -> dict[str, Any]:
    """MBU / MFU over all steps and over pure-decode steps (time-weighted aggregates)."""
    def agg(sel: list[StepRecord], suffix: str) -> dict[str, Any]:
        t = sum(s.time_s for s in sel)
        b = sum(cost.step_bytes(s) for s in sel)
        f = sum(cost.step_flops(s) for s in sel)
        bw = b / t if t > 0 else None
        fl = f / t if t > 0 else None
        return {
            f"num_steps{suffix}": len(sel), f"step_time_s{suffix}": t,
            f"achieved_bandwidth_Bps{suffix}": bw, f"achieved_flops{suffix}": fl,
            f"mbu{suffix}": perf.mbu(bw, peak_bandwidth),
            f"mfu{suffix}": perf.mfu(fl, peak_flops),
        }
    out = agg(list(steps), "")
    out |= agg([s for s in steps if s.is_decode], "_decode")
    out["step_time_ms"] = distribution((s.time_s for s in steps), 1000.0)
    out["weight_bytes_read"] = cost.weight_bytes_read
    out["kv_bytes_per_token"] = cost.kv_bytes_per_token
    return out


# --------------------------------------------------------------------------- device peaks
def table_peaks(device_kind: str, dtype: str = "bfloat16") -> dict[str, Any] | None:
    """The datasheet peaks of jax's device_kind (jaxinfer.perf.DEVICES), or None."""
    dev = perf.device_for_kind(device_kind)
    if dev is None or not dev.flops_bf16:
        return None
    return {"name": dev.label, "bandwidth_Bps": dev.bandwidth, "flops": dev.peak_flops(dtype),
            "flops_dtype": dtype, "source": "table"}


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
    out = table_peaks(device_kind, dtype) if platform != "cpu" else None
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

