"""`jaxinfer bench offline | serving | peer-hf`: throughput and latency the way the field measures them.

    python -m bench.benchmark offline [--model PATH] [--dataset sharegpt-synthetic] [--num-prompts 64]
                                      [--batch-sizes 1,4,16,64] [--dtype float32]
    python -m bench.benchmark serving --url http://127.0.0.1:8000 [--model PATH] [--num-prompts 100]
                                      [--request-rates 1,2,4,8,inf]
    python -m bench.benchmark serving --launch-server --model PATH [--max-num-seqs 64 ...]
    python -m bench.benchmark peer-hf ...     (= python -m bench.peer_hf; see bench/peer_hf.py)

offline: the workload's N requests are all submitted at t=0 to one Generator's engine per batch
size (max_num_seqs), which is stepped to completion; compilation (warm-up) happens before the clock
starts. Latencies come from the engine's request timestamps; MBU / MFU from a step log (see
bench/metrics.py for every formula).
serving: against a running OpenAI-compatible server. Requests arrive as a Poisson process (gaps
exponential with mean 1 / rate; `inf` sends all at once), stream /v1/completions (prompts as token
ids, greedy, ignore_eos), and TTFT / ITL / TPOT / E2EL are measured client side from SSE chunk
arrival times. `--launch-server` starts `jaxinfer serve` on 127.0.0.1 itself and stops it at the end.

Both modes write bench/results/<date>-<device>-<mode>.json (or --out) and a PNG next to it. JSON keys:
    benchmark ("offline" | "serving"), date, device {kind, platform, count, cpu, cpu_count, loadavg}, jax,
    model, model_config {..., num_params}, config (the CLI arguments), dataset {name, source,
    num_requests, max_model_len, prompt_tokens, output_tokens}, peaks (offline: bandwidth_Bps, flops,
    source), points: [one per batch size / rate: max_num_seqs | request_rate, duration_s, completed,
    failed, total_input_tokens, total_output_tokens, request_throughput, output_throughput,
    total_token_throughput, ttft_ms, tpot_ms, itl_ms, e2el_ms ({n, mean, std, p50, p90, p99});
    offline also mbu, mfu, mbu_decode, mfu_decode, achieved_bandwidth_Bps, achieved_flops, num_steps,
    step_time_ms, num_preemptions, compilations_after_warmup].
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from bench.common import (device_info, device_slug, model_config, model_path, parse_list, release, results_path,
                          vars_of, write_report)
from bench.datasets import DATASETS, BenchRequest, build_requests, parse_range
from bench.metrics import RequestRecord, summarize
from jaxinfer.config import DTYPE_CHOICES, resolve_dtype_name
from jaxinfer.config.flags import SPECULATIVE_SETTINGS, add_engine_args


# --------------------------------------------------------------------------- shared helpers
def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


def workload(args: argparse.Namespace, path: Path, tokenizer, vocab_size: int, max_model_len: int
             ) -> tuple[list[BenchRequest], dict[str, Any]]:
    return build_requests(args.dataset, args.num_prompts, tokenizer=tokenizer, vocab_size=vocab_size,
                          max_model_len=max_model_len, model_path=path, seed=args.seed,
                          input_len=args.input_len, output_len=args.output_len,
                          input_range=parse_range(args.input_range), output_range=parse_range(args.output_range))


def _print_point(label: str, p: dict[str, Any]) -> None:
    f = lambda d: "   n/a" if d["p50"] is None else f"{d['p50']:7.1f}"  # noqa: E731
    extra = ""
    if p.get("mbu") is not None:
        extra = f"  MBU {100 * p['mbu']:5.1f}%  MFU {100 * p['mfu']:5.2f}%"
    print(f"{label:>12}: {p['output_throughput']:9.1f} out tok/s  {p['request_throughput']:7.2f} req/s  "
          f"TTFT p50 {f(p['ttft_ms'])} ms  TPOT p50 {f(p['tpot_ms'])} ms  ITL p50 {f(p['itl_ms'])} ms  "
          f"E2EL p50 {f(p['e2el_ms'])} ms{extra}", flush=True)


# --------------------------------------------------------------------------- offline
def run_offline_point(gen, requests: Sequence[BenchRequest], peaks: dict[str, Any], progress: bool = False,
                      desc: str = "") -> dict[str, Any]:
    """Submit every request at once to gen's engine, step it to completion, return the metrics."""
    from bench.metrics import ModelCost, StepLog, utilization
    from jaxinfer.config import SamplingParams

    client = gen.client
    # one short request through the whole path (compilation was done by the Generator's warm-up)
    [warm] = client.submit([list(requests[0].prompt_ids[:8])],
                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    client.run_until_done()
    client.release(warm)
    before = client.stats()
    compiles0 = before["compilations_after_warmup"] or 0
    log = StepLog(client)
    bar = progress_bar(len(requests), desc, progress)
    try:
        t0 = time.monotonic()
        rids = client.submit([list(r.prompt_ids) for r in requests],
                             [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                              for r in requests], arrival_time=t0)
        while client.has_unfinished():
            outs = log.step()
            bar.update(sum(o.finished for o in outs))
        duration = time.monotonic() - t0
    finally:
        bar.close()
        log.detach()
    after = client.stats()
    records = [RequestRecord.from_metrics(m) for rid in rids for m in client.release(rid)]
    point = summarize(records, duration)
    point |= utilization(log.steps, ModelCost.from_stats(gen.model_cfg, after), peaks.get("bandwidth_Bps"),
                         peaks.get("flops"))
    point |= {"num_preemptions": after["num_preemptions"] - before["num_preemptions"],
              "compilations_after_warmup": (after["compilations_after_warmup"] or 0) - compiles0}
    return point


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from bench.metrics import device_peaks
    from jaxinfer.config import EngineConfig
    from jaxinfer.generator import Generator, draft_model_path, load_draft
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model

    path = model_path(args.model)
    dev = device_info()
    dtype = resolve_dtype_name(args.dtype or "auto", dev["platform"])
    batch_sizes = parse_list(args.batch_sizes)
    model, cfg = load_model(path, dtype)
    tokenizer = load_tokenizer(path)
    draft_path = draft_model_path(path, args.speculative_method, args.speculative_model)
    draft = load_draft(draft_path, dtype) if draft_path is not None else None
    ctx = args.max_model_len or cfg.max_position_embeddings
    requests, dataset = workload(args, path, tokenizer, cfg.vocab_size, ctx)
    peaks = device_peaks(dev["kind"], dev["platform"], dtype, args.peak_bandwidth, args.peak_flops)
    print(f"offline: {path.name}, {len(requests)} requests ({args.dataset}, prompts from {dataset['source']}), "
          f"{dtype} on {dev['kind']}; batch sizes {batch_sizes}", flush=True)
    points = []
    for bs in batch_sizes:
        ecfg = EngineConfig(dtype=dtype, max_num_seqs=bs, block_size=args.block_size, num_blocks=args.num_blocks,
                            batching="continuous", max_model_len=args.max_model_len, kv_dtype=args.kv_dtype,
                            enable_prefix_caching=args.enable_prefix_caching,
                            speculative_method=args.speculative_method,
                            num_speculative_tokens=args.num_speculative_tokens,
                            speculative_max_batch=args.speculative_max_batch)
        gen = Generator(model, tokenizer, ecfg, args.max_num_batched_tokens,   # warm-up: compiles every shape
                        draft_model=draft)
        point = {"max_num_seqs": bs, **run_offline_point(gen, requests, peaks, args.progress, f"max_num_seqs={bs}")}
        points.append(point)
        _print_point(f"seqs={bs}", point)
        release(gen)
        del gen
    return {
        "benchmark": "offline", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
        "device": dev, "jax": jax.__version__, "model": str(path),
        "model_config": {**cfg.to_dict(), "num_params": cfg.num_params()}, "dtype": dtype,
        "config": vars_of(args), "dataset": dataset, "peaks": peaks, "points": points,
    }


# --------------------------------------------------------------------------- serving
def arrival_offsets(n: int, rate: float, rng: np.random.RandomState) -> np.ndarray:
    """Send times (s from the start) of n requests: a Poisson process of `rate` req/s (first at 0);
    rate = inf sends all at once."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"a request rate must be > 0, got {rate}")
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])


async def stream_completion(client, url: str, payload: dict[str, Any]) -> RequestRecord:
    """POST a streaming /v1/completions; time every SSE chunk that carries choices."""
    import httpx

    rec = RequestRecord(arrival=time.perf_counter(), first_token=None, finish=None,
                        prompt_tokens=len(payload["prompt"]) if isinstance(payload["prompt"], list) else 0)
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.success, rec.error = False, f"HTTP {resp.status_code}: {body[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("choices"):
                    if rec.first_token is None:
                        rec.first_token = now
                    rec.token_times.append(now)
                if obj.get("usage"):
                    usage = obj["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
        return rec
    rec.finish = rec.token_times[-1] if rec.token_times else None
    rec.output_tokens = usage["completion_tokens"] if usage else len(rec.token_times)
    if usage and not rec.prompt_tokens:
        rec.prompt_tokens = usage["prompt_tokens"]
    rec.success = rec.first_token is not None
    if not rec.success:
        rec.error = "no tokens received"
    return rec


def completion_payload(model: str, r: BenchRequest) -> dict[str, Any]:
    return {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def run_rate(url: str, model: str, requests: Sequence[BenchRequest], rate: float, seed: int = 0,
                   max_concurrency: int | None = None, timeout_s: float = 600.0, progress: bool = False
                   ) -> dict[str, Any]:
    """One request rate: Poisson sends, all streamed concurrently; the run's metrics."""
    import httpx

    offsets = arrival_offsets(len(requests), rate, np.random.RandomState(seed))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(len(requests), f"rate={rate}", progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def one(client, r: BenchRequest) -> RequestRecord:
        async with (sem if sem is not None else contextlib.nullcontext()):
            rec = await stream_completion(client, url, completion_payload(model, r))
        bar.update(1)
        return rec

    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            start = time.perf_counter()
            tasks = []
            for off, r in zip(offsets, requests):
                delay = start + off - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(client, r)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    finally:
        bar.close()
    point = {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency,
             **summarize(records, duration)}
    errors = [r.error for r in records if not r.success]
    if errors:
        point["errors"] = errors[:5]
    return point


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(args: argparse.Namespace, path: Path) -> Iterator[str]:
    """`jaxinfer serve` on 127.0.0.1 for the duration of the block; killed on exit (bounded waits)."""
    import httpx

    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", args.served_model_name or "bench",
           "--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", str(args.block_size)]
    cmd += ["--dtype", resolve_dtype_name(args.dtype or "auto", device_info()["platform"])]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.num_blocks:
        cmd += ["--num-blocks", str(args.num_blocks)]
    if args.kv_dtype:
        cmd += ["--kv-dtype", args.kv_dtype]
    if not args.enable_prefix_caching:
        cmd += ["--no-prefix-caching"]
    if args.speculative_method:
        cmd += ["--speculative-method", args.speculative_method,
                "--num-speculative-tokens", str(args.num_speculative_tokens)]
        if args.speculative_model:
            cmd += ["--speculative-model", args.speculative_model]
        if args.speculative_max_batch is not None:
            cmd += ["--speculative-max-batch", str(args.speculative_max_batch)]
    log = tempfile.NamedTemporaryFile("w+", prefix="jaxinfer-bench-server-", suffix=".log", delete=False)
    print(f"launching: {' '.join(cmd)}  (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    failed = True
    try:
        deadline = time.monotonic() + args.server_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy in {args.server_timeout} s (log: {log.name})")
            time.sleep(0.5)
        yield url
        failed = False
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        if not failed:
            os.unlink(log.name)


def server_model(url: str, name: str | None) -> tuple[str, int | None]:
    import httpx
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    entry = next((m for m in data if name is None or m["id"] == name), data[0])
    return name or entry["id"], entry.get("max_model_len")


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from jaxinfer.tokenizer import load_tokenizer

    path = model_path(args.model)
    cfg = model_config(path)
    tokenizer = load_tokenizer(path)
    rates = parse_list(args.request_rates, float)
    with (launched_server(args, path) if args.launch_server else contextlib.nullcontext(args.url)) as url:
        url = url.rstrip("/")
        name, ctx = server_model(url, args.served_model_name)
        ctx = ctx or args.max_model_len or cfg.max_position_embeddings
        requests, dataset = workload(args, path, tokenizer, cfg.vocab_size, ctx)
        print(f"serving: {url} ({name}), {len(requests)} requests per rate ({args.dataset}, prompts from "
              f"{dataset['source']}); rates {rates}", flush=True)
        warm = asyncio.run(run_rate(url, name, [BenchRequest(requests[0].prompt_ids[:8], 4)], math.inf,
                                    timeout_s=args.request_timeout))
        if warm["completed"] != 1:
            raise RuntimeError(f"the warm-up request failed: {warm.get('errors')}")
        points = []
        for rate in rates:
            point = asyncio.run(run_rate(url, name, requests, rate, args.seed, args.max_concurrency,
                                         args.request_timeout, args.progress))
            points.append(point)
            _print_point(f"rate={point['request_rate']}", point)
    return {
        "benchmark": "serving", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
        "device": device_info(), "jax": jax.__version__, "model": str(path), "url": url, "served_model_name": name,
        "launched_server": bool(args.launch_server),
        "model_config": {**cfg.to_dict(), "num_params": cfg.num_params()},
        "config": vars_of(args), "dataset": dataset, "points": points,
    }


# --------------------------------------------------------------------------- CLI
def _workload_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the bundled model); serving: for "
                   "its tokenizer, heldout.txt and config (and --launch-server)")
    p.add_argument("--dataset", default="sharegpt-synthetic",
                   help=f"one of {', '.join(DATASETS)} (default: sharegpt-synthetic)")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=128, help="fixed: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="fixed: output tokens")
    p.add_argument("--input-range", default="16,256", help="uniform: min,max prompt tokens")
    p.add_argument("--output-range", default="16,256", help="uniform: min,max output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-<device>-<mode>.json)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--dtype", default=None, choices=[d for d in DTYPE_CHOICES if d != "auto"],
                   help="default: float32 on CPU, bfloat16 elsewhere (serving: passed to a launched server)")
    # the engine's own flags (serving: passed to a launched server)
    add_engine_args(p, only=("max_num_batched_tokens", "max_model_len", "block_size", "num_blocks", "kv_dtype",
                             "enable_prefix_caching", *SPECULATIVE_SETTINGS))


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench offline | serving | peer-hf` to a CLI's subparsers (jaxinfer/cli.py)."""
    b = subparsers.add_parser("bench", help="benchmarks: offline throughput, online serving, HF peer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_modes(b)
    return b


def _add_modes(b: argparse.ArgumentParser) -> None:
    modes = b.add_subparsers(dest="bench_mode", required=True)

    off = modes.add_parser("offline", help="all requests at once through the engine, per batch size")
    _workload_args(off, 64)
    off.add_argument("--batch-sizes", default="1,4,16,64", help="max_num_seqs values to sweep")
    off.add_argument("--peak-bandwidth", type=float, default=None, help="B/s for MBU (default: table / measured)")
    off.add_argument("--peak-flops", type=float, default=None, help="FLOP/s for MFU (default: table / measured)")
    off.set_defaults(func=cmd_bench)

    sv = modes.add_parser("serving", help="Poisson arrivals against an OpenAI-compatible server")
    _workload_args(sv, 100)
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--request-rates", default="1,2,4,8,inf", help="req/s, comma-separated; inf = all at once")
    sv.add_argument("--max-concurrency", type=int, default=None)
    sv.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--launch-server", action="store_true", help="start `jaxinfer serve --model` on 127.0.0.1")
    sv.add_argument("--port", type=int, default=None, help="--launch-server: port (default: a free one)")
    add_engine_args(sv, only=("max_num_seqs",))   # --launch-server: the server's
    sv.add_argument("--server-timeout", type=float, default=600.0, help="--launch-server: start-up limit (s)")
    sv.set_defaults(func=cmd_bench)

    from bench.peer_hf import add_arguments as peer_args
    ph = modes.add_parser("peer-hf", help="side by side with HF transformers on the same weights (CPU)")
    peer_args(ph)
    ph.set_defaults(func=cmd_bench)

    from bench.gpu import run as gpu
    gp = modes.add_parser("gpu", help="everything GPU-specific in one call: ceilings, the 8B-shaped model, "
                                      "kernels, HF (= python -m bench.gpu)",
                          description=gpu.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu.add_arguments(gp)
    gp.set_defaults(func=gpu.command)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_mode == "peer-hf":
        from bench.peer_hf import run_and_report
        run_and_report(args)
        return 0
    report = run_offline(args) if args.bench_mode == "offline" else run_serving(args)
    slug = device_slug(report["device"]) if args.bench_mode == "offline" else _serving_slug(report)
    out = results_path(args.out, slug, args.bench_mode)
    label = "max_num_seqs" if args.bench_mode == "offline" else "request_rate"
    title = (f"{args.bench_mode}: {Path(report['model']).name} on {report['device']['kind']}, "
             f"{report['dataset']['name']}, {report['dataset']['num_requests']} requests")
    png = write_report(report, out, label, title, args.plot)
    print(f"wrote {out}" + (f" and {png}" if png else ""), flush=True)
    return 0


def _serving_slug(report: dict[str, Any]) -> str:
    # the server's device is not visible to the client: assume this machine's when the server is local
    from urllib.parse import urlparse
    local = report["launched_server"] or urlparse(report["url"]).hostname in ("127.0.0.1", "localhost", "::1")
    return device_slug(report["device"]) if local else "remote"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_modes(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.benchmark offline|serving|peer-hf ...` (the same flags as `jaxinfer bench`)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"bench {args.bench_mode}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
