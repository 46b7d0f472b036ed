"""`python -m bench.gpu.decode`: issue #40's measurements of batch-1 decode against the memory-bandwidth
limit, on one GPU, in one command (estimated 6-7 minutes on an H200 from the bench.gpu run's timings,
never more than --deadline-s: every part has its own timeout).

    python -m bench.gpu.decode [--parts ceilings,profile,profile_nocb,profile_int8,batch1,ttft,knee] [--deadline-s 465]
                               [--out PATH] [--log-dir DIR] [--cold]
    python -m bench.gpu.decode --smoke [--out PATH]   every part on CPU with a tiny random model (< 60 s)
On a lent GPU machine, whose bench/results/ does not come back: --out $OUT/decode.json and a --log-dir
outside $OUT (it holds the run's compilation cache and traces), then copy its *.log files to $OUT.

Parts, in this order (the Llama-3-8B-shaped random bf16 model of bench/gpu/workload.py, built as
bench/gpu/parts.build_model builds it, driven through Generator and its EngineClient):
    ceilings  copy GB/s and bf16 matmul TFLOP/s (bench/gpu/parts.ceilings_part: bench.gpu's own code)
    profile   jax.profiler traces of batch-1 decode with attention="pallas", parsed on the spot by
              bench/gpu/trace.py into a per-op summary. `replay`: `profile_calls` replays of one
              multi-step decode call (client.debug.next_step_inputs / replay_step on a synchronous engine,
              each call annotated decode_call_<i>); `loop`: the engine's own loop (async scheduling,
              client.step) over `profile_loop_steps` decode steps, annotated decode_loop. Each summary:
              device time per kernel (top 30, and per kernel with copy numbers merged), device busy
              vs wall time, the gaps between kernels, kernels per decoded token, and the shares of
              attention, matmuls, LM head, sampler and everything else.
    profile_nocb  the `replay` trace again in a process whose XLA runs without GPU command buffers
              (CUDA graphs; XLA_FLAGS=--xla_gpu_enable_command_buffer=): every kernel then records
              its HLO instruction, so a cuBLAS LM head is told from the other matmuls, and the gaps
              with and without graphs compare (on CPU the flag changes nothing)
    profile_int8  the `replay` trace of the same model with int8 weight-only quantized linears (the
              shipped launch configs: autotuning off), so that what int8 decode spends beyond bf16's
              is seen per category (derived `profile_int8_vs_bf16`: each category's device time per
              token in both, and the difference; 2026-12-04's bench.gpu run: int8 0.88x of bf16 at
              batch 1, ~0.5 ms a token more than its matmuls' sweep accounts for)
    batch1    batch-1 decode tok/s and TPOT (bench/gpu/parts.batch1: N / (t(N+1 tokens) - t(1 token)),
              medians) per engine setting (attention, max_decode_steps, async_scheduling)
    ttft      time to first token of one `ttft_prompt_len`-token prompt at batch 1 (median of
              `ttft_reps`, the client's per-request metrics), per attention implementation
    knee      output tok/s with 1, 2, 4, ..., 256 prompts submitted at once (prompt 128, 128 new
              tokens, wall time including prefill, as bench.gpu's concurrent part)
Each part runs in its own subprocess with its own timeout (bench/gpu/run.py's machinery), records each
number as it gets it, and after each part this process rewrites the JSON with everything so far.
Unless --cold, the parts share one persistent XLA compilation cache in the log folder, so an engine
setting already compiled by an earlier part loads instead of compiling (the run's time goes to
measuring); first-request times are then not cold compiles.

Derived numbers (derive(), recomputed from the raw ones in the JSON):
    bytes per decode token = weight bytes read per token + mean context * KV bytes per token
                             (bench/gpu/report.py's definition; mean context = prompt + (N + 1) / 2)
    MBU                    = bytes per decode token / TPOT / copy bandwidth measured in this run
                             (and / the datasheet's bandwidth where jaxinfer.perf knows the device)
    measured knee          = the smallest concurrency whose output tok/s reaches `knee_fraction`
                             (90%) of the best measured; `censored` when the best is the largest level
    predicted knee         = `jaxinfer plan`'s compute_bound_batch (B* = F / BW times bytes per
                             parameter / 2) for this model, with F and BW this run's matmul TFLOP/s
                             and copy bandwidth (and, beside it, the datasheet's)

This process never imports jax (the parts hold the GPU). Output:
bench/results/<date>-<device>-decode.json (or --out). Keys: benchmark, date, time, command,
smoke, device, driver, versions, workload, settings, parts {<part>: {status, wall_s, timeout_s,
returncode, errors, unavailable, log, results}}, derived {copy_Bps, matmul_flops, batch1, knee,
profile_int8_vs_bf16, plan_batch1}, total_wall_s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import write_json_atomic
from bench.gpu import run as gpu
from bench.gpu import trace as gpu_trace
from bench.gpu.report import _get as _at
from bench.gpu.report import results as part_results
from bench.gpu.run import stop_on_sigterm, the_command, versions, worker_env
from bench.gpu.workload import REAL, SMOKE, Workload

PARTS = ("ceilings", "profile", "profile_nocb", "profile_int8", "batch1", "ttft", "knee")
# the XLA flag that turns GPU command buffers (CUDA graphs) off: each kernel then records its own
# HLO instruction in the trace (in a command buffer a cuBLAS kernel records only the command buffer)
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
# Seconds each part may take on an H200 (450 of the 465 s deadline; the last 15 are the parent's).
# From the 2026-11-26 H200 run of bench.gpu: process + CUDA start + building the 8B model ~10 s, the
# first request of a fresh engine setting ~13 s (pallas) / ~19 s (xla) of compiling, one loaded from
# the run's compilation cache ~3 s; batch 1 takes 3 x 0.75 s per setting; 256 requests ~4 s.
#   ceilings ~8 s    profile ~40 s: two engines (the second loads), 2 traces and their parsing
#   profile_nocb ~30 s: one engine compiled without command buffers, one trace
#   profile_int8 ~35 s: the model quantized at build, one engine compiling the int8 matmuls, one trace
#   batch1  ~110 s: 7 settings, 4 of them compiled   ttft ~45 s: pallas + xla at max_model_len 4096
#   knee     ~80 s: 9 levels, each new batch bucket compiling its decode shapes (~5 s)
# A part also gets the time earlier parts left unused (up to twice its cap).
PART_CAPS_S = {"ceilings": 20, "profile": 65, "profile_nocb": 45, "profile_int8": 45, "batch1": 135, "ttft": 50,
               "knee": 90}


@dataclass(frozen=True)
class DecodeWorkload:
    """Every shape and count of a run: the real run and --smoke differ only here."""
    base: Workload                   # the model, prompts, batch-1 N and reps, engine sizes, ceilings' sizes;
                                     # base.concurrency: the knee's levels
    batch1_settings: tuple[tuple[str, int, bool], ...]   # (attention, max_decode_steps, async_scheduling)
    profile_steps: int               # max_decode_steps of the profiled engines
    profile_calls: int               # replays of one decode call in the `replay` trace
    profile_loop_steps: int          # engine steps in the `loop` trace
    knee_fraction: float             # the measured knee reaches this fraction of the best output tok/s
    ttft_prompt_len: int
    ttft_reps: int
    ttft_attention: tuple[str, ...]

    @property
    def short_model_len(self) -> int:
        """max_model_len of the batch-1 engines (bench.gpu's: the longest sequence, a power of two)."""
        return self.base.max_model_len

    @property
    def profile_model_len(self) -> int:
        """max_model_len of the profiled engines: the batch-1 engines' unless the traced requests
        (prompt, the warm-up decode, the traced steps and lookahead) need more."""
        longest = self.base.prompt_len + self.base.decode_tokens + self.profile_steps * (self.profile_loop_steps + 4)
        return max(self.short_model_len, 1 << (longest - 1).bit_length())

    @property
    def ttft_model_len(self) -> int:
        return 1 << (self.ttft_prompt_len + self.base.block_size).bit_length()


REAL_DECODE = DecodeWorkload(
    base=dataclasses.replace(REAL, concurrency=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
    # the engine's default first, then the other attention, then the multi-step / async sweep
    batch1_settings=(("pallas", 8, True), ("xla", 8, True), ("pallas", 1, True), ("pallas", 1, False),
                     ("pallas", 8, False), ("pallas", 4, True), ("pallas", 16, True)),
    profile_steps=8, profile_calls=5, profile_loop_steps=8, knee_fraction=0.9, ttft_prompt_len=2048, ttft_reps=3,
    ttft_attention=("pallas", "xla"))
SMOKE_DECODE = dataclasses.replace(
    REAL_DECODE, base=dataclasses.replace(SMOKE, concurrency=(1, 2, 4, 8)),
    # both attentions, multi-step and async each on and off (each setting compiles: the smoke's time)
    batch1_settings=(("pallas", 8, True), ("xla", 1, False)),
    profile_calls=2, profile_loop_steps=2, ttft_prompt_len=40, ttft_reps=2)


def setting_key(attention: str, steps: int, async_scheduling: bool) -> str:
    return f"{attention}-k{steps}-{'async' if async_scheduling else 'sync'}"


# =========================================================================== in a part's process
def make_generator(model, dw: DecodeWorkload, attention: str, steps: int, async_scheduling: bool,
                   max_num_seqs: int, max_model_len: int, num_blocks: int | None = None):
    """A Generator of the built model (prefix caching off, warm-up off: the first request compiles)."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.generator import Generator

    b = dw.base
    ecfg = EngineConfig(dtype="bfloat16", attention=attention, max_num_seqs=max_num_seqs, block_size=b.block_size,
                        num_blocks=num_blocks or max_model_len // b.block_size + 2, max_model_len=max_model_len,
                        enable_prefix_caching=False, max_decode_steps=steps, async_scheduling=async_scheduling)
    return Generator(model, None, ecfg, max_num_batched_tokens=b.max_num_batched_tokens, warmup=False)


def engine_facts(gen) -> dict[str, Any]:
    r = gen.client.resolved
    return {"attention": r.attention, "max_decode_steps": r.max_decode_steps, "async_scheduling": r.async_scheduling,
            "max_num_seqs": r.max_num_seqs, "max_num_batched_tokens": r.max_num_batched_tokens,
            "max_model_len": r.max_model_len, "num_blocks": r.num_blocks, "block_size": r.block_size}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, length).tolist() for _ in range(count)]


def greedy(n: int):
    from jaxinfer.config import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_requests(client, prompts: list[list[int]], n: int) -> tuple[float, list]:
    """Submit every prompt at once through the client, step until all finish; (wall seconds, each
    request's RequestMetrics). Every request must produce n tokens."""
    t = time.perf_counter()
    rids = client.submit(prompts, greedy(n))
    client.run_until_done()
    wall = time.perf_counter() - t
    metrics = [m for rid in rids for m in client.release(rid, abort=False)]
    counts = sorted({m.num_output_tokens for m in metrics})
    if counts != [n]:
        raise RuntimeError(f"asked for {n} tokens per request (ignore_eos), got {counts}")
    return wall, metrics


def decoding_step(client, prompt: list[int], max_tokens: int) -> tuple[str, Any, int]:
    """Submit one prompt on a synchronous engine and step until a step decoded it alone; (request
    id, the next step's device inputs, its decode iterations), the step not run."""
    [rid] = client.submit([prompt], greedy(max_tokens))
    decoding: list[bool] = []
    observe = lambda t: decoding.append(bool(t.spans) and all(n == 1 for _, n in t.spans))  # noqa: E731
    client.add_step_observer(observe)
    try:
        while not (decoding and decoding[-1]):
            client.step()
    finally:
        client.remove_step_observer(observe)
    inputs, iterations = client.debug.next_step_inputs()
    return rid, inputs, iterations


def traced(trace_dir: Path, fn) -> tuple[dict[str, Any], str]:
    """Run fn() under jax.profiler.trace; (its Chrome-trace events, the file they were read from).
    Reads the *.trace.json.gz the profiler writes, else its *.xplane.pb through jax.profiler.ProfileData."""
    import jax

    trace_dir.mkdir(parents=True, exist_ok=True)
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0       # no Python call events: a smaller trace, less overhead
    except (AttributeError, TypeError):       # a jax without these options traces with its defaults
        options = None
    with jax.profiler.trace(str(trace_dir), profiler_options=options):
        fn()
    path = gpu_trace.find_trace(trace_dir)
    if path is not None:
        return gpu_trace.read_trace(path), str(path)
    xplanes = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not xplanes:
        raise RuntimeError(f"jax.profiler wrote neither *.trace.json.gz nor *.xplane.pb under {trace_dir}")
    return gpu_trace.xspace_to_trace(jax.profiler.ProfileData.from_file(str(xplanes[-1]))), str(xplanes[-1])


def on_device(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary, with an error where an accelerator's trace has no device kernels (CUPTI recorded
    nothing: its numbers would be the host's launches, not the GPU's work)."""
    import jax

    if jax.default_backend() != "cpu" and not summary["kernel_events"].startswith("device"):
        summary["error"] = (f"no device kernel events in the {jax.default_backend()} trace (read: "
                            f"{summary['kernel_events']}); the profiler's device tracer (CUPTI) recorded nothing")
    return summary


def profile_replay(gen, dw: DecodeWorkload, prompt: list[int], trace_dir: Path) -> tuple[dict[str, Any], str]:
    """Trace `profile_calls` replays of one multi-step decode call; (the summary with the untraced
    calls' times, the step's compiled HLO text)."""
    import numpy as np

    client = gen.client
    rid, inputs, iterations = decoding_step(client, prompt, dw.base.decode_tokens + 4 * dw.profile_steps)
    [metrics] = client.metrics(rid)
    hlo = client.debug.step_hlo(inputs)
    untraced = []
    for _ in range(dw.profile_calls + 1):
        t = time.perf_counter()
        client.debug.replay_step(inputs)
        untraced.append(time.perf_counter() - t)

    def calls():
        import jax
        for i in range(dw.profile_calls):
            with jax.profiler.TraceAnnotation(f"decode_call_{i}"):
                client.debug.replay_step(inputs)
    trace, source = traced(trace_dir, calls)
    client.release(rid)
    summary = gpu_trace.summarize(trace, "decode_call", iterations, hlo)
    return on_device({"decode_iterations_per_call": iterations, "untraced_call_s": untraced[1:],
                      "untraced_call_median_s": float(np.median(untraced[1:])), "trace": source,
                      "context_tokens": metrics.num_prompt_tokens + metrics.num_output_tokens, **summary}), hlo


def profile_loop(gen, dw: DecodeWorkload, prompt: list[int], hlo: str | None, trace_dir: Path) -> dict[str, Any]:
    """Trace the engine's own loop (client.step, async scheduling) over profile_loop_steps decode steps."""
    client = gen.client
    k = dw.profile_steps
    [rid] = client.submit([prompt], greedy(k * (dw.profile_loop_steps + 4)))
    applied: list[tuple | None] = []

    def observe(t) -> None:                       # a decode step's iterations, else None
        applied.append(t.iterations if t.spans and all(n == 1 for _, n in t.spans) else None)
    client.add_step_observer(observe)
    try:
        while not (applied and applied[-1]):       # until a step applied a decode of the request
            client.step()
        before = len(applied)

        def loop():
            import jax
            with jax.profiler.TraceAnnotation("decode_loop"):
                for _ in range(dw.profile_loop_steps):
                    client.step()
        trace, source = traced(trace_dir, loop)
    finally:
        client.remove_step_observer(observe)
    client.release(rid)
    tokens = sum(sum(its) for its in applied[before:] if its)
    return on_device({"engine_steps": dw.profile_loop_steps, "tokens": tokens, "trace": source,
                      "tokens_note": "decode tokens the traced engine steps applied (async scheduling: each "
                                     "step call applies the previous call's device work)",
                      **gpu_trace.summarize(trace, "decode_loop", tokens, hlo)})


def profile_part(dw: DecodeWorkload, rec, trace_dir: Path, loop_trace: bool = True, weights: str = "bf16") -> None:
    """The `replay` trace (and, with loop_trace, the `loop` trace) of batch-1 decode; weights: bf16 or a
    weight-only quantization of bench.gpu.parts.build_model."""
    from bench.common import release
    from bench.gpu.parts import build_model, model_bytes

    model = build_model(dw.base, weights)
    rec.put(("build",), {"weights": weights, **model_bytes(model)})
    prompt = random_prompts(1, dw.base.prompt_len, model.cfg.vocab_size, seed=1)[0]
    k = dw.profile_steps
    sync = make_generator(model, dw, "pallas", k, False, dw.base.max_num_seqs, dw.profile_model_len)
    rec.put(("engine",), {"replay": engine_facts(sync)})
    run_requests(sync.client, [prompt], dw.base.decode_tokens)          # compiles prefill and decode
    out = rec.guarded(("replay",), lambda: profile_replay(sync, dw, prompt, trace_dir / "replay"), record=False)
    release(sync)
    hlo = None                      # without the replay's HLO the loop's kernels are classified by name
    if out is not None:
        summary, hlo = out
        rec.put(("replay",), summary)
    if not loop_trace:
        return
    loop = make_generator(model, dw, "pallas", k, True, dw.base.max_num_seqs, dw.profile_model_len)
    rec.put(("engine",), {"loop": engine_facts(loop)})
    run_requests(loop.client, [prompt], dw.base.decode_tokens)
    # the same program as the replayed one (async scheduling is the host's), so its HLO names the kernels
    rec.guarded(("loop",), lambda: profile_loop(loop, dw, prompt, hlo, trace_dir / "loop"))
    release(loop)


def batch1_setting(model, dw: DecodeWorkload, attention: str, steps: int, async_scheduling: bool) -> dict[str, Any]:
    from bench.common import release
    from bench.gpu.parts import batch1

    gen = make_generator(model, dw, attention, steps, async_scheduling, dw.base.max_num_seqs, dw.short_model_len)
    try:
        return {"engine": engine_facts(gen), **batch1(gen, dw.base, model.cfg.vocab_size)}
    finally:
        release(gen)


def batch1_part(dw: DecodeWorkload, rec) -> None:
    from bench.gpu.parts import build_model, model_bytes

    t0 = time.perf_counter()
    model = build_model(dw.base, "bf16")
    rec.put(("build",), {"build_s": time.perf_counter() - t0, **model_bytes(model)})
    for attention, steps, async_scheduling in dw.batch1_settings:
        rec.guarded(("settings", setting_key(attention, steps, async_scheduling)),
                    lambda a=attention, k=steps, s=async_scheduling: batch1_setting(model, dw, a, k, s))


def ttft_one(model, dw: DecodeWorkload, attention: str) -> dict[str, Any]:
    """TTFT of one long prompt at batch 1: the client's per-request metrics (first token - arrival),
    after a first request that compiles; the wall time of each one-token request beside it."""
    import numpy as np

    from bench.common import release

    k = dw.profile_steps
    gen = make_generator(model, dw, attention, k, True, dw.base.max_num_seqs, dw.ttft_model_len)
    try:
        prompt = random_prompts(1, dw.ttft_prompt_len, model.cfg.vocab_size, seed=7)[0]
        first_s, _ = run_requests(gen.client, [prompt], 1)
        walls, ttfts = [], []
        for _ in range(dw.ttft_reps):
            wall, [m] = run_requests(gen.client, [prompt], 1)
            walls.append(wall)
            ttfts.append(m.ttft)
        return {"engine": engine_facts(gen), "prompt_len": dw.ttft_prompt_len, "ttft_s": ttfts,
                "ttft_median_s": float(np.median(ttfts)), "wall_s": walls, "first_request_s": first_s,
                "prefill_steps": math.ceil(dw.ttft_prompt_len / gen.client.resolved.max_num_batched_tokens)}
    finally:
        release(gen)


def ttft_part(dw: DecodeWorkload, rec) -> None:
    from bench.gpu.parts import build_model

    model = build_model(dw.base, "bf16")
    for attention in dw.ttft_attention:
        rec.guarded((attention,), lambda a=attention: ttft_one(model, dw, a))


def knee_level(gen, dw: DecodeWorkload, requests: int) -> dict[str, Any]:
    """`requests` prompts at once: a short run compiles this batch's shapes, then the timed run;
    output tok/s = new tokens / wall (prefill included), and each request's TPOT."""
    import numpy as np

    b = dw.base
    prompts = random_prompts(requests, b.prompt_len, gen.model_cfg.vocab_size, seed=100 + requests)
    warm_s, _ = run_requests(gen.client, prompts, b.warm_tokens)
    before = gen.stats()
    wall, metrics = run_requests(gen.client, prompts, b.new_tokens)
    after = gen.stats()
    tpot = float(np.median([m.tpot for m in metrics]))
    total = sum(m.num_output_tokens for m in metrics)
    return {"requests": requests, "prompt_len": b.prompt_len, "new_tokens": b.new_tokens, "total_new_tokens": total,
            "wall_s": wall, "output_tok_s": total / wall, "median_tpot_s": tpot, "decode_tok_s": requests / tpot,
            "median_ttft_s": float(np.median([m.ttft for m in metrics])), "warm_s": warm_s,
            "num_steps": after["num_steps"] - before["num_steps"],
            "num_preemptions": after["num_preemptions"] - before["num_preemptions"]}


def knee_part(dw: DecodeWorkload, rec) -> None:
    from bench.common import release
    from bench.gpu.parts import build_model

    b = dw.base
    model = build_model(b, "bf16")
    gen = make_generator(model, dw, "pallas", dw.profile_steps, True, b.max_num_seqs, b.max_model_len, b.num_blocks)
    rec.put(("engine",), engine_facts(gen))
    for c in b.concurrency:
        rec.guarded(("concurrency", str(c)), lambda c=c: knee_level(gen, dw, c))
    release(gen)


def run_part(part: str, dw: DecodeWorkload, records: str | Path) -> None:
    """The entry point of a part's subprocess."""
    from bench.gpu.parts import ceilings_part, device_info
    from bench.gpu.records import Recorder

    rec = Recorder(records)
    rec.put(("device",), device_info())
    if part == "ceilings":
        ceilings_part(dw.base, rec)
    elif part == "profile":
        profile_part(dw, rec, Path(records).parent / "traces")
    elif part == "profile_nocb":            # run_worker set XLA_FLAGS: no command buffers
        profile_part(dw, rec, Path(records).parent / "traces-nocb", loop_trace=False)
    elif part == "profile_int8":
        profile_part(dw, rec, Path(records).parent / "traces-int8", loop_trace=False, weights="int8")
    elif part == "batch1":
        batch1_part(dw, rec)
    elif part == "ttft":
        ttft_part(dw, rec)
    else:
        knee_part(dw, rec)


# =========================================================================== the parent process
def run_worker(part: str, timeout: float, smoke: bool, cold: bool, run_dir: Path) -> dict[str, Any]:
    """One part in its own process group, killed at its timeout (bench.gpu's run_worker, with this
    run's shared compilation cache unless cold, and command buffers off for profile_nocb)."""
    env = worker_env(smoke, False, run_dir, part)
    if not cold:       # one cache for the run's parts: a setting compiled once loads in later parts
        env["JAXINFER_COMPILATION_CACHE"] = str(run_dir / "xla-cache")
    if part == "profile_nocb":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
    return gpu.run_worker(part, timeout, smoke, False, run_dir, module="bench.gpu.decode", env=env)


def part_timeouts(parts: list[str], deadline_s: float) -> dict[str, float]:
    return gpu.part_timeouts(parts, deadline_s, PART_CAPS_S)


def parse_parts(text: str | None) -> list[str]:
    return gpu.parse_parts(text, PARTS)


def new_report(args: argparse.Namespace, dw: DecodeWorkload, parts: list[str], caps: dict[str, float],
               driver: dict[str, Any], device: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    return {
        "benchmark": "gpu_decode", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
        "command": the_command(), "smoke": bool(args.smoke), "device": device, "driver": driver,
        "versions": versions(),
        "workload": dataclasses.asdict(dw) | {"short_model_len": dw.short_model_len,
                                              "ttft_model_len": dw.ttft_model_len,
                                              "profile_model_len": dw.profile_model_len,
                                              "knee_num_blocks": dw.base.num_blocks},
        "settings": {"parts": parts, "deadline_s": args.deadline_s, "caps_s": caps,
                     "compilation_cache": ("off in every part (--cold): first requests compile" if args.cold else
                                           "one persistent cache for the run's parts, in the log folder: an engine "
                                           "setting compiled by an earlier part loads (first requests are not cold)"),
                     "pallas_autotune": "off (JAXINFER_AUTOTUNE=0)",
                     "engine": "bf16 weights (profile_int8: int8 weight-only), prefix caching off, greedy, ignore_eos, "
                               "random prompt ids; batch-1 "
                               "engines max_model_len short_model_len, the knee's max_num_seqs and knee_num_blocks",
                     "log_dir": str(log_dir)},
        "parts": {}, "derived": {},
    }


def refresh(report: dict[str, Any], out: Path) -> None:
    """Take the device from a part, recompute the derived numbers, rewrite the JSON atomically."""
    gpu.take_device(report, PARTS)
    report["derived"] = derive(report)
    write_json_atomic(report, out)


def run(args: argparse.Namespace) -> Path:
    """Every selected part in order, the JSON rewritten after each; -> the JSON's path."""
    dw = SMOKE_DECODE if args.smoke else REAL_DECODE
    parts = parse_parts(args.parts)
    t_start, driver, device, out, log_dir = gpu.open_run(args, "decode")
    caps = part_timeouts(parts, args.deadline_s)
    report = new_report(args, dw, parts, caps, driver, device, log_dir)
    stop_on_sigterm()
    print(f"bench.gpu.decode: parts {', '.join(parts)}; deadline {args.deadline_s:.0f} s; JSON {out}; "
          f"logs {log_dir}", flush=True)
    gpu.run_parts(report, parts, caps, args.deadline_s, t_start,
                  lambda part, timeout: run_worker(part, timeout, args.smoke, args.cold, log_dir),
                  lambda report: refresh(report, out))
    return out


# --------------------------------------------------------------------------- derived numbers
def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if _number(a) and _number(b) else None



def batch1_mbu(report: dict, copy_bps: float | None, sheet_bps: float | None) -> dict[str, dict]:
    """Per engine setting: bytes per decode token, bytes/s, MBU vs the measured copy and the datasheet."""
    r = part_results(report, "batch1")
    build = _at(r, "build")
    out = {}
    for key in (r.get("settings") or {}):
        s = _at(r, "settings", key)
        if not build or not s or not _number(s.get("tpot_s")):
            continue
        per_token = build["weight_bytes_read_per_token"] + s["mean_context_tokens"] * build["kv_bytes_per_token"]
        bps = per_token / s["tpot_s"]
        out[key] = {"decode_tok_s": s["decode_tok_s"], "tpot_s": s["tpot_s"], "bytes_per_token": per_token,
                    "bytes_per_s": bps, "mbu_vs_copy": _ratio(bps, copy_bps),
                    "mbu_vs_datasheet": _ratio(bps, sheet_bps)}
    return out


def plan_roofline(report: dict, bandwidth: float | None, flops: float | None, context: int) -> dict | None:
    """`jaxinfer plan`'s B*, compute-bound batch and batch-1 decode tok/s for this run's model (bf16)
    on a device of this bandwidth and bf16 FLOP/s."""
    from jaxinfer import perf, plan
    from jaxinfer.models.hf_configs import model_config_from_hf

    if not (_number(bandwidth) and _number(flops)):
        return None
    cfg = model_config_from_hf(dict(report["workload"]["base"]["model"]))
    memory = (report.get("device") or {}).get("memory_bytes") or 64 * perf.GiB     # capacity is not read here
    device = perf.Device("measured", "this run's ceilings", int(memory), bandwidth, flops, flops, 0.0,
                         assumed=("bandwidth and bf16 FLOP/s as given",))
    p = plan.plan(cfg, device, dtype="bfloat16", context=context)
    return {"bandwidth_Bps": bandwidth, "flops": flops, "context": context, "b_star": p.b_star,
            "compute_bound_batch": p.compute_bound_batch, "decode_tokens_per_s_bs1": p.decode_tokens_per_s_bs1}


def knee_of(rates: dict[int, float], fraction: float) -> dict[str, Any]:
    """The smallest level reaching `fraction` of the best rate; censored when the best is the last level."""
    best = max(rates, key=rates.get)
    knee = min(c for c in rates if rates[c] >= fraction * rates[best])
    return {"best_level": best, "best_rate": rates[best], "knee": knee, "censored": best == max(rates)}


def knee_summary(report: dict, copy_bps: float | None, flops: float | None, sheet) -> dict | None:
    w = report["workload"]
    levels = part_results(report, "knee").get("concurrency") or {}
    ok = {int(c): v for c, v in levels.items() if _number((v or {}).get("output_tok_s"))}
    if not ok:
        return None
    fraction = w["knee_fraction"]
    context = w["base"]["prompt_len"] + w["base"]["new_tokens"]
    measured = plan_roofline(report, copy_bps, flops, context)
    datasheet = plan_roofline(report, sheet.bandwidth, sheet.flops_bf16, context) if sheet else None
    out = {"fraction": fraction, "levels": sorted(ok),
           "output_tok_s": {str(c): ok[c]["output_tok_s"] for c in sorted(ok)},
           "output": knee_of({c: v["output_tok_s"] for c, v in ok.items()}, fraction),
           "decode": knee_of({c: v["decode_tok_s"] for c, v in ok.items()}, fraction),
           "plan_measured_ceilings": measured, "plan_datasheet": datasheet}
    predicted = measured["compute_bound_batch"] if measured else None
    out["measured_knee_over_predicted"] = _ratio(out["output"]["knee"], predicted)
    return out


def derive(report: dict) -> dict:
    """Everything computed from the raw measurements (recomputed after each part)."""
    from jaxinfer import perf

    ceil = part_results(report, "ceilings")
    gbps, tflops = _at(ceil, "copy", "GBps"), _at(ceil, "matmul", "TFLOPs")
    copy_bps = gbps * 1e9 if _number(gbps) else None
    flops = tflops * 1e12 if _number(tflops) else None
    sheet = perf.device_for_kind((report.get("device") or {}).get("kind") or "")
    batch1 = batch1_mbu(report, copy_bps, sheet.bandwidth if sheet else None)
    b = report["workload"]["base"]
    context = round(b["prompt_len"] + (b["decode_tokens"] + 1) / 2)
    plan_b1 = plan_roofline(report, copy_bps, flops, context)
    default = setting_key(*report["workload"]["batch1_settings"][0])
    return {"copy_Bps": copy_bps, "matmul_flops": flops,
            "datasheet": None if sheet is None else {"name": sheet.label, "bandwidth_Bps": sheet.bandwidth,
                                                     "bf16_flops": sheet.flops_bf16},
            "batch1": batch1, "knee": knee_summary(report, copy_bps, flops, sheet),
            "profile_int8_vs_bf16": int8_vs_bf16(report),
            "plan_batch1": None if plan_b1 is None else {
                **plan_b1, "setting": default, "measured_tok_s": (batch1.get(default) or {}).get("decode_tok_s"),
                "measured_over_predicted": _ratio((batch1.get(default) or {}).get("decode_tok_s"),
                                                  plan_b1["decode_tokens_per_s_bs1"])}}


PER_TOKEN = ("wall_us", "busy_us", "gaps_us")     # of a replay summary, per decode token in int8_vs_bf16


def int8_vs_bf16(report: dict) -> dict | None:
    """Device time per decode token of the bf16 and int8 `replay` traces, per category and for the
    window's wall, busy and gap times, with int8's excess: where int8 decode's extra time goes."""
    a = _at(part_results(report, "profile"), "replay")
    b = _at(part_results(report, "profile_int8"), "replay")
    if not a or not b:
        return None
    rows = {k: (a[k], b[k]) for k in PER_TOKEN}
    rows |= {c: (a["categories"][c]["us_per_window"], b["categories"][c]["us_per_window"])
             for c in gpu_trace.CATEGORIES}
    out = {}
    for key, (x, y) in rows.items():
        x, y = x / a["tokens_per_window"], y / b["tokens_per_window"]
        out[key] = {"bf16_us_per_token": x, "int8_us_per_token": y, "int8_minus_bf16_us": y - x}
    return out


# --------------------------------------------------------------------------- the printed summary
def _fmt(v: Any, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    return f"{v * scale:,.{digits}f}{suffix}" if _number(v) or v == 0 else "-"


def profile_lines(report: dict) -> list[str]:
    lines = []
    for part, name in (("profile", "replay"), ("profile", "loop"), ("profile_nocb", "replay"),
                       ("profile_int8", "replay")):
        s = _at(part_results(report, part), name)
        if not s:
            continue
        cats = ", ".join(f"{c} {_fmt(v['share'], 0, 100, '%')}" for c, v in s["categories"].items())
        lines.append(f"{part} {name} ({s['num_windows']} x {s['tokens_per_window']} tokens): wall "
                     f"{_fmt(s['wall_us'], 0)} us, device busy {_fmt(s['busy_us'], 0)} us "
                     f"({_fmt(s['busy_fraction'], 0, 100, '%')}), gaps {_fmt(s['gaps_us'], 0)} us, lead "
                     f"{_fmt(s['lead_us'], 0)} us, tail {_fmt(s['tail_us'], 0)} us; {_fmt(s['kernels_per_token'], 0)} "
                     f"kernels/token; {cats}; instruction known for {_fmt(s['hlo_mapped_share'], 0, 100, '%')}")
    d = report["derived"].get("profile_int8_vs_bf16")
    if d:
        lines.append("int8 - bf16 per decode token: " + ", ".join(
            f"{k} {v['int8_minus_bf16_us']:+,.1f} us" for k, v in d.items()))
    s = _at(part_results(report, "profile"), "replay")
    if s:
        lines += ["", "| kernel (copies merged) | us per call | share | category |", "|---|---|---|---|"]
        lines += [f"| {k['name'][:70]} | {_fmt(k['us_per_window'])} | {_fmt(k['share'], 1, 100, '%')} | "
                  f"{k['category']} |" for k in s["kernel_groups"][:12]]
    return lines


def batch1_lines(report: dict) -> list[str]:
    d = report["derived"]
    lines = ["| batch 1: setting | decode tok/s | TPOT ms | MBU (copy) | MBU (datasheet) |", "|---|---|---|---|---|"]
    for key, u in (d.get("batch1") or {}).items():
        lines.append(f"| {key} | {_fmt(u['decode_tok_s'])} | {_fmt(u['tpot_s'], 2, 1e3)} | "
                     f"{_fmt(u['mbu_vs_copy'], 0, 100, '%')} | {_fmt(u['mbu_vs_datasheet'], 0, 100, '%')} |")
    p = d.get("plan_batch1")
    if p:
        lines.append(f"plan at the measured copy bandwidth, context {p['context']}: "
                     f"{_fmt(p['decode_tokens_per_s_bs1'])} tok/s; measured {p['setting']} "
                     f"{_fmt(p['measured_tok_s'])} ({_fmt(p['measured_over_predicted'], 0, 100, '%')})")
    for attention, t in part_results(report, "ttft").items():
        if isinstance(t, dict) and _number(t.get("ttft_median_s")):
            lines.append(f"TTFT, {t['prompt_len']}-token prompt, {attention}: {_fmt(t['ttft_median_s'], 1, 1e3)} ms "
                         f"({t['prefill_steps']} prefill steps)")
    return lines


def knee_lines(report: dict) -> list[str]:
    k = report["derived"].get("knee")
    if not k:
        return []
    levels = part_results(report, "knee")["concurrency"]
    lines = ["| requests | output tok/s | decode tok/s (c / TPOT) | median TPOT ms |", "|---|---|---|---|"]
    lines += [f"| {c} | {_fmt(levels[str(c)]['output_tok_s'], 0)} | {_fmt(levels[str(c)]['decode_tok_s'], 0)} | "
              f"{_fmt(levels[str(c)]['median_tpot_s'], 2, 1e3)} |" for c in k["levels"]]
    o, pm, pd = k["output"], k["plan_measured_ceilings"], k["plan_datasheet"]
    censored = ", the largest level: censored" if o["censored"] else ""
    lines.append(f"knee (smallest level with {k['fraction']:.0%} of the best output tok/s, "
                 f"{_fmt(o['best_rate'], 0)} at {o['best_level']}{censored}):"
                 f" measured {o['knee']}, decode-only {k['decode']['knee']}; plan's compute-bound batch "
                 f"{_fmt(pm and pm['compute_bound_batch'], 0)} (measured ceilings), "
                 f"{_fmt(pd and pd['compute_bound_batch'], 0)} (datasheet)")
    return lines


def summary_text(report: dict) -> str:
    d, dev = report["derived"], report.get("device") or {}
    head = (f"bench.gpu.decode: {dev.get('kind', '?')} ({report.get('date')}): copy "
            f"{_fmt(d.get('copy_Bps'), 0, 1e-9)} GB/s, bf16 matmul {_fmt(d.get('matmul_flops'), 1, 1e-12)} TFLOP/s")
    return "\n".join([head, "", *profile_lines(report), "", *batch1_lines(report), "", *knee_lines(report)]) + "\n"


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    p.add_argument("--deadline-s", type=float, default=465.0, help="the whole run's time budget (default 465)")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-<device>-decode.json)")
    p.add_argument("--smoke", action="store_true", help="every part on CPU with a tiny model (a code-path check)")
    p.add_argument("--log-dir", default=None, help="each part's log, records and traces (default: a new temp folder)")
    p.add_argument("--cold", action="store_true", help="no compilation cache shared between the parts")
    p.add_argument("--worker", default=None, choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--records", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_part(args.worker, SMOKE_DECODE if args.smoke else REAL_DECODE, args.records)
        return 0
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"bench.gpu.decode: error: {e}", file=sys.stderr)
        return 2
    report = json.loads(out.read_text())
    print(summary_text(report), end="")
    print(f"wrote {out}", flush=True)
    failed = [part for part, e in report["parts"].items() if e["errors"]]
    if failed:
        print(f"bench.gpu.decode: errors in {', '.join(failed)} (see each part's errors in the JSON)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
