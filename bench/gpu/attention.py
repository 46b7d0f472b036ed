"""`python -m bench.gpu.attention`: the serving attention kernels on their real workloads (#41's
prepared GPU run).

What it measures (bfloat16, the Llama-3-8B attention shape: 32 query / 8 KV heads, head_dim 128,
16-token pages), each part in its own process with its own timeout (bench.gpu's machinery), the JSON
rewritten after each part:

  copy      the device-to-device copy bandwidth of this run (bench.gpu's ceiling), the bar of the
            bandwidth-bound cases below;
  decode    ragged_paged_attention on decode rows only: 64 sequences with contexts drawn uniformly in
            [512, 4096] (seed 0), and batch 1 at 512 / 4096 / 32768 keys; bf16, int8 and fp8 pages.
            GB/s of the KV bytes the rows read (keys + values of every context token, + the int8 / fp8
            scales), against the copy bandwidth (target: >= 0.8); the bf16 cases also with split-KV
            (kv_splits 4 and 16: "<case>_splits<S>"; every case records its kv_splits), and derive
            names each case's fastest kv_splits and its speedup over 1;
  mixed     one step of 2 prefill chunks of 512 tokens over 1,024 cached tokens beside the 64 decode
            rows, against its two halves run as separate steps (target: mixed <= 1.25 x the sum);
  prefill   one 2,048-token chunk over 2,048 cached tokens (a chunked prefill's second chunk) in
            TFLOP/s, against cuDNN's dense causal attention on the whole 4,096 tokens (a rate; the
            kernel's FLOPs are the visible pairs only: 4 H D (Tq c + Tq (Tq + 1) / 2));
  dense     one sequence's causal prefill at 2k / 8k / 32k: our flash kernel, cuDNN, and JAX's shipped
            Mosaic GPU kernel (jax.experimental.pallas.ops.gpu.attention_mgpu) where it imports and
            takes the shape, each checked against cuDNN (relative error).

Timing: chains of kernels inside one jitted call (a kernel's output is the next call's queries), the
empty call's launch cost subtracted (bench.gpu.report.net_seconds), medians of `reps` calls.

    python -m bench.gpu.attention [--parts decode,mixed] [--out FILE.json] [--deadline-s 300]
    python -m bench.gpu.attention --smoke          # every path on CPU, tiny shapes, interpret mode

Writes bench/results/<date>-<gpu>-attention.json (device, driver, versions, command).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARTS = ("copy", "decode", "mixed", "prefill", "dense")
PART_CAPS_S = {"copy": 20, "decode": 90, "mixed": 45, "prefill": 40, "dense": 90}
PAGE_FORMATS = ("bf16", "int8", "fp8")
KV_SPLITS = (4, 16)     # split-KV settings the bf16 decode cases are also timed with, beside 1


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    batch: int                        # decode rows of the batched decode and mixed cases
    context_range: tuple[int, int]    # their contexts, uniform (inclusive)
    batch1_contexts: tuple[int, ...]
    chunks: int                       # prefill chunks in the mixed step
    chunk_len: int
    chunk_cached: int
    prefill_len: int                  # the prefill case's chunk, over as many cached tokens
    dense_tokens: tuple[int, ...]
    copy_bytes: int
    max_chain: int
    chain_bytes: float                # KV bytes a timed decode chain reads, at least one call
    chain_flops: float                # FLOPs a timed prefill chain computes, at least one call
    reps: int


REAL = Shapes(heads=32, kv_heads=8, head_dim=128, block_size=16, batch=64, context_range=(512, 4096),
              batch1_contexts=(512, 4096, 32768), chunks=2, chunk_len=512, chunk_cached=1024, prefill_len=2048,
              dense_tokens=(2048, 8192, 32768), copy_bytes=2 << 30, max_chain=32, chain_bytes=4e9,
              chain_flops=3e11, reps=10)
SMOKE = Shapes(heads=4, kv_heads=2, head_dim=32, block_size=16, batch=3, context_range=(8, 40),
               batch1_contexts=(16, 48), chunks=1, chunk_len=8, chunk_cached=16, prefill_len=16,
               dense_tokens=(32,), copy_bytes=1 << 20, max_chain=2, chain_bytes=1.0, chain_flops=1.0, reps=2)


# --------------------------------------------------------------------------- steps (host side: numpy)
@dataclass(frozen=True)
class Step:
    """One step's ragged layout: sequence s has `new[s]` tokens at the end of a context of `ctx[s]`."""
    new: tuple[int, ...]
    ctx: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.new)

    def kv_tokens(self) -> int:
        return sum(self.ctx)

    def visible_pairs(self) -> int:
        """(query, key) pairs under the causal mask: token i of a chunk of n at the end of c keys sees c - n + i + 1."""
        return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(self.new, self.ctx))


def decode_step(sh: Shapes, seed: int = 0) -> Step:
    import numpy as np
    ctx = np.random.default_rng(seed).integers(sh.context_range[0], sh.context_range[1] + 1, sh.batch)
    return Step(new=(1,) * sh.batch, ctx=tuple(int(c) for c in ctx))


def chunk_step(sh: Shapes) -> Step:
    return Step(new=(sh.chunk_len,) * sh.chunks, ctx=(sh.chunk_cached + sh.chunk_len,) * sh.chunks)


def join(a: Step, b: Step) -> Step:
    return Step(new=a.new + b.new, ctx=a.ctx + b.ctx)


def kv_bytes(step: Step, sh: Shapes, fmt: str) -> int:
    """Bytes of keys and values the step's rows read: every context token's K and V in each KV head,
    + the float32 scale per (token, head) of int8 / fp8 pages."""
    per_value = 2 if fmt == "bf16" else 1
    per_token = 2 * sh.kv_heads * (sh.head_dim * per_value + (0 if fmt == "bf16" else 4))
    return step.kv_tokens() * per_token


def attention_flops(pairs: int, sh: Shapes) -> float:
    return 4.0 * sh.heads * sh.head_dim * pairs


def metadata(step: Step, sh: Shapes):
    """positions [T], seq_ids [T], query_start_loc [S+1], block_tables [S, B], context_lens [S] (numpy)
    with each sequence's pages laid out one after another from block 1 (block 0: the null block)."""
    import numpy as np
    bs = sh.block_size
    pages = [math.ceil(c / bs) for c in step.ctx]
    bt = np.zeros((len(step.ctx), max(pages)), np.int32)
    first = 1
    for s, p in enumerate(pages):
        bt[s, :p] = np.arange(first, first + p)
        first += p
    qsl = np.concatenate([[0], np.cumsum(step.new)]).astype(np.int32)
    pos = np.concatenate([np.arange(c - n, c) for n, c in zip(step.new, step.ctx)]).astype(np.int32)
    sid = np.repeat(np.arange(len(step.new)), step.new).astype(np.int32)
    return pos, sid, qsl, bt, np.asarray(step.ctx, np.int32), first


# --------------------------------------------------------------------------- device side
def random_pages(num_blocks: int, sh: Shapes, fmt: str, seed: int):
    """(k_pages, v_pages, k_scale, v_scale) [Hkv, num_blocks, bs, D] of random values in `fmt`."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.kv_cache import quantize_kv
    shape = (sh.kv_heads, num_blocks, sh.block_size, sh.head_dim)
    k, v = (jax.random.normal(jax.random.key(seed + i), shape, jnp.float32).astype(jnp.bfloat16) for i in (0, 1))
    if fmt == "bf16":
        return k, v, None, None
    (kq, ks), (vq, vs) = quantize_kv(k, jnp.dtype({"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[fmt])), \
        quantize_kv(v, jnp.dtype({"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[fmt]))
    return kq, vq, ks, vs


def step_case(step: Step, sh: Shapes, fmt: str, ctx: "Context", kv_splits: int = 1) -> dict[str, Any]:
    """Time ragged_paged_attention on one step (num_kv_splits=kv_splits); -> raw times, KV bytes,
    FLOPs and the check against the kernel's reference."""
    import jax
    import jax.numpy as jnp

    from bench.gpu.parts import _random, chain_of, rel_err, timed_chain
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
    pos, sid, qsl, bt, cl, num_blocks = metadata(step, sh)
    k, v, ks, vs = random_pages(num_blocks, sh, fmt, seed=21)
    meta = tuple(jnp.asarray(a) for a in (pos, sid, qsl, bt, cl))
    q = _random(20, (step.tokens, sh.heads, sh.head_dim))
    scale = sh.head_dim ** -0.5
    kw = dict(scale=scale, k_scale=ks, v_scale=vs)
    nbytes = kv_bytes(step, sh, fmt)
    calls = min(sh.max_chain, max(1, math.ceil(sh.chain_bytes / nbytes)))
    op = lambda q, k, v, *m: ragged_paged_attention(q, k, v, *m, interpret=ctx.interpret,  # noqa: E731
                                                    num_kv_splits=kv_splits, **kw)
    chain = chain_of(op, lambda q, out: out.astype(q.dtype), calls)
    r = timed_chain(chain, (q, k, v) + meta, calls, ctx.overhead, sh.reps)
    out = chain(q, k, v, *meta)[1]
    ref = jax.jit(lambda q, k, v, *m: ragged_paged_attention_reference(q, k, v, *m, **kw))(q, k, v, *meta)
    pairs = step.visible_pairs()
    return r | {"tokens": step.tokens, "sequences": len(step.new), "kv_bytes": nbytes, "visible_pairs": pairs,
                "flops": attention_flops(pairs, sh), "GBps": nbytes / r["per_call_s"] / 1e9,
                "TFLOPs": attention_flops(pairs, sh) / r["per_call_s"] / 1e12, "rel_err_vs_reference": rel_err(out, ref),
                "max_err_vs_reference": max_rel_err(out, ref), "max_keys": max(step.ctx), "kv_splits": kv_splits}


def max_rel_err(a, b) -> float:
    """max|a - b| / max|b| in float32 (the measure tests/precision.py's attention bounds are for)."""
    import jax.numpy as jnp
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


@dataclass
class Context:
    interpret: bool
    overhead: float


def context() -> Context:
    import jax

    from bench.gpu.parts import launch_overhead
    return Context(interpret=jax.devices()[0].platform == "cpu", overhead=launch_overhead(5))


# --------------------------------------------------------------------------- parts
def copy_part(sh: Shapes, rec, ctx: Context) -> None:
    from bench.gpu.parts import copy_ceiling
    copy_ceiling(sh.copy_bytes, ctx.overhead, sh.reps, rec)


def decode_part(sh: Shapes, rec, ctx: Context) -> None:
    batched = decode_step(sh)
    rec.put(("decode", "contexts"), list(batched.ctx))
    steps = {f"batch{sh.batch}": batched} | {f"batch1_ctx{c}": Step((1,), (c,)) for c in sh.batch1_contexts}
    for fmt in PAGE_FORMATS:
        for name, step in steps.items():
            rec.guarded(("decode", fmt, name), lambda fmt=fmt, step=step: step_case(step, sh, fmt, ctx))
        if fmt == "bf16":
            for splits in KV_SPLITS:
                for name, step in steps.items():
                    rec.guarded(("decode", "bf16", f"{name}_splits{splits}"),
                                lambda step=step, splits=splits: step_case(step, sh, "bf16", ctx, kv_splits=splits))


def mixed_part(sh: Shapes, rec, ctx: Context) -> None:
    dec, chunks = decode_step(sh), chunk_step(sh)
    for name, step in (("mixed", join(chunks, dec)), ("decode_half", dec), ("chunk_half", chunks)):
        rec.guarded(("mixed", name), lambda step=step: step_case(step, sh, "bf16", ctx))


def prefill_part(sh: Shapes, rec, ctx: Context) -> None:
    n = sh.prefill_len
    rec.guarded(("prefill", "chunk_over_cache"), lambda: step_case(Step((n,), (2 * n,)), sh, "bf16", ctx))
    dense_case(2 * n, sh, rec, ctx, ("prefill", "cudnn_dense"), only=("cudnn",))


def dense_impls(sh: Shapes, interpret: bool) -> dict[str, Any]:
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D], causal: bench.gpu's flash and cuDNN, and JAX's
    shipped Hopper kernel."""
    from bench.gpu.parts import attention_impls
    impls = attention_impls(sh.head_dim ** -0.5, interpret)

    def mosaic(q, k, v):      # JAX's shipped Hopper kernel, [B, T, H, D], its own 1/sqrt(D) scale
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        cfg = am.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=True)
        return am.attention(q[None], k[None], v[None], cfg)[0]
    return {"flash": impls["flash"], "cudnn": impls["cudnn"], "mosaic_jax": mosaic}


def dense_case(t: int, sh: Shapes, rec, ctx: Context, key: tuple[str, ...], only: tuple[str, ...] | None = None) -> None:
    import jax

    from bench.gpu.parts import _random, chain_of, rel_err, timed_chain
    q, k, v = (_random(30 + i, (t, h, sh.head_dim)) for i, h in enumerate((sh.heads, sh.kv_heads, sh.kv_heads)))
    flops = attention_flops(t * (t + 1) // 2, sh)
    calls = min(sh.max_chain, max(1, math.ceil(sh.chain_flops / flops)))
    outputs = {}
    for name, fn in dense_impls(sh, ctx.interpret).items():
        if only and name not in only:
            continue
        if name != "flash" and jax.devices()[0].platform != "gpu":
            rec.put(key + (name,), {"unavailable": f"{name} needs an NVIDIA GPU"})
            continue
        chain = chain_of(lambda q, k, v, fn=fn: fn(q, k, v), lambda q, out: out.astype(q.dtype), calls)

        def measure(chain=chain, name=name):
            r = timed_chain(chain, (q, k, v), calls, ctx.overhead, sh.reps)
            outputs[name] = chain(q, k, v)[1]
            return r | {"T": t, "flops": flops, "TFLOPs": flops / r["per_call_s"] / 1e12}
        rec.guarded(key + (name,), measure)
    if "cudnn" in outputs:
        rec.put(key + ("agreement",), {f"{a}_vs_cudnn": rel_err(o, outputs["cudnn"]) for a, o in outputs.items()
                                       if a != "cudnn"})


def dense_part(sh: Shapes, rec, ctx: Context) -> None:
    for t in sh.dense_tokens:
        dense_case(t, sh, rec, ctx, ("dense", str(t)))


PART_FUNCS = {"copy": copy_part, "decode": decode_part, "mixed": mixed_part, "prefill": prefill_part,
              "dense": dense_part}


def run_part(part: str, smoke: bool, records: str) -> None:
    import jax

    from bench.gpu.parts import device_info
    from bench.gpu.records import Recorder
    jax.config.update("jax_enable_compilation_cache", False)
    rec = Recorder(records)
    rec.put(("device",), device_info())
    ctx = context()
    rec.put(("launch_overhead_s",), ctx.overhead)
    PART_FUNCS[part](SMOKE if smoke else REAL, rec, ctx)


# --------------------------------------------------------------------------- derived numbers
def _ok(d: Any, *keys: str) -> Any:
    from bench.gpu.report import _get
    return _get(d, *keys)


def derive(report: dict[str, Any]) -> dict[str, Any]:
    """Every ratio from the raw records (tests/test_gpu_attention.py recomputes them by hand)."""
    from bench.gpu.report import ratio

    def res(part):
        return (report["parts"].get(part) or {}).get("results") or {}
    copy = _ok(res("copy"), "copy", "GBps")
    out: dict[str, Any] = {"copy_GBps": copy, "decode_vs_copy": {}, "mixed": None, "prefill": None, "dense": {}}
    for fmt, cases in (_ok(res("decode"), "decode") or {}).items():
        if isinstance(cases, dict) and fmt in PAGE_FORMATS:
            out["decode_vs_copy"][fmt] = {c: ratio(_ok(v, "GBps"), copy) for c, v in cases.items()}
    out["decode_splits"] = best_splits(_ok(res("decode"), "decode", "bf16") or {})
    mixed = res("mixed").get("mixed") or {}
    halves = [_ok(mixed, h, "per_call_s") for h in ("decode_half", "chunk_half")]
    if None not in halves:
        out["mixed"] = {"mixed_over_halves": ratio(_ok(mixed, "mixed", "per_call_s"), sum(halves))}
    pre = res("prefill").get("prefill") or {}
    out["prefill"] = {"chunk_vs_cudnn_dense": ratio(_ok(pre, "chunk_over_cache", "TFLOPs"),
                                                    _ok(pre, "cudnn_dense", "cudnn", "TFLOPs"))}
    for t, cases in (res("dense").get("dense") or {}).items():
        out["dense"][t] = {f"{a}_vs_cudnn": ratio(_ok(cases, a, "TFLOPs"), _ok(cases, "cudnn", "TFLOPs"))
                           for a in ("flash", "mosaic_jax")}
    return out


def split_name(name: str) -> tuple[str, int]:
    """A decode case's name -> (its step, its kv_splits): "batch1_ctx4096_splits16" -> ("batch1_ctx4096", 16)."""
    base, _, splits = name.partition("_splits")
    return base, int(splits) if splits else 1


def best_splits(cases: dict[str, Any]) -> dict[str, Any]:
    """Per decode step timed with several kv_splits: the fastest one and its speedup over
    kv_splits=1 (per-call time ratio), with every setting's time; steps whose kv_splits=1 case or
    every split case failed are left out."""
    from bench.gpu.report import ratio
    times: dict[str, dict[int, float]] = {}
    for name, c in cases.items():
        base, splits = split_name(name)
        t = _ok(c, "per_call_s")
        if isinstance(t, (int, float)) and t > 0:
            times.setdefault(base, {})[splits] = t
    out = {}
    for base, by_splits in times.items():
        if 1 in by_splits and len(by_splits) > 1:
            best = min(by_splits, key=by_splits.get)
            out[base] = {"best_kv_splits": best, "speedup_over_1": ratio(by_splits[1], by_splits[best]),
                         "per_call_s": {str(k): by_splits[k] for k in sorted(by_splits)}}
    return out


def write(report: dict[str, Any], out: Path) -> None:
    from bench.common import write_json_atomic
    from bench.gpu.run import take_device
    take_device(report, PARTS)
    report["derived"] = derive(report)
    write_json_atomic(report, out)


# --------------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> Path:
    from bench.gpu import run as gpu
    parts = gpu.parse_parts(args.parts, PARTS)
    t0, driver, device, out, log_dir = gpu.open_run(args, "attention")
    caps = gpu.part_timeouts(parts, args.deadline_s, PART_CAPS_S)
    report = {"benchmark": "gpu_attention", "date": _dt.date.today().isoformat(), "time": time.strftime("%H:%M:%S"),
              "command": gpu.the_command(), "smoke": bool(args.smoke), "device": device, "driver": driver,
              "versions": gpu.versions(), "shapes": dataclasses.asdict(SMOKE if args.smoke else REAL),
              "settings": {"parts": parts, "deadline_s": args.deadline_s, "caps_s": caps, "log_dir": str(log_dir),
                           "autotune": "off: the kernels' default launch configs"}, "parts": {}}
    gpu.run_parts(report, parts, caps, args.deadline_s, t0,
                  lambda part, timeout: gpu.run_worker(part, timeout, args.smoke, False, log_dir,
                                                       module="bench.gpu.attention"),
                  lambda report: write(report, out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--deadline-s", type=float, default=300.0, help="the whole run's budget (default 300)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<device>-attention.json)")
    p.add_argument("--smoke", action="store_true", help="every part on CPU with tiny shapes (a code-path check)")
    p.add_argument("--log-dir", default=None, help="each part's log and records (default: a new temp folder)")
    p.add_argument("--worker", default=None, choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--records", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_part(args.worker, args.smoke, args.records)
        return 0
    try:
        out = run(args)
    except ValueError as e:
        print(f"bench.gpu.attention: error: {e}", file=sys.stderr)
        return 2
    report = json.loads(out.read_text())
    print(json.dumps(report["derived"], indent=1))
    print(f"wrote {out}")
    return 1 if any(e["errors"] for e in report["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
