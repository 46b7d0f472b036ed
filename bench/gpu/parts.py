"""What each part of `python -m bench.gpu` measures, inside its own subprocess (bench/gpu/run.py starts
one per part, with its own timeout, and merges what they record).

    ceilings         device-to-device copy GB/s and bf16 matmul TFLOP/s, measured on the spot
    bf16 int8 int4 fp8   the Llama-3-8B-shaped random model through Generator, with these weights
    kernels          prefill flash attention vs cuDNN / XLA; weight-only matmuls vs XLA and bf16
    hf               HF transformers on the same shapes (when torch is importable)

A part records each number as soon as it has it (Recorder: one flushed JSON line per key), so a
part killed at its timeout keeps what it measured; a measurement that fails records its error at
its key and the part goes on with the next one.

Timing kernels: one jitted call costs ~100 us of launch and sync on an H100/H200 (the 2026-11-26
probe), as long as a small matmul. So a timed call runs a chain of n kernels, each fed the previous
output (nothing for XLA to hoist or merge), matmuls over n distinct weights (together larger than
L2, so each is read from HBM), and the launch overhead of an empty call is subtracted
(report.net_seconds). Raw times, chain lengths and overheads are recorded beside the results.

Never imports serve (the GPU image has no fastapi / uvicorn / llguidance).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.gpu.records import Recorder
from bench.gpu.report import mean_context_tokens, net_seconds

if TYPE_CHECKING:
    from bench.gpu.workload import Workload


# --------------------------------------------------------------------------- timing helpers
def median_seconds(fn: Callable, args: tuple, reps: int) -> tuple[float, float]:
    """(median seconds of a call after the first, seconds of the first call: compile + one run)."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), first


def launch_overhead(reps: int) -> float:
    """Median seconds of an empty jitted call (dispatch + one tiny kernel + sync)."""
    x = jnp.zeros((8,), jnp.float32)
    return median_seconds(jax.jit(lambda x: x + 1), (x,), 5 * reps)[0]


def timed_chain(chain: Callable, args: tuple, calls: int, overhead: float, reps: int) -> dict[str, float]:
    total, first = median_seconds(chain, args, reps)
    return {"calls": calls, "total_s": total, "overhead_s": overhead, "compile_s": max(first - total, 0.0),
            "per_call_s": net_seconds(total, overhead, calls)}


def chain_of(op: Callable, feed: Callable, calls: int | None = None) -> Callable:
    """jit of x -> (x after the chain, the first call's output): y = op(x, w) for each w in ws (or
    `calls` times with one w), x = feed(x, y) between calls. op is jitted once and inlined `calls`
    times (XLA compiles one kernel for identical calls); the first output is the agreement check's."""
    inner = jax.jit(op)

    def chain(x, ws, *rest):
        first = None
        for w in (ws if calls is None else [ws] * calls):
            y = inner(x, w, *rest)
            first = y if first is None else first
            x = feed(x, y)
        return x, first
    return jax.jit(chain)


def rel_err(a: jax.Array, b: jax.Array) -> float:
    """||a - b|| / ||b|| in float32, on the device (outputs of 32k-token attention are 256 MB)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def device_info() -> dict[str, Any]:
    d = jax.devices()[0]
    info = {"kind": str(d.device_kind), "platform": d.platform, "count": jax.device_count()}
    try:
        stats = d.memory_stats() or {}
        info["memory_bytes"] = stats.get("bytes_limit")
    except Exception:  # noqa: BLE001 -- not every backend has memory stats
        pass
    return info


def _random(key: int, shape: tuple[int, ...], dtype=jnp.bfloat16, scale: float = 1.0) -> jax.Array:
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


# --------------------------------------------------------------------------- ceilings
# Three ways to move a buffer through the device's memory: XLA's copy (a device memcpy where it can)
# and two elementwise kernels; the fastest one is the measured copy bandwidth.
COPY_METHODS: dict[str, tuple[Any, Callable]] = {
    "copy": (jnp.bfloat16, lambda x: jnp.copy(x)),
    "scale_bf16": (jnp.bfloat16, lambda x: x * 2),
    "add_f32": (jnp.float32, lambda x: x + 1),
}


def copy_method(name: str, nbytes: int, overhead: float, reps: int) -> dict[str, Any]:
    dtype, fn = COPY_METHODS[name]
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    f = jax.jit(fn)
    y = f(x)
    if y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
        return {"unavailable": f"{name} returned its input buffer (nothing was copied); the other methods count"}
    del y
    r = timed_chain(f, (x,), 1, overhead, reps)
    return r | {"GBps": 2 * x.nbytes / r["per_call_s"] / 1e9}


def matmul_ceiling(n: int, calls: int, overhead: float, reps: int) -> dict[str, Any]:
    """bf16 [n, n] @ [n, n], a chain of `calls` (a <- a @ b), each 2 n^3 FLOPs."""
    a, b = _random(1, (n, n)), _random(2, (n, n), scale=n ** -0.5)

    def chain(a, b):
        for _ in range(calls):
            a = a @ b
        return a
    r = timed_chain(jax.jit(chain), (a, b), calls, overhead, reps)
    return r | {"n": n, "flops": 2 * n ** 3, "TFLOPs": 2 * n ** 3 / r["per_call_s"] / 1e12}


def copy_ceiling(nbytes: int, overhead: float, reps: int, rec: Recorder) -> None:
    """Every copy method over a buffer of nbytes, each recorded at ("copy", "methods", name), and the
    best at ("copy", "GBps") (with its name and the bytes it moved): the bandwidth bar of a run."""
    methods = {name: rec.guarded(("copy", "methods", name), lambda name=name: copy_method(
        name, nbytes, overhead, reps)) for name in COPY_METHODS}
    ok = {k: v for k, v in methods.items() if v and "GBps" in v}
    if ok:
        best = max(ok, key=lambda k: ok[k]["GBps"])
        rec.put(("copy", "best"), best)
        rec.put(("copy", "GBps"), ok[best]["GBps"])
        rec.put(("copy", "bytes_moved"), 2 * nbytes)
    else:
        rec.put(("copy", "GBps"), {"error": "every copy method failed"})


def ceilings_part(wl: "Workload", rec: Recorder) -> None:
    overhead = launch_overhead(wl.reps)
    rec.put(("launch_overhead_s",), overhead)
    copy_ceiling(wl.copy_bytes, overhead, wl.reps, rec)
    rec.guarded(("matmul",), lambda: matmul_ceiling(wl.square, wl.square_calls, overhead, wl.reps))


# --------------------------------------------------------------------------- engine variants
def random_decoder(hf_config: dict, variant: str = "bf16"):
    """A random bfloat16 Decoder of an HF config (seed 0), fused for one device, quantized unless bf16:
    the 8B shape without a checkpoint on disk (this file's engine parts, bench/multiturn.py --shape)."""
    from flax import nnx

    from jaxinfer.models.hf_configs import model_config_from_hf
    from jaxinfer.models.decoder import Decoder, FusedLayout, quantize_decoder

    cfg = model_config_from_hf(dict(hf_config))
    model = Decoder(cfg, jnp.bfloat16, rngs=nnx.Rngs(0), fused=FusedLayout.for_tp(cfg, 1))
    if variant != "bf16":
        quantize_decoder(model, variant)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.Param)))
    return model


def build_model(wl: "Workload", variant: str):
    """The random Decoder of wl.model (random_decoder)."""
    return random_decoder(wl.model, variant)


def model_bytes(model) -> dict[str, int]:
    """Parameter bytes (quantized weights: codes + scales), the embedding table's, and what a batch-1
    decode token reads (jaxinfer.perf's cost model, as the engine's live MBU and `jaxinfer plan` count)."""
    from jaxinfer import perf
    from jaxinfer.models.decoder import weight_bytes

    weights = weight_bytes(model)
    assert model.lm_head is not None, "the 8B shape has an untied LM head (read in full by every step)"
    cfg = model.cfg
    kv = perf.kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, "bfloat16", cfg.kv_value_dim)
    return {"param_bytes": weights.total, "embed_bytes": weights.tables, "embed_row_bytes": weights.row,
            "weight_bytes_read_per_token": perf.ModelCost.build(cfg, weights, kv).iteration_weight_bytes(1),
            "kv_bytes_per_token": kv}


def _sampling(n: int):
    from jaxinfer.config import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _generate(gen, prompts: list[list[int]], n: int) -> tuple[float, int]:
    """(wall seconds, new tokens) of one generate call; every request must produce n tokens."""
    t = time.perf_counter()
    outs = gen.generate(prompts, _sampling(n))
    wall = time.perf_counter() - t
    counts = [len(o.token_ids) for o in outs]
    if counts != [n] * len(prompts):
        raise RuntimeError(f"asked for {n} tokens per request (ignore_eos), got {sorted(set(counts))}")
    return wall, sum(counts)


def batch1(gen, wl: "Workload", vocab: int) -> dict[str, Any]:
    """Decode tok/s = N / (t(N+1 tokens) - t(1 token)), medians; the first request (cold) compiles."""
    prompt = np.random.default_rng(1).integers(10, vocab - 10, wl.prompt_len).tolist()
    n = wl.decode_tokens
    first, _ = _generate(gen, [prompt], n + 1)
    t1s, tns = [], []
    for _ in range(wl.batch1_reps):
        t1s.append(_generate(gen, [prompt], 1)[0])
        tns.append(_generate(gen, [prompt], n + 1)[0])
    t1, tn = float(np.median(t1s)), float(np.median(tns))
    tok_s = n / (tn - t1)
    return {"prompt_len": wl.prompt_len, "decode_tokens": n, "t1_s": t1s, "tN_s": tns, "t1_median_s": t1,
            "tN_median_s": tn, "decode_tok_s": tok_s, "tpot_s": 1 / tok_s,
            "mean_context_tokens": mean_context_tokens(wl.prompt_len, n),
            "first_request_s": first, "cold_compile_s": first - tn,
            "cold_compile": "first_request_s: the first request of this fresh process (prompt_len prompt, N + 1 "
                            "new tokens): tracing + XLA compilation of its prefill and decode steps, Pallas "
                            "autotuning if on, and the run; cold_compile_s = first_request_s - tN_median_s "
                            "(persistent compilation cache off)"}


def concurrent(gen, wl: "Workload", requests: int, vocab: int) -> dict[str, Any]:
    """`requests` prompts submitted at once; output tok/s = new tokens / wall (prefill included)."""
    from jaxinfer.runner import CompileCounter

    rng = np.random.default_rng(100 + requests)
    prompts = [rng.integers(10, vocab - 10, wl.prompt_len).tolist() for _ in range(requests)]
    CompileCounter.install()
    warm_s, _ = _generate(gen, prompts, wl.warm_tokens)          # compiles this batch's shapes ...
    # ... but its requests end soon after their prefill, before all of them decode together: one-token
    # prompts decoding warm_tokens compile the steps of `requests` decode rows (left for the timed run
    # before: the CPU smoke's 64-request level compiled its 64-row step there)
    warm_s += _generate(gen, [p[:1] for p in prompts], wl.warm_tokens)[0]
    before, compiles = gen.stats(), CompileCounter.count
    wall, total = _generate(gen, prompts, wl.new_tokens)
    after = gen.stats()
    return {"requests": requests, "prompt_len": wl.prompt_len, "new_tokens": wl.new_tokens,
            "total_new_tokens": total, "wall_s": wall, "output_tok_s": total / wall, "warm_s": warm_s,
            "warm_tokens": wl.warm_tokens, "wall_includes": "prefill of every prompt and all decode steps",
            "num_steps": after["num_steps"] - before["num_steps"],
            "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
            "compiles_in_timed_run": CompileCounter.count - compiles}


def engine_part(wl: "Workload", variant: str, rec: Recorder) -> None:
    from jaxinfer.config import EngineConfig
    from jaxinfer.generator import Generator

    rec.put(("device",), device_info())
    t0 = time.perf_counter()
    model = build_model(wl, variant)
    sizes = model_bytes(model)
    rec.guarded(("memory", "after_build"), memory_stats)
    ecfg = EngineConfig(dtype="bfloat16", attention="pallas", max_num_seqs=wl.max_num_seqs,
                        block_size=wl.block_size, num_blocks=wl.num_blocks, max_model_len=wl.max_model_len,
                        enable_prefix_caching=False)
    gen = Generator(model, None, ecfg, max_num_batched_tokens=wl.max_num_batched_tokens, warmup=False)
    rec.put(("build",), {"variant": variant, "build_s": time.perf_counter() - t0, **sizes,
                         "engine_config": {k: v for k, v in vars(ecfg).items() if k != "extra"},
                         "max_num_batched_tokens": wl.max_num_batched_tokens,
                         "resolved": str(gen.client.resolved)})
    if variant in ("int8", "int4"):
        rec.guarded(("launch_configs",), lambda: launch_configs(model.cfg, variant))
    vocab = model.cfg.vocab_size
    rec.guarded(("batch1",), lambda: batch1(gen, wl, vocab))
    for c in wl.concurrency:
        rec.guarded(("concurrency", str(c)), lambda c=c: concurrent(gen, wl, c, vocab))
    rec.put(("stats",), gen.stats())
    # what the engine's automatic pool sizing assumed (perf.step_activation_bytes) against the peak the
    # runs reached: peak - (in use after the build + the pool) is what the steps' activations took
    rec.guarded(("memory", "end"), lambda: dict(memory_stats(), pool_bytes=pool_bytes(gen),
                                                 activation_reserve=activation_reserve(gen, wl)))


def launch_configs(cfg, variant: str) -> dict[str, dict[str, Any]]:
    """The quantized matmul's launch config for each projection of a layer at M = 1, 16 and 64 (a
    batch-1 decode, 16 and 64 decode rows), as the engine's layers get it (quant.select_blocks in
    this process: measured if autotuning is on, else a shipped config or the default)."""
    from jaxinfer import quant
    fmt = np.zeros((128, 8), np.float32)        # the format's metadata is what select_blocks reads
    qw = quant.quantize_int8(fmt) if variant == "int8" else quant.quantize_int4(fmt, group_size=128)
    return {name: {str(m): quant.select_blocks(m, k, n, qw, jnp.bfloat16) for m in (1, 16, 64)}
            for name, (k, n) in projections(cfg).items()}


def memory_stats() -> dict[str, Any]:
    """The allocator's view (bytes_in_use, peak_bytes_in_use, bytes_limit), or unavailable on CPU."""
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return {"unavailable": "this backend reports no memory stats"}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def pool_bytes(gen) -> int:
    return gen.client.debug.kv_pool_bytes()


def activation_reserve(gen, wl: "Workload") -> int:
    """The reserve the engine's automatic sizing sets aside for this configuration's steps."""
    from jaxinfer import perf
    mc = gen.model_cfg
    return perf.step_activation_bytes(tokens=wl.max_num_batched_tokens, rows=wl.max_num_seqs, d_model=mc.d_model,
                                      ffn_dim=mc.ffn_dim, n_heads=mc.n_heads, head_dim=mc.head_dim,
                                      vocab_size=mc.vocab_size, dtype_bytes=2)


# --------------------------------------------------------------------------- kernels
def attention_impls(scale: float, interpret: bool) -> dict[str, Callable]:
    """(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D], causal; called as op(q, k, v)."""
    from pallas_kernels.flash_attention import flash_attention

    def sdpa(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], scale=scale,
                                                            is_causal=True, implementation=impl)[0]
    return {"flash": lambda q, k, v: flash_attention(q, k, v, scale=scale, causal=True, interpret=interpret),
            "cudnn": sdpa("cudnn"), "xla": sdpa("xla")}


def attention_case(t: int, wl: "Workload", cfg, overhead: float, rec: Recorder) -> None:
    """One prefill length: each implementation's TFLOP/s (a chain q <- attention(q, k, v)) and agreement."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = _random(11, (t, h, d)), _random(12, (t, hkv, d)), _random(13, (t, hkv, d))
    flops = 4 * t * t * h * d / 2                     # QK^T and PV, half of them under the causal mask
    calls = min(wl.max_chain, max(1, math.ceil(wl.attention_flops / flops)))
    rec.put(("attention", str(t), "shape"), {"T": t, "heads": h, "kv_heads": hkv, "head_dim": d, "flops": flops})
    platform = jax.devices()[0].platform
    outputs = {}
    for name, fn in attention_impls(d ** -0.5, platform == "cpu").items():
        key = ("attention", str(t), name)
        if name == "cudnn" and platform != "gpu":
            rec.put(key, {"unavailable": f"cuDNN attention needs an NVIDIA GPU (this run is on {platform})"})
            continue
        if name == "xla" and 4 * h * t * t > wl.xla_attention_max_bytes:
            rec.put(key, {"unavailable": f"the XLA implementation materializes {4 * h * t * t / 2**30:.0f} GiB of "
                                         f"float32 scores at T={t} (limit {wl.xla_attention_max_bytes / 2**30:.0f} GiB)"})
            continue
        # the output is the next call's queries: a true dependency at no extra cost
        chain = chain_of(lambda q, k, v, fn=fn: fn(q, k, v), lambda q, out: out, calls)

        def measure(chain=chain, name=name):
            r = timed_chain(chain, (q, k, v), calls, overhead, wl.reps)     # its first call compiles
            outputs[name] = chain(q, k, v)[1]
            return r | {"TFLOPs": flops / r["per_call_s"] / 1e12}
        rec.guarded(key, measure)
    if "flash" in outputs:
        rec.put(("attention", str(t), "agreement"),
                {f"flash_vs_{b}": rel_err(outputs["flash"], outputs[b]) for b in ("cudnn", "xla") if b in outputs})


def projections(cfg) -> dict[str, tuple[int, int]]:
    """(K, N) of each matmul of a fused layer: qkv, o, gate_up, down."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return {"qkv": (d, (h + 2 * kv) * hd), "o": (h * hd, d), "gate_up": (d, 2 * f), "down": (f, d)}


def matmul_weights(k: int, n: int, fmt: str, count: int) -> list:
    """`count` distinct [K, N] weights (N(0, 1/K)) in bf16, or quantized as the engine quantizes them."""
    from jaxinfer.quant import quantize_int4, quantize_int8
    to_fmt = {"bf16": lambda w: w.astype(jnp.bfloat16), "int8": quantize_int8,
              "int4": lambda w: quantize_int4(w, group_size=128)}[fmt]
    make = jax.jit(lambda key: to_fmt(jax.random.normal(key, (k, n), jnp.float32) * k ** -0.5))
    return [make(jax.random.key(1000 + i)) for i in range(count)]


def weight_nbytes(w) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w)))


def format_nbytes(k: int, n: int, fmt: str) -> int:
    """Bytes of one [K, N] weight: bf16; int8 codes + f32 scale per column; int4 packed codes + f32
    scale per group of 128 along K and column."""
    return {"bf16": 2 * k * n, "int8": k * n + 4 * n, "int4": k * n // 2 + 4 * (k // 128) * n}[fmt]


MATMUL_FORMATS = {"bf16": ("bf16",), "int8": ("xla_int8", "pallas_int8"), "int4": ("xla_int4", "pallas_int4")}


def matmul_op(impl: str) -> Callable:
    """x [M, K] @ w: the bf16 dot, or the project's qdot on the XLA (dequantize-and-dot) or Pallas path."""
    from jaxinfer.quant import qdot
    if impl == "bf16":
        return lambda x, w: jnp.dot(x, w)
    return lambda x, w: qdot(x, w, impl=impl.split("_")[0])


def _feed_columns(x: jax.Array, y: jax.Array) -> jax.Array:
    """The next input: x with its first columns replaced by the output's (in place after x's last use)."""
    c = min(x.shape[1], y.shape[1])
    return lax.dynamic_update_slice(x, y[:, :c], (0, 0))


def matmul_case(impl: str, ws: list, x: jax.Array, overhead: float, reps: int,
                outputs: dict[str, jax.Array]) -> dict[str, Any]:
    """x [M, K] through a chain over every weight in ws (distinct weights: each read from HBM, no
    call can be hoisted or merged); outputs[impl] gets x @ ws[0] for the agreement check."""
    chain = chain_of(matmul_op(impl), _feed_columns)
    r = timed_chain(chain, (x, ws), len(ws), overhead, reps)     # its first call compiles
    outputs[impl] = chain(x, ws)[1]
    nbytes = weight_nbytes(ws[0])
    return r | {"weight_bytes": nbytes, "GBps": nbytes / r["per_call_s"] / 1e9}


def matmul_projection(name: str, k: int, n: int, wl: "Workload", overhead: float, rec: Recorder) -> None:
    rec.put(("matmul", name, "shape"), {"K": k, "N": n})
    for fmt, impls in MATMUL_FORMATS.items():
        # the same bytes per chain in every format: enough kernels to dwarf the launch overhead
        count = min(wl.max_chain, max(2, math.ceil(wl.chain_bytes / format_nbytes(k, n, fmt))))
        ws = rec.guarded(("matmul", name, "weights", fmt), lambda: matmul_weights(k, n, fmt, count), record=False)
        if ws is None:
            continue
        rec.put(("matmul", name, "weights", fmt), {"count": count, "bytes_each": weight_nbytes(ws[0])})
        for m in wl.matmul_rows:
            x, outputs = _random(m, (m, k)), {}
            for impl in impls:
                rec.guarded(("matmul", name, "M", str(m), impl), lambda impl=impl: matmul_case(
                    impl, ws, x, overhead, wl.reps, outputs))
            if len(outputs) == 2:
                rec.put(("matmul", name, "M", str(m), f"agreement_{fmt}"),
                        {"pallas_vs_xla": rel_err(outputs[f"pallas_{fmt}"], outputs[f"xla_{fmt}"])})
        del ws


def kernels_part(wl: "Workload", rec: Recorder) -> None:
    from jaxinfer.models.hf_configs import model_config_from_hf

    rec.put(("device",), device_info())
    cfg = model_config_from_hf(dict(wl.model))
    overhead = launch_overhead(wl.reps)
    rec.put(("launch_overhead_s",), overhead)
    for t in wl.attention_tokens:     # a case's own failures are recorded at its key; anything else here
        rec.guarded(("attention", str(t), "case"), lambda t=t: attention_case(t, wl, cfg, overhead, rec),
                    record=False)
    for name, (k, n) in projections(cfg).items():
        rec.guarded(("matmul", name, "case"), lambda name=name, k=k, n=n: matmul_projection(
            name, k, n, wl, overhead, rec), record=False)


# --------------------------------------------------------------------------- HF transformers
def hf_model(wl: "Workload", device: str):
    """LlamaForCausalLM with random bf16 weights of wl.model's shape (sdpa attention, default cache)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in wl.model.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)       # built in bf16 on the device: no float32 copy of 8B
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16)


def hf_generate_s(model, ids, n: int) -> float:
    """Wall seconds of greedy generation of exactly n new tokens for every row of ids."""
    import torch
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    sync()
    wall = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"asked for {n} new tokens, HF generated {out.shape[1] - ids.shape[1]}")
    return wall


def hf_batch1(model, wl: "Workload", device: str) -> dict[str, Any]:
    import torch
    vocab = wl.model["vocab_size"]
    ids = torch.tensor([np.random.default_rng(1).integers(10, vocab - 10, wl.prompt_len).tolist()], device=device)
    n = wl.decode_tokens
    hf_generate_s(model, ids, wl.warm_tokens)          # CUDA kernels' first launches, allocator warm-up
    t1s, tns = [], []
    for _ in range(wl.batch1_reps):
        t1s.append(hf_generate_s(model, ids, 1))
        tns.append(hf_generate_s(model, ids, n + 1))
    t1, tn = float(np.median(t1s)), float(np.median(tns))
    tok_s = n / (tn - t1)
    return {"prompt_len": wl.prompt_len, "decode_tokens": n, "t1_s": t1s, "tN_s": tns, "t1_median_s": t1,
            "tN_median_s": tn, "decode_tok_s": tok_s, "tpot_s": 1 / tok_s}


def hf_concurrent(model, wl: "Workload", batch: int, device: str) -> dict[str, Any]:
    import torch
    rng = np.random.default_rng(100 + batch)
    vocab = wl.model["vocab_size"]
    ids = torch.tensor([rng.integers(10, vocab - 10, wl.prompt_len).tolist() for _ in range(batch)], device=device)
    warm_s = hf_generate_s(model, ids, wl.warm_tokens)
    wall = hf_generate_s(model, ids, wl.new_tokens)
    total = batch * wl.new_tokens
    return {"requests": batch, "prompt_len": wl.prompt_len, "new_tokens": wl.new_tokens, "total_new_tokens": total,
            "wall_s": wall, "output_tok_s": total / wall, "warm_s": warm_s, "warm_tokens": wl.warm_tokens,
            "wall_includes": "prefill of the batch (equal prompt lengths: no padding) and every decode step"}


def hf_part(wl: "Workload", rec: Recorder, smoke: bool) -> None:
    try:
        import torch
        import transformers
    except ImportError as e:
        rec.put(("torch",), {"unavailable": f"torch / transformers are not importable: {e}"})
        return
    device = "cpu" if smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        rec.put(("torch",), {"unavailable": f"torch {torch.__version__} sees no CUDA device"})
        return
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    rec.put(("device",), {"kind": name, "platform": "gpu" if device == "cuda" else "cpu", "torch": torch.__version__,
                          "transformers": transformers.__version__})
    t0 = time.perf_counter()
    model = hf_model(wl, device)
    rec.put(("build",), {"build_s": time.perf_counter() - t0, "attn_implementation": model.config._attn_implementation,
                         "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
    rec.guarded(("batch1",), lambda: hf_batch1(model, wl, device))
    rec.guarded(("concurrency", str(wl.hf_batch)), lambda: hf_concurrent(model, wl, wl.hf_batch, device))


def run_part(part: str, wl: "Workload", records: str | Path, smoke: bool) -> None:
    """The entry point of a part's subprocess."""
    # cold means cold: no persistent XLA cache in any part (the parent also sets the env for it)
    jax.config.update("jax_enable_compilation_cache", False)
    rec = Recorder(records)
    if part == "ceilings":
        rec.put(("device",), device_info())
        ceilings_part(wl, rec)
    elif part == "kernels":
        kernels_part(wl, rec)
    elif part == "hf":
        hf_part(wl, rec, smoke)
    else:
        engine_part(wl, part, rec)
