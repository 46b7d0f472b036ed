"""Side by side with Hugging Face transformers on the same weights, float32 on CPU, in one run.

    python -m bench.peer_hf [--model PATH] [--max-tokens 128] [--num-requests 64]
    (also `jaxinfer bench peer-hf ...`)

The model is exported with jaxinfer.export.export_hf into a temporary folder and loaded by
transformers (AutoModelForCausalLM, float32, torch.inference_mode, torch.set_num_threads(cpu count)).
Both sides decode greedily and ignore EOS (ours: ignore_eos=True; HF: min_new_tokens = max_new_tokens),
so every request yields exactly --max-tokens tokens from the same prompt token ids.

(a) single stream: one prompt of --prompt-len tokens, N = --max-tokens new tokens.
    ours: Generator(max_num_seqs=1).stream; TTFT = first streamed token; total = last token.
    HF:   TTFT = time of generate(max_new_tokens=1); total = time of generate(max_new_tokens=N).
    decode tokens/s = (N - 1) / (median total - median TTFT), for both; medians of --reps runs after
    one warm-up run. `greedy_match_prefix`: how many leading tokens the two greedy outputs share.
(b) batched: --num-requests prompts (lengths uniform in --prompt-range), N new tokens each.
    ours: one Generator(max_num_seqs=--max-num-seqs), all requests submitted at once (continuous batching);
    HF sequential: one generate per request; HF batched: left-padded batches of each --hf-batch-sizes
    with each --hf-caches ("static" = cache_implementation="static", "dynamic" = the default cache),
    in request order; the best (highest tokens/s) counts. Throughput = output tokens / wall time.
Warm-ups are outside the timings. Writes bench/results/<date>-<device>-peer-hf.json and a PNG bar chart.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.common import device_info, device_slug, model_path, parse_list, release, results_path, vars_of
from jaxinfer.config.flags import add_engine_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the bundled model); Llama family")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request, both benchmarks")
    p.add_argument("--prompt-len", type=int, default=64, help="single stream: prompt tokens")
    p.add_argument("--reps", type=int, default=3, help="single stream: timed runs per side")
    p.add_argument("--num-requests", type=int, default=64, help="batched: requests")
    p.add_argument("--prompt-range", default="16,128", help="batched: min,max prompt tokens (uniform)")
    add_engine_args(p, only=("max_num_seqs", "max_num_batched_tokens"))   # batched: ours
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--hf-caches", default="static,dynamic")
    p.add_argument("--skip-hf-sequential", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-<device>-peer-hf.json)")
    p.add_argument("--no-plot", dest="plot", action="store_false")


def _median(xs: Sequence[float]) -> float:
    return float(np.median(xs))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def hf_generate(hf, pad: int, ids: list[list[int]], new: int, cache: str | None = None):
    """Greedy HF generate of exactly `new` tokens per prompt, left-padded into one batch -> [B, new]."""
    import torch

    width = max(len(p) for p in ids)
    x = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, p in enumerate(ids):          # left padding
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = {"cache_implementation": cache} if cache else {}
    out = hf.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=new,
                      min_new_tokens=new, pad_token_id=pad, **kw)
    return out[:, width:]


def _workload(args: argparse.Namespace, tok, cfg, path: Path):
    """-> (single-stream prompt, batched prompts, (lo, hi) prompt range, prompts' source): cut from
    one token pool with --seed, the batched lengths capped so that prompt + --max-tokens fits."""
    from bench.datasets import cut_prompts, parse_range, token_pool

    n_new, ctx = args.max_tokens, cfg.max_position_embeddings
    lo, hi = parse_range(args.prompt_range)
    if args.prompt_len + n_new > ctx or lo + n_new > ctx:
        raise ValueError(f"prompt + --max-tokens {n_new} exceeds the model's context ({ctx})")
    hi = min(hi, ctx - n_new)
    rng = np.random.RandomState(args.seed)
    pool, source = token_pool(tok, cfg.vocab_size, path, rng, max(hi, args.prompt_len))
    single_prompt = cut_prompts(pool, [args.prompt_len], rng)[0]
    prompts = cut_prompts(pool, rng.randint(lo, hi + 1, args.num_requests), rng)
    return single_prompt, prompts, (lo, hi), source


def _hf_model(model, tok):
    """Our model exported to the HF layout (a temporary folder) and loaded by transformers, float32."""
    import torch
    import transformers

    from jaxinfer.export import export_hf

    tmp = Path(tempfile.mkdtemp(prefix="jaxinfer-peer-hf-"))
    try:
        export_hf(model, tmp, tok)
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _side(n_new: int, ttft: float, total: float, ttfts: list[float], totals: list[float]) -> dict[str, Any]:
    return {"ttft_s": ttft, "total_s": total, "decode_tok_s": (n_new - 1) / (total - ttft),
            "e2e_tok_s": n_new / total, "ttft_runs_s": ttfts, "total_runs_s": totals}


def single_stream(args: argparse.Namespace, model, tok, hf, pad: int, prompt: list[int]) -> dict[str, Any]:
    """(a): one prompt, --max-tokens new tokens, --reps timed runs per side after one warm-up."""
    import torch

    from jaxinfer.config import EngineConfig, SamplingParams
    from jaxinfer.generator import Generator

    n_new = args.max_tokens
    greedy = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    gen1 = Generator(model, tok, EngineConfig(dtype="float32", max_num_seqs=1), args.max_num_batched_tokens)

    def ours_once() -> tuple[float, float, list[int]]:
        t0, ttft, ids = time.perf_counter(), None, []
        for d in gen1.stream(prompt, greedy):
            if d.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            ids += d.token_ids
        return ttft, time.perf_counter() - t0, ids

    ours_once()
    runs = [ours_once() for _ in range(args.reps)]
    ours_ids = runs[0][2]
    o_ttft, o_total = _median([r[0] for r in runs]), _median([r[1] for r in runs])
    release(gen1)
    del gen1

    with torch.inference_mode():
        hf_generate(hf, pad, [prompt], 2)
        h_ttfts = [_timed(lambda: hf_generate(hf, pad, [prompt], 1))[0] for _ in range(args.reps)]
        h_runs = [_timed(lambda: hf_generate(hf, pad, [prompt], n_new)) for _ in range(args.reps)]
    hf_ids = h_runs[0][1][0].tolist()
    h_ttft, h_total = _median(h_ttfts), _median([r[0] for r in h_runs])

    single = {
        "prompt_len": len(prompt), "max_tokens": n_new, "reps": args.reps,
        "ours": _side(n_new, o_ttft, o_total, [r[0] for r in runs], [r[1] for r in runs]),
        "hf": _side(n_new, h_ttft, h_total, h_ttfts, [r[0] for r in h_runs]),
        "greedy_match_prefix": _common_prefix(ours_ids, hf_ids),
    }
    single["decode_ratio"] = single["ours"]["decode_tok_s"] / single["hf"]["decode_tok_s"]
    print(f"single stream decode: ours {single['ours']['decode_tok_s']:8.1f} tok/s, HF "
          f"{single['hf']['decode_tok_s']:8.1f} tok/s -> {single['decode_ratio']:.2f}x  (TTFT ours "
          f"{1000 * o_ttft:.1f} ms, HF {1000 * h_ttft:.1f} ms; greedy outputs agree on "
          f"{single['greedy_match_prefix']}/{n_new} tokens)", flush=True)
    return single


def batched_ours(args: argparse.Namespace, model, tok, prompts: list[list[int]]) -> dict[str, Any]:
    """(b), ours: every request submitted at once to one Generator (continuous batching)."""
    from jaxinfer.config import EngineConfig, SamplingParams
    from jaxinfer.generator import Generator

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    genb = Generator(model, tok, EngineConfig(dtype="float32", max_num_seqs=args.max_num_seqs),
                     args.max_num_batched_tokens)
    genb.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    dt, outs = _timed(lambda: genb.generate(prompts, greedy))
    n_out = sum(len(o.token_ids) for o in outs)
    ours_b = {"max_num_seqs": args.max_num_seqs, "wall_s": dt, "output_tokens": n_out, "tok_s": n_out / dt}
    release(genb)
    del genb, outs
    print(f"batched, {len(prompts)} requests x {args.max_tokens} tokens: ours {ours_b['tok_s']:8.1f} tok/s",
          flush=True)
    return ours_b


def batched_hf(args: argparse.Namespace, hf, pad: int, prompts: list[list[int]]
               ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(b), HF: one generate per request (unless --skip-hf-sequential), then left-padded batches of
    each --hf-batch-sizes with each --hf-caches -> (sequential, [batched entries])."""
    import torch
    from tqdm.auto import tqdm

    n_new = args.max_tokens
    hf_seq = None
    with torch.inference_mode():
        if not args.skip_hf_sequential:
            dt, n_out = _timed(lambda: sum(hf_generate(hf, pad, [p], n_new).numel()
                                           for p in tqdm(prompts, desc="HF sequential", leave=False)))
            hf_seq = {"wall_s": dt, "output_tokens": n_out, "tok_s": n_out / dt}
            print(f"  HF sequential              {hf_seq['tok_s']:8.1f} tok/s", flush=True)
        hf_batched = []
        for cache in parse_list(args.hf_caches, str):
            for bs in parse_list(args.hf_batch_sizes):
                hf_batched.append(_hf_batched_entry(hf, pad, prompts, n_new, cache, bs))
    return hf_seq, hf_batched


def _hf_batched_entry(hf, pad: int, prompts: list[list[int]], n_new: int, cache: str, bs: int) -> dict[str, Any]:
    """One HF batched run (cache kind, batch size) after a warm-up; an error instead where this
    transformers / device cannot run the cache kind."""
    entry: dict[str, Any] = {"cache": cache, "batch_size": bs}
    kind = None if cache == "dynamic" else cache
    try:
        hf_generate(hf, pad, prompts[:bs], 2, kind)
        dt, n_out = _timed(lambda: sum(hf_generate(hf, pad, prompts[i: i + bs], n_new, kind).numel()
                                       for i in range(0, len(prompts), bs)))
        entry |= {"wall_s": dt, "output_tokens": n_out, "tok_s": n_out / dt}
        print(f"  HF batched {cache:>7} bs={bs:<4}  {entry['tok_s']:8.1f} tok/s", flush=True)
    except Exception as e:  # a cache kind this transformers / device cannot run
        entry["error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  HF batched {cache:>7} bs={bs:<4}  failed: {entry['error'][:120]}", flush=True)
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import torch
    import transformers

    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = model_path(args.model)
    model, cfg = load_model(path, "float32")
    tok = load_tokenizer(path)
    single_prompt, prompts, (lo, hi), source = _workload(args, tok, cfg, path)
    pad = tok.pad_id if tok is not None and tok.pad_id is not None else 0
    hf = _hf_model(model, tok)
    print(f"peer-hf: {path.name} ({cfg.num_params():,} params), float32, jax {jax.__version__} on "
          f"{jax.devices()[0].platform} vs transformers {transformers.__version__} / torch {torch.__version__} "
          f"({threads} threads)", flush=True)

    single = single_stream(args, model, tok, hf, pad, single_prompt)
    ours_b = batched_ours(args, model, tok, prompts)
    hf_seq, hf_batched = batched_hf(args, hf, pad, prompts)
    ok = [e for e in hf_batched if "tok_s" in e]
    best = max(ok, key=lambda e: e["tok_s"]) if ok else None
    batched = {
        "num_requests": len(prompts), "max_tokens": args.max_tokens, "prompt_range": [lo, hi],
        "ours": ours_b, "hf_sequential": hf_seq, "hf_batched": hf_batched, "hf_best": best,
        "ratio_vs_hf_sequential": ours_b["tok_s"] / hf_seq["tok_s"] if hf_seq else None,
        "ratio_vs_hf_best": ours_b["tok_s"] / best["tok_s"] if best else None,
    }
    for key, name in (("ratio_vs_hf_sequential", "HF sequential"), ("ratio_vs_hf_best", "HF best batched")):
        if batched[key] is not None:
            print(f"ours / {name}: {batched[key]:.2f}x", flush=True)
    return {
        "benchmark": "peer-hf", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
        "device": device_info(), "jax": jax.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "torch_threads": threads, "dtype": "float32",
        "model": str(path), "num_params": cfg.num_params(), "prompts_from": source,
        "config": vars_of(args), "single_stream": single, "batched": batched,
    }


def plot(report: dict[str, Any], png: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, b = report["single_stream"], report["batched"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = [("jaxinfer", s["ours"]["decode_tok_s"]), ("HF", s["hf"]["decode_tok_s"])]
    axes[0].bar([n for n, _ in bars], [v for _, v in bars], color=["tab:blue", "tab:orange"])
    axes[0].set_title(f"single stream decode ({s['max_tokens']} tokens)", fontsize=10)
    bars = [("jaxinfer\ncontinuous", b["ours"]["tok_s"])]
    if b["hf_sequential"]:
        bars.append(("HF\nsequential", b["hf_sequential"]["tok_s"]))
    bars += [(f"HF {e['cache']}\nbs={e['batch_size']}", e["tok_s"]) for e in b["hf_batched"] if "tok_s" in e]
    axes[1].bar([n for n, _ in bars], [v for _, v in bars],
                color=["tab:blue"] + ["tab:orange"] * (len(bars) - 1))
    axes[1].set_title(f"batched: {b['num_requests']} requests x {b['max_tokens']} tokens", fontsize=10)
    axes[1].tick_params(axis="x", labelsize=8)
    for ax in axes:
        ax.set_ylabel("output tokens/s")
        ax.grid(axis="y", alpha=0.3)
        for patch in ax.patches:
            ax.annotate(f"{patch.get_height():.0f}", (patch.get_x() + patch.get_width() / 2, patch.get_height()),
                        ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{Path(report['model']).name}, float32, {report['device']['cpu']} "
                 f"({report['torch_threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def run_and_report(args: argparse.Namespace) -> dict[str, Any]:
    report = run(args)
    out = results_path(args.out, device_slug(report["device"]), "peer-hf")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot(report, out.with_suffix(".png")) if args.plot else None
    print(f"wrote {out}" + (f" and {png}" if png else ""), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # a CPU comparison, even on a machine with a GPU
    p = argparse.ArgumentParser(prog="python -m bench.peer_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run_and_report(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"peer-hf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
