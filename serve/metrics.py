"""Prometheus metrics of the server (GET /metrics), one registry per app.

Latencies are the field's definitions: TTFT = first token - arrival, inter-token latency =
gap between consecutive tokens of a request, end-to-end = finish - arrival (seconds).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxinfer.client import RequestMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.itl = Histogram("jaxinfer_inter_token_latency_seconds", "Time between consecutive output tokens",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "End-to-end request latency",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.waiting = Gauge("jaxinfer_num_requests_waiting", "Requests waiting to be scheduled",
                             ["model_name"], registry=r).labels(**label)
        self.running = Gauge("jaxinfer_num_requests_running", "Sequences running", ["model_name"],
                             registry=r).labels(**label)
        self.kv_used = Gauge("jaxinfer_kv_blocks_used", "KV cache blocks in use", ["model_name"],
                             registry=r).labels(**label)
        self.kv_usage = Gauge("jaxinfer_kv_cache_usage_perc", "KV cache usage: the share of the pool's blocks "
                              "not free (1 = full; vLLM's kv_cache_usage_perc)", ["model_name"],
                              registry=r).labels(**label)
        # vLLM's lora_requests_info (routers such as the Gateway API Inference Extension read it): one
        # series per (running, waiting, max) labels, its value the time they were last seen
        self.lora_info = Gauge("jaxinfer_lora_requests_info", "LoRA adapters of the running and waiting requests",
                               ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                               registry=r)
        self.kv_total = Gauge("jaxinfer_kv_blocks_total", "KV cache blocks", ["model_name"],
                              registry=r).labels(**label)
        self.compilations = Gauge("jaxinfer_compilations_after_warmup", "XLA compilations after warm-up",
                                  ["model_name"], registry=r).labels(**label)
        self.preemptions = Counter("jaxinfer_num_preemptions", "Requests preempted", ["model_name"],
                                   registry=r).labels(**label)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens computed", ["model_name"],
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**label)
        self.mbu = Gauge("jaxinfer_mbu", "Model bandwidth utilisation of recent steps (bytes read / step time / "
                         "peak bandwidth); NaN when the device's peak is unknown", ["model_name"],
                         registry=r).labels(**label)
        self.bandwidth = Gauge("jaxinfer_achieved_bandwidth_bytes_per_second", "Bytes read per second by recent steps",
                               ["model_name"], registry=r).labels(**label)
        self.cache_queries = Counter("jaxinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     ["model_name"], registry=r).labels(**label)
        self.cache_hits = Counter("jaxinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  ["model_name"], registry=r).labels(**label)
        self.cache_evictions = Counter("jaxinfer_prefix_cache_evictions", "Cached KV blocks evicted for reuse",
                                       ["model_name"], registry=r).labels(**label)
        self.cache_blocks = Gauge("jaxinfer_prefix_cache_blocks", "KV blocks holding a cached prefix",
                                  ["model_name"], registry=r).labels(**label)
        # the prefix cache's host tier (kv_offload_gb): hits and misses in blocks, past the device's cache
        host = {key: Counter(name, doc, ["model_name"], registry=r).labels(**label) for key, name, doc in (
            ("kv_host_hits", "jaxinfer_kv_host_hits", "Prompt blocks restored from the host tier"),
            ("kv_host_misses", "jaxinfer_kv_host_misses",
             "Prompt blocks neither the device pool nor the host tier held"),
            ("kv_host_bytes_offloaded", "jaxinfer_kv_host_bytes_offloaded",
             "Bytes copied from the device pool to the host tier"),
            ("kv_host_bytes_restored", "jaxinfer_kv_host_bytes_restored",
             "Bytes copied from the host tier back to the device pool"),
            ("kv_host_restore_time_s", "jaxinfer_kv_host_restore_seconds",
             "Seconds spent restoring blocks from the host tier"))}
        self.host_counters = host
        self.host_blocks = Gauge("jaxinfer_kv_host_blocks", "KV blocks the host tier holds", ["model_name"],
                                 registry=r).labels(**label)
        self.host_bytes = Gauge("jaxinfer_kv_host_bytes", "Bytes the host tier holds", ["model_name"],
                                registry=r).labels(**label)
        self.finished = Counter("jaxinfer_request_success", "Finished requests", ["model_name", "finish_reason"],
                                registry=r)
        self._spec_metrics(r, label)
        self._label = label
        self._last = {"num_preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0, "prefix_cache_evictions": 0, "spec_decode_num_drafts": 0,
                      "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
                      "spec_decode_draft_catchup_tokens": 0, **dict.fromkeys(host, 0)}
        self._last_pos: list[int] = []

    def _spec_metrics(self, r: CollectorRegistry, label: dict) -> None:
        """Speculative decoding's, named like vLLM's spec_decode metrics."""
        self.spec_drafts = Counter("jaxinfer_spec_decode_num_drafts", "Speculation rounds of a sequence that proposed",
                                   ["model_name"], registry=r).labels(**label)
        self.spec_draft_tokens = Counter("jaxinfer_spec_decode_num_draft_tokens", "Tokens proposed",
                                         ["model_name"], registry=r).labels(**label)
        self.spec_accepted = Counter("jaxinfer_spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                     ["model_name"], registry=r).labels(**label)
        self.spec_accepted_pos = Counter("jaxinfer_spec_decode_num_accepted_tokens_per_pos",
                                         "Proposed tokens accepted at each position of a draft",
                                         ["model_name", "position"], registry=r)
        self.spec_mean_len = Gauge("jaxinfer_spec_decode_mean_acceptance_length",
                                   "Tokens per speculating sequence and round: 1 + accepted / drafts",
                                   ["model_name"], registry=r).labels(**label)
        self.spec_catchup = Counter("jaxinfer_spec_decode_draft_catchup_tokens",
                                    "Positions the draft model recomputed after decode steps that skipped it",
                                    ["model_name"], registry=r).labels(**label)

    def observe_step(self, s: dict) -> None:
        """s: the engine's stats() after a step."""
        self.waiting.set(s["num_waiting"])
        self.running.set(s["num_running"])
        self.kv_used.set(s["kv_blocks_used"])
        self.kv_total.set(s["kv_blocks_total"])
        self.kv_usage.set(s["kv_cache_usage"])
        if s["max_loras"] is not None:
            self.lora_info.labels(**self._label, max_lora=str(s["max_loras"]),
                                  running_lora_adapters=",".join(s["running_lora_adapters"]),
                                  waiting_lora_adapters=",".join(s["waiting_lora_adapters"])).set_to_current_time()
        self.compilations.set(s["compilations_after_warmup"] or 0)
        self.mbu.set(float("nan") if s["mbu"] is None else s["mbu"])
        if s["achieved_bandwidth_bytes_per_s"] is not None:
            self.bandwidth.set(s["achieved_bandwidth_bytes_per_s"])
        self.cache_blocks.set(s["prefix_cache_blocks"])
        self.host_blocks.set(s["kv_host_blocks"])
        self.host_bytes.set(s["kv_host_bytes"])
        for key, counter in (("num_preemptions", self.preemptions), ("prompt_tokens", self.prompt_tokens),
                             ("generation_tokens", self.generation_tokens),
                             ("prefix_cache_queries", self.cache_queries), ("prefix_cache_hits", self.cache_hits),
                             ("prefix_cache_evictions", self.cache_evictions),
                             ("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted),
                             ("spec_decode_draft_catchup_tokens", self.spec_catchup),
                             *self.host_counters.items()):
            if s[key] > self._last[key]:
                counter.inc(s[key] - self._last[key])
                self._last[key] = s[key]
        per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
        self._last_pos += [0] * (len(per_pos) - len(self._last_pos))
        for i, n in enumerate(per_pos):
            if n > self._last_pos[i]:
                self.spec_accepted_pos.labels(**self._label, position=str(i)).inc(n - self._last_pos[i])
                self._last_pos[i] = n
        if s["spec_decode_mean_acceptance_length"] is not None:
            self.spec_mean_len.set(s["spec_decode_mean_acceptance_length"])

    def observe_finished(self, req: RequestMetrics) -> None:
        if req.ttft is not None:
            self.ttft.observe(req.ttft)
        for gap in req.itl:
            self.itl.observe(gap)
        if req.finish_time is not None:
            self.e2e.observe(req.finish_time - req.arrival_time)
        self.finished.labels(finish_reason=req.finish_reason or "unknown", **self._label).inc()
