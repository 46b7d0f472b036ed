"""`python -m bench.gpu.quant_sweep`: every weight-only matmul the engine can run, on the 8B decode
projections, against the bf16 dot and the device's measured copy bandwidth (issue #39).

    python -m bench.gpu.quant_sweep [--deadline-s 225] [--out PATH] [--log-dir DIR] [--formats F,F,...]
    python -m bench.gpu.quant_sweep --smoke [--out PATH]   every code path on CPU, tiny shapes (< 30 s)
    python -m bench.gpu.quant_sweep --tuned JSON   the TUNED rows of pallas_kernels/quant_matmul_tuned.py
                                                   that a sweep's JSON measured (printed)
On a lent GPU machine, whose bench/results/ does not come back: --out $OUT/quant-sweep.json.

Parts, each in its own subprocess with its own timeout (bench.gpu.run_worker), in this order:
    copy        the measured copy bandwidth: the fastest of bench.gpu.parts' three copy methods
    qkv o gate_up down   for M = 4, 8, 1, 16, 2, 64, 128 (most wanted first: a deadline cuts the rest):
                the bf16 dot; int8 and int4 (g128, symmetric) through qdot with every launch config
                of jaxinfer.quant.pallas_block_candidates -- XLA's dequantize-and-dot, the split-K
                kernel's configs, the tiled kernel's (at M > 16 its first two only: the tiled sweep
                at large M is bench.gpu's); fp8 (e4m3 per channel, x per token) as XLA's native fp8
                dot with the weight stored [K, N] ("fp8:kn", contracting dim 0) and [N, K] ("fp8:nk",
                K contiguous: cuBLASLt's TN layout, contracting dim 1); with --formats, GGUF's
                packed forms too: "q4k" (llama.cpp's Q4_K as loaded: int4 in groups of 32 with float32
                zero points, through qdot's launch configs as int4), "q8_0" (grouped int8 in groups of
                32) and "fp8b" (fine-grained FP8 checkpoints: e4m3 codes, a scale per 128 k), both
                through qdot's launch configs as grouped 8-bit (XLA first: its untuned default)
Timing is bench.gpu.parts' (its module docstring): a jitted chain of kernels over distinct weights
(about chain_bytes of them, more than L2 holds), each fed the previous output, the launch overhead
of an empty call subtracted, the median of `reps` calls. A part compiles one M's chains in a thread
pool (XLA and Triton compiles run outside the GIL), then times them one by one, recording each
result as it has it, so a part killed at its timeout keeps what it measured.

Output (rewritten after every part): bench/results/<date>-<device>-quant-sweep.json (or --out) with
benchmark, date, command, smoke, device, driver (nvidia-smi), versions, settings, parts {<part>:
{status, wall_s, timeout_s, errors, results}} (raw: per case calls, total_s, overhead_s, per_call_s,
compile_s, weight_bytes, config, rel_err against XLA's result of the same format), and derived:
copy_GBps, per case {GBps = weight_bytes / per_call_s, copy_fraction = GBps / copy_GBps, vs_bf16 =
bf16 per_call_s / per_call_s}, and the winner (fastest) per projection, M and format.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable


# (K, N) of the Llama-3-8B fused projections (bench.gpu.parts.projections of bench.gpu.workload.LLAMA3_8B)
PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
PARTS = ("copy", *PROJECTIONS)
INT4_GROUP = 128
GGUF_GROUP = 32                       # Q4_K's and Q8_0's groups
FP8_BLOCK = 128                       # fine-grained FP8 checkpoints' blocks along K (DeepSeek-V3, Qwen3-FP8)
FORMATS = ("bf16", "int8", "int4", "fp8_kn", "fp8_nk")
GGUF_FORMATS = ("q4k", "q8_0", "fp8b")  # the pre-quantized checkpoints' packed forms (--formats)
# the formats qdot runs through the tuner's launch configs: (bits, group size, tuning_key keywords)
QDOT_FORMATS = {"int8": (8, None, {}), "int4": (4, INT4_GROUP, {}),
                "q4k": (4, GGUF_GROUP, {"symmetric": False, "float_zeros": True}),
                "q8_0": (8, GGUF_GROUP, {}), "fp8b": (8, FP8_BLOCK, {"fp8_codes": True})}
FORMATS_ENV = "JAXINFER_SWEEP_FORMATS"   # --formats, as the parent hands it to the part workers


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Every shape and count of a run: the real run and --smoke differ only here."""
    projections: dict[str, tuple[int, int]]
    rows: tuple[int, ...]             # M, in the order measured (a deadline cuts the last ones)
    chain_bytes: int                  # weight bytes one timed chain reads (distinct weights)
    max_chain: int                    # kernels per timed chain, at most
    reps: int                         # timed calls per case (median)
    copy_bytes: int                   # the copy ceiling's buffer
    max_splitk: int | None            # split-K configs per inner product and M (None: all)
    max_tiled_large_m: int            # tiled configs at M > 16
    compile_threads: int
    caps_s: dict[str, float]          # each part's share of the deadline
    formats: tuple[str, ...] = FORMATS    # the weight formats measured (bf16 always: the ratios' base)


GiB = 1 << 30
REAL = Sweep(projections=PROJECTIONS, rows=(4, 8, 1, 16, 2, 64, 128), chain_bytes=GiB, max_chain=32, reps=7,
             copy_bytes=GiB, max_splitk=None, max_tiled_large_m=2, compile_threads=8,
             # ~5 s of process and CUDA start each; 29-35 chains per M <= 16, 15 at M = 64, 9 at 128,
             # 0.3-1 s compiles spread over 8 threads; weights (~5 GiB per projection, 5 formats) made on
             # the device. The first H200 run (2026-12-04, 130 s) finished M = 1 and 16 of every
             # projection in ~25 s each and cut the rest: M = 4 and 8 (no shipped configs yet) go first
             # now, then 1 and 16 again (the candidate lists changed since), then 2, 64 and 128.
             caps_s={"copy": 15, "qkv": 48, "o": 45, "gate_up": 60, "down": 52})
SMOKE = dataclasses.replace(REAL, projections={"qkv": (256, 128)}, rows=(1, 64), chain_bytes=1, max_chain=2,
                            reps=2, copy_bytes=1 << 20, max_splitk=1, max_tiled_large_m=1, compile_threads=2,
                            caps_s={"copy": 20, "qkv": 60}, formats=FORMATS + GGUF_FORMATS)


# --------------------------------------------------------------------------- the cases (worker side)
def config_name(fmt: str, cfg: dict) -> str:
    """'int8:xla', 'int4:splitk:S4-n64-k128-reduce-w4-s3', 'int8:tiled:m16-n128-k128-w4-s3'."""
    kind = cfg.get("kernel", "tiled")
    if kind == "xla":
        return f"{fmt}:xla"
    if kind == "splitk":
        return (f"{fmt}:splitk:S{cfg['num_splits']}-n{cfg['block_n']}-k{cfg['block_k']}-{cfg['inner']}"
                f"-w{cfg['num_warps']}-s{cfg['num_stages']}")
    return f"{fmt}:tiled:m{cfg['block_m']}-n{cfg['block_n']}-k{cfg['block_k']}-w{cfg['num_warps']}-s{cfg['num_stages']}"


def sweep_configs(sw: Sweep, m: int, k: int, n: int, bits: int, group: int | None = None) -> list[dict]:
    """The tuner's candidates for this shape, less what the sweep leaves out (Sweep.max_*)."""
    from jaxinfer import quant
    out, per_inner, tiled = [], {}, 0
    for cfg in quant.pallas_block_candidates(m, k, n, bits, group or (INT4_GROUP if bits == 4 else None)):
        kind = cfg.get("kernel", "tiled")
        if kind == "splitk":
            per_inner[cfg["inner"]] = per_inner.get(cfg["inner"], 0) + 1
            if sw.max_splitk is not None and per_inner[cfg["inner"]] > sw.max_splitk:
                continue
        elif kind == "tiled":
            tiled += 1
            if m > 16 and tiled > sw.max_tiled_large_m:
                continue
        out.append(cfg)
    return out


def make_weights(k: int, n: int, fmt: str, count: int) -> list:
    """`count` distinct [K, N] weights (N(0, 1/K)): bf16, QuantizedWeights (int8, int4 g128; GGUF's q4k:
    int4 g32 with float32 zero points, q8_0: grouped int8 g32; fp8b: e4m3 codes g128), or fp8
    (e4m3 codes per output channel, jaxinfer.quant.symmetric_codes) as (codes, scales) with the codes
    [K, N] ("fp8_kn") or [N, K] ("fp8_nk", transposed once here)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import quant

    def fp8(w, transpose):
        q, s = quant.symmetric_codes(w, quant.FP8_DTYPE, axis=0)
        return (q.T if transpose else q), s

    def q4k(w):   # GGUF's Q4_K as jaxinfer holds it: unsigned codes, float32 scales and zero points per 32
        qw = quant.quantize_int4(w, GGUF_GROUP, symmetric=False)
        return dataclasses.replace(qw, zeros=qw.zeros.astype(jnp.float32))

    def q8_0(w):  # GGUF's Q8_0: int8 codes with a float32 scale per 32 (grouped int8)
        g = w.reshape(k // GGUF_GROUP, GGUF_GROUP, n)
        s = jnp.maximum(jnp.max(jnp.abs(g), axis=1), 1e-30) / 127.0
        q = jnp.round(g / s[:, None, :]).astype(jnp.int8).reshape(k, n)
        return quant.QuantizedWeight(q, s, None, bits=8, group_size=GGUF_GROUP, shape=(k, n))

    def fp8b(w):  # fine-grained FP8 as jaxinfer.prequant.fp8_block loads it: e4m3 [K, N], a scale per 128 k
        g = w.reshape(k // FP8_BLOCK, FP8_BLOCK, n)
        s = jnp.maximum(jnp.max(jnp.abs(g), axis=1), 1e-30) / quant.FP8_MAX
        q = (g / s[:, None, :]).astype(quant.FP8_DTYPE).reshape(k, n)
        return quant.QuantizedWeight(q, s, None, bits=8, group_size=FP8_BLOCK, shape=(k, n))
    to_fmt = {"bf16": lambda w: w.astype(jnp.bfloat16), "int8": quant.quantize_int8,
              "int4": lambda w: quant.quantize_int4(w, INT4_GROUP), "fp8_kn": lambda w: fp8(w, False),
              "fp8_nk": lambda w: fp8(w, True), "q4k": q4k, "q8_0": q8_0, "fp8b": fp8b}[fmt]
    make = jax.jit(lambda key: to_fmt(jax.random.normal(key, (k, n), jnp.float32) * k ** -0.5))
    return [make(jax.random.key(2000 + i)) for i in range(count)]


def fp8_dot(x, w, layout: str):
    """XLA's native fp8 dot as jaxinfer.quant.fp8_native_matmul computes it (x per token to e4m3,
    f32 accumulation at HIGHEST, both scales after), with the codes [K, N] or [N, K]."""
    import jax.numpy as jnp
    from jax import lax

    from jaxinfer import quant
    q, scales = w
    xq, sx = quant.symmetric_codes(x, quant.FP8_DTYPE, axis=1)
    contract = 0 if layout == "kn" else 1
    y = lax.dot_general(xq, q, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST)
    return (y * sx[:, None] * scales[None, :]).astype(x.dtype)


def case_ops(sw: Sweep, m: int, k: int, n: int) -> dict[str, tuple[str, Callable, dict | None]]:
    """name -> (weight format, op(x, w) -> [M, N], launch config or None), the references first."""
    import jax.numpy as jnp

    from jaxinfer.quant import qdot
    ops: dict[str, tuple[str, Callable, dict | None]] = {"bf16": ("bf16", lambda x, w: jnp.dot(x, w), None)}
    for layout in ("kn", "nk"):
        ops[f"fp8:{layout}"] = (f"fp8_{layout}", lambda x, w, layout=layout: fp8_dot(x, w, layout), None)
    for fmt, (bits, group, _) in QDOT_FORMATS.items():
        for cfg in sweep_configs(sw, m, k, n, bits, group):
            ops[config_name(fmt, cfg)] = (fmt, lambda x, w, cfg=cfg: qdot(x, w, impl="pallas", blocks=cfg), cfg)
    # the references of the agreement check (XLA's result of each format) are timed first
    first = ["bf16", "fp8:kn", *(f"{fmt}:xla" for fmt in QDOT_FORMATS)]
    return {c: ops[c] for c in first if c in ops} | {c: o for c, o in ops.items() if c not in first}


def compile_all(chains: dict[str, Callable], args: dict[str, tuple], threads: int) -> dict[str, Any]:
    """name -> compiled executable or the exception its compile raised, with its compile seconds."""
    def one(name):
        t = time.perf_counter()
        try:
            return name, chains[name].lower(*args[name]).compile(), time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 -- recorded at the case's key
            return name, e, time.perf_counter() - t
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return {name: (exe, secs) for name, exe, secs in pool.map(one, list(chains))}


def measure_rows(sw: Sweep, name: str, m: int, weights: dict[str, list], overhead: float, rec) -> None:
    """Every case of one projection at one M: compiled together, timed one by one, recorded."""
    from bench.gpu.parts import _feed_columns, _random, chain_of, rel_err, timed_chain
    k, n = sw.projections[name]
    x = _random(m, (m, k))
    ops = {c: o for c, o in case_ops(sw, m, k, n).items() if o[0] in weights}
    chains = {c: chain_of(op, _feed_columns) for c, (_, op, _) in ops.items()}
    args = {c: (x, weights[fmt]) for c, (fmt, _, _) in ops.items()}
    compiled = compile_all(chains, args, sw.compile_threads)
    firsts: dict[str, Any] = {}
    for case, (fmt, _, cfg) in ops.items():
        exe, secs = compiled[case]
        key = (name, "M", str(m), case)
        if isinstance(exe, Exception):
            rec.put(key, {"error": f"{type(exe).__name__}: {exe}"[:2000], "config": cfg})
            continue

        def run(exe=exe, case=case, fmt=fmt, cfg=cfg, secs=secs):
            r = timed_chain(exe, args[case], len(weights[fmt]), overhead, sw.reps)
            firsts[case] = exe(*args[case])[1]
            ref = firsts.get(f"{fmt}:xla") if fmt in QDOT_FORMATS else firsts.get("fp8:kn")
            return r | {"compile_s": secs, "weight_bytes": weight_nbytes(weights[fmt][0]), "config": cfg,
                        "format": fmt, "rel_err_vs_xla": None if ref is None else rel_err(firsts[case], ref)}
        rec.guarded(key, run)


def weight_nbytes(w) -> int:
    import jax
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w)))


def format_nbytes(k: int, n: int, fmt: str) -> int:
    per = {"bf16": 2 * k * n, "int8": k * n + 4 * n, "int4": k * n // 2 + 4 * (k // INT4_GROUP) * n,
           "q4k": k * n // 2 + 8 * (k // GGUF_GROUP) * n, "q8_0": k * n + 4 * (k // GGUF_GROUP) * n,
           "fp8b": k * n + 4 * (k // FP8_BLOCK) * n}
    return per.get(fmt, k * n + 4 * n)      # fp8: e4m3 codes + f32 scale per column


def projection_part(sw: Sweep, name: str, rec) -> None:
    from bench.gpu.parts import device_info, launch_overhead
    k, n = sw.projections[name]
    rec.put(("device",), device_info())
    overhead = launch_overhead(sw.reps)
    rec.put(("launch_overhead_s",), overhead)
    rec.put((name, "shape"), {"K": k, "N": n})
    weights = {}
    for fmt in dict.fromkeys(("bf16", *sw.formats)):
        count = min(sw.max_chain, max(2, math.ceil(sw.chain_bytes / format_nbytes(k, n, fmt))))
        ws = rec.guarded((name, "weights", fmt), lambda fmt=fmt, count=count: make_weights(k, n, fmt, count),
                         record=False)
        if ws is not None:
            weights[fmt] = ws
            rec.put((name, "weights", fmt), {"count": count, "bytes_each": weight_nbytes(ws[0])})
    for m in sw.rows:
        rec.guarded((name, "M", str(m), "case"), lambda m=m: measure_rows(sw, name, m, weights, overhead, rec),
                    record=False)


def copy_part(sw: Sweep, rec) -> None:
    from bench.gpu.parts import copy_ceiling, device_info, launch_overhead
    rec.put(("device",), device_info())
    overhead = launch_overhead(sw.reps)
    rec.put(("launch_overhead_s",), overhead)
    copy_ceiling(sw.copy_bytes, overhead, sw.reps, rec)


def run_part(part: str, sw: Sweep, records: str) -> None:
    from bench.gpu.records import Recorder
    rec = Recorder(records)
    if part == "copy":
        copy_part(sw, rec)
    else:
        projection_part(sw, part, rec)


# --------------------------------------------------------------------------- derived numbers (parent side)
def copy_gbps(report: dict[str, Any]) -> float | None:
    methods = report["parts"].get("copy", {}).get("results", {}).get("copy", {}).get("methods", {})
    ok = [v["GBps"] for v in methods.values() if isinstance(v, dict) and isinstance(v.get("GBps"), (int, float))]
    return max(ok) if ok else None


def derive(report: dict[str, Any]) -> dict[str, Any]:
    """From the raw records only: copy_GBps; per case GBps, copy_fraction, vs_bf16; winners."""
    copy = copy_gbps(report)
    cases: dict[str, Any] = {}
    winners: dict[str, Any] = {}
    for name in report["settings"]["projections"]:
        rows = report["parts"].get(name, {}).get("results", {}).get(name, {}).get("M", {})
        for m, row in rows.items():
            timed = {c: r for c, r in row.items() if isinstance(r, dict) and r.get("per_call_s")}
            bf16 = timed.get("bf16", {}).get("per_call_s")
            out = {}
            for case, r in timed.items():
                gbps = r["weight_bytes"] / r["per_call_s"] / 1e9
                out[case] = {"GBps": gbps, "copy_fraction": None if copy is None else gbps / copy,
                             "vs_bf16": None if bf16 is None else bf16 / r["per_call_s"]}
            cases.setdefault(name, {})[m] = out
            best = {}
            for group in ("fp8", *QDOT_FORMATS):
                mine = [c for c in timed if c.split(":")[0] == group]
                if mine:
                    best[group] = min(mine, key=lambda c: timed[c]["per_call_s"])
            if timed:
                best["overall"] = min(timed, key=lambda c: timed[c]["per_call_s"])
            winners.setdefault(name, {})[m] = best
    return {"copy_GBps": copy, "cases": cases, "winners": winners}


# --------------------------------------------------------------------------- the run (parent side)
def write(report: dict[str, Any], out: Path) -> None:
    from bench.common import write_json_atomic
    from bench.gpu.run import take_device
    take_device(report, list(report["parts"]))
    report["derived"] = derive(report)
    write_json_atomic(report, out)


def new_report(args: argparse.Namespace, sw: Sweep, device: dict, driver: dict, log_dir: Path) -> dict[str, Any]:
    from bench.gpu.run import the_command, versions
    return {"benchmark": "gpu_quant_sweep", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
            "command": the_command(), "smoke": bool(args.smoke), "device": device, "driver": driver,
            "versions": versions(),
            "settings": dataclasses.asdict(sw) | {"deadline_s": args.deadline_s, "log_dir": str(log_dir),
                                                  "int4_group_size": INT4_GROUP,
                                                  "autotune": "off: every config is timed explicitly"},
            "parts": {}, "derived": {}}


def run(args: argparse.Namespace) -> Path:
    """Every part in order, each in its own process with a timeout; the JSON rewritten after each."""
    from bench.gpu.run import open_run, part_timeouts, run_parts, run_worker
    sw = sweep_of(args)
    t0, driver, device, out, log_dir = open_run(args, "quant-sweep")
    report = new_report(args, sw, device, driver, log_dir)
    parts = ["copy", *sw.projections]
    caps = part_timeouts(parts, args.deadline_s, sw.caps_s)
    run_parts(report, parts, caps, args.deadline_s, t0,
              lambda part, timeout: run_worker(part, timeout, args.smoke, False, log_dir,
                                               module="bench.gpu.quant_sweep"),
              lambda report: write(report, out))
    return out


def tuned_rows(report: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """The rows of pallas_kernels/quant_matmul_tuned.TUNED a sweep measured, for its device kind:
    kernel name -> shape class -> the fastest timed config of each projection, M and format (int8,
    int4, q4k: quant_matmul_int4_g32_fzero, q8_0: quant_matmul_int8_g32_sym, fp8b:
    quant_matmul_fp8_g128_sym) that is still one of the tuner's candidates for that shape and is
    not already their first (the untuned default). Keys as the tuner builds them
    (jaxinfer.quant.tuning_key, bf16 rows)."""
    from jaxinfer import quant
    rows: dict[str, dict[str, dict]] = {}
    for name, (k, n) in report["settings"]["projections"].items():
        for m, row in report["parts"].get(name, {}).get("results", {}).get(name, {}).get("M", {}).items():
            for fmt, (bits, g, key_kw) in QDOT_FORMATS.items():
                cands = quant.pallas_block_candidates(int(m), k, n, bits, g, device_kind=report["device"]["kind"])
                timed = [(r["per_call_s"], r["config"]) for c, r in row.items()
                         if c.split(":")[0] == fmt and isinstance(r, dict) and r.get("per_call_s")
                         and r.get("config") in cands]
                if not timed:
                    continue
                best = min(timed, key=lambda t: t[0])[1]
                if best != cands[0]:
                    kname, key = quant.tuning_key(int(m), k, n, "bfloat16", bits=bits, group_size=g, **key_kw)
                    rows.setdefault(kname, {})[key] = best
    return rows


def summary(report: dict[str, Any]) -> str:
    """One line per projection and M: the winner per format, with its speed against bf16."""
    d = report["derived"]
    lines = [f"copy bandwidth {d['copy_GBps'] or float('nan'):.0f} GB/s"]
    for name, rows in d["winners"].items():
        for m, best in rows.items():
            cells = [f"{g}={c} ({d['cases'][name][m][c]['vs_bf16'] or float('nan'):.2f}x bf16, "
                     f"{d['cases'][name][m][c]['copy_fraction'] or float('nan'):.2f} of copy)"
                     for g, c in best.items() if g != "overall"]
            lines.append(f"{name:8s} M={m:>4s}  " + "; ".join(cells))
    return "\n".join(lines)


def sweep_of(args: argparse.Namespace) -> Sweep:
    """The run's Sweep: --smoke's or the real one, with --formats (the parent's, through FORMATS_ENV
    for the part workers) when given."""
    import os
    sw = SMOKE if args.smoke else REAL
    names = getattr(args, "formats", None) or os.environ.get(FORMATS_ENV)
    if not names:
        return sw
    formats = tuple(f for f in names.split(",") if f)
    unknown = sorted(set(formats) - set(FORMATS + GGUF_FORMATS))
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {', '.join(FORMATS + GGUF_FORMATS)}")
    os.environ[FORMATS_ENV] = ",".join(formats)
    return dataclasses.replace(sw, formats=formats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.quant_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deadline-s", type=float, default=225.0, help="the whole run's budget (default 225 s)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<device>-quant-sweep.json)")
    p.add_argument("--smoke", action="store_true", help="every code path on CPU with tiny shapes")
    p.add_argument("--log-dir", default=None, help="each part's log and records (default: a new temp folder)")
    p.add_argument("--tuned", default=None, metavar="JSON",
                   help="print the TUNED rows (pallas_kernels/quant_matmul_tuned.py) an earlier sweep's JSON "
                        "measured, and exit")
    p.add_argument("--formats", default=None,
                   help=f"comma-separated weight formats (default: {','.join(FORMATS)}; also "
                        f"{','.join(GGUF_FORMATS)}: GGUF's Q4_K and Q8_0, fine-grained FP8, as loaded); "
                        f"bf16 is always measured")
    p.add_argument("--worker", default=None, choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--records", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_part(args.worker, sweep_of(args), args.records)
        return 0
    import json
    if args.tuned:
        report = json.loads(Path(args.tuned).read_text())
        print(json.dumps({report["device"]["kind"]: tuned_rows(report)}, indent=4, sort_keys=True))
        return 0
    out = run(args)
    report = json.loads(out.read_text())
    print(summary(report))
    print(f"wrote {out}", flush=True)
    failed = [name for name, e in report["parts"].items() if e["errors"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
