"""Embeddings: gen.embed against sentence-transformers on the same weights, float32 on CPU, in one run.

    python -m bench.embed [--model PATH] [--batch-sizes 1,64] [--length-range 16,256] [--reps 3]

The model (default: the bundled one) is exported with jaxinfer.export.export_hf into a temporary
folder and made a sentence-transformers folder there (modules.json: Transformer, Pooling with
--pooling, Normalize), which both sides load: ours with Generator.from_pretrained (the engine's
defaults but for dtype float32 and the prefix cache off: the passes repeat the same texts),
sentence-transformers with SentenceTransformer(folder, device="cpu") (float32, at each
--torch-threads count). Both embed the same texts, windows of --length-range
tokens decoded from the model's heldout.txt (each side tokenizes them itself; the token counts
match, since both read the same tokenizer files), both end to end: text in, normalized vectors out.

For each batch size B: the texts are cut into batches of B; ours embeds a batch with one
gen.embed call, sentence-transformers with one encode(batch, batch_size=B) call; sequences/s =
B / (median wall time of a batch) over --reps passes over the batches; the sides alternate pass by
pass (ours, sentence-transformers, ours, ...) so that the machine's drift reaches both alike, and
sentence-transformers runs in a process of its own (torch's OpenMP threads spin after each call and
would slow a jax step run beside them), at each --torch-threads count: its best counts. One warm-up
batch per side and pass first. The
report keeps the same-run ratio ours / sentence-transformers and the largest per-vector difference
between the two (cosine, max abs) as a check that both computed the same thing.
Writes bench/results/<date>-<device>-embed.json.
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
from typing import Any

import numpy as np

from bench.common import device_info, device_slug, model_path, parse_list, results_path, vars_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--length-range", default="16,256", help="text lengths in tokens, lo,hi (uniform)")
    p.add_argument("--num-texts", type=int, default=64, help="texts per pass (a multiple of every batch size)")
    p.add_argument("--batch1-texts", type=int, default=16, help="texts per pass at batch size 1")
    p.add_argument("--reps", type=int, default=3, help="passes over the texts per side")
    p.add_argument("--pooling", default="lasttoken", choices=("lasttoken", "mean", "cls"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", default=f"1,{os.cpu_count() or 1}",
                   help="sentence-transformers runs at each torch thread count; its best counts")
    p.add_argument("--side", default="both", choices=("both", "st"), help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results JSON (default: bench/results/<date>-<device>-embed.json)")


def st_folder(model_dir: Path, out: Path, pooling: str) -> Path:
    """The model at model_dir as a sentence-transformers folder at out (HF export + ST's files)."""
    from jaxinfer.export import export_hf
    from jaxinfer.tokenizer import load_tokenizer
    from jaxinfer.weights import load_model

    model, cfg = load_model(model_dir, "float32")
    export_hf(model, out, load_tokenizer(model_dir))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "2_Normalize").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": cfg.d_model,
                                                               "pooling_mode": pooling}))
    return out


def texts(model_dir: Path, tok, n: int, length_range: str, seed: int) -> list[str]:
    """n texts of token lengths uniform in the range, decoded from windows of heldout.txt."""
    from bench.datasets import cut_prompts, parse_range, token_pool

    lo, hi = parse_range(length_range)
    rng = np.random.RandomState(seed)
    pool, _ = token_pool(tok, tok.vocab_size, model_dir, rng, hi)
    return [tok.decode(ids) for ids in cut_prompts(pool, rng.randint(lo, hi + 1, n), rng)]


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def _batches(data: list[str], b: int) -> list[list[str]]:
    return [data[i: i + b] for i in range(0, len(data), b)]


def _workload(args: argparse.Namespace, src: Path, tok) -> dict[int, tuple[list[str], list[str]]]:
    """Per batch size: (one warm-up batch, the timed texts)."""
    out = {}
    for b in parse_list(args.batch_sizes):
        n = args.batch1_texts if b == 1 else args.num_texts
        n = max(b, n // b * b)
        data = texts(src, tok, n + b, args.length_range, args.seed + b)
        out[b] = (data[:b], data[b:])
    return out


def time_ours(gen, workload: dict, reps: int, times: dict) -> dict[int, np.ndarray]:
    """gen.embed per batch: wall times appended to times[b]; the vectors of the last pass."""
    vectors = {}
    for b, (warm, data) in workload.items():
        gen.embed(warm)
        times.setdefault(b, [])
        for _ in range(reps):
            got = []
            for batch in _batches(data, b):
                t0 = time.perf_counter()
                got.append(gen.embed(batch))
                times[b].append(time.perf_counter() - t0)
        vectors[b] = np.concatenate(got)
    return vectors


def time_st(folder: Path, workload: dict, reps: int, threads: list[int]) -> dict[str, Any]:
    """sentence-transformers' encode per batch at each torch thread count (this process runs no jax:
    torch's OpenMP threads spin after each call and would slow a jax step run next to them)."""
    import sentence_transformers
    import torch
    st = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    out: dict[str, Any] = {"times": {}, "vectors": {}, "version": sentence_transformers.__version__,
                           "torch": torch.__version__}
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for b, (warm, data) in workload.items():
            st.encode(warm, batch_size=b, convert_to_numpy=True)
            ts, got = [], []
            for _ in range(reps):
                got = []
                for batch in _batches(data, b):
                    t0 = time.perf_counter()
                    got.append(st.encode(batch, batch_size=b, convert_to_numpy=True))
                    ts.append(time.perf_counter() - t0)
            out["times"][f"{b}/{n_threads}"] = ts
            out["vectors"][b] = np.concatenate(got)
    return out


def _st_child(args: argparse.Namespace) -> int:
    """--side st: time sentence-transformers on the workload file; write times and vectors."""
    work = json.loads(Path(args.workload).read_text())
    workload = {int(b): tuple(v) for b, v in work["batches"].items()}
    res = time_st(Path(work["folder"]), workload, args.reps, parse_list(args.torch_threads))
    np.savez(Path(args.workload).with_suffix(".npz"), **{str(b): v for b, v in res.pop("vectors").items()})
    Path(args.workload).with_suffix(".out.json").write_text(json.dumps(res))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import subprocess

    import jax

    from jaxinfer import Generator

    src = model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="jaxinfer-bench-embed-"))
    try:
        folder = st_folder(src, tmp / "st", args.pooling)
        # every pass embeds the same texts: the prefix cache would hold them after the first (last-token
        # pooling recomputes only the last token of a cached prompt), and sentence-transformers has none
        gen = Generator.from_pretrained(folder, dtype="float32", enable_prefix_caching=False)
        workload = _workload(args, src, gen.tokenizer)
        work_file = tmp / "workload.json"
        work_file.write_text(json.dumps({"folder": str(folder), "batches": {b: v for b, v in workload.items()}}))
        # the sides alternate, one pass each, `reps` times (the machine's speed drifts; torch runs in
        # a process of its own: its OpenMP threads spin after each call and would slow a jax step)
        ours_times: dict[int, list[float]] = {}
        st_times: dict[str, list[float]] = {}
        for _ in range(args.reps):
            ours_vectors = time_ours(gen, workload, 1, ours_times)
            subprocess.run([sys.executable, "-m", "bench.embed", "--side", "st", "--workload", str(work_file),
                            "--reps", "1", "--torch-threads", args.torch_threads], check=True)
            st = json.loads(work_file.with_suffix(".out.json").read_text())
            for k, v in st["times"].items():
                st_times.setdefault(k, []).extend(v)
        st["times"] = st_times
        resolved = gen.client.resolved
        engine = {k: getattr(resolved, k) for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                                    "block_size", "attention")}
        n_tokens = {b: float(np.mean([len(gen.tokenizer.encode(t)) for t in data])) for b, (_, data) in workload.items()}
        st_vectors = np.load(work_file.with_suffix(".npz"))
        points, worst_cos, worst_abs = [], 1.0, 0.0
        for b in workload:
            mine, theirs = ours_vectors[b], st_vectors[str(b)]
            cos = np.sum(mine * theirs, axis=1) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))
            worst_cos, worst_abs = min(worst_cos, float(cos.min())), max(worst_abs, float(np.abs(mine - theirs).max()))
            by_threads = {int(k.split("/")[1]): b / _median(v) for k, v in st["times"].items()
                          if int(k.split("/")[0]) == b}
            best = max(by_threads, key=by_threads.get)
            ours_sps = b / _median(ours_times[b])
            points.append({"batch_size": b, "texts": len(workload[b][1]), "mean_tokens": n_tokens[b],
                           "batches_timed": len(ours_times[b]), "ours_seqs_per_s": ours_sps,
                           "st_seqs_per_s": by_threads[best], "st_torch_threads": best,
                           "st_seqs_per_s_by_threads": by_threads, "ratio": ours_sps / by_threads[best],
                           "ours_median_batch_s": _median(ours_times[b])})
            print(f"batch {b:3d}: ours {ours_sps:8.2f} seq/s  sentence-transformers {by_threads[best]:8.2f} seq/s "
                  f"({best} torch threads)  ratio {ours_sps / by_threads[best]:.2f}", flush=True)
        return {"benchmark": "embed", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
                "device": device_info(), "jax": jax.__version__, "torch": st["torch"],
                "sentence_transformers": st["version"], "dtype": "float32", "model": str(src),
                "pooling": args.pooling, "engine": engine, "config": vars_of(args),
                "max_vector_abs_diff": worst_abs, "min_vector_cosine": worst_cos, "points": points}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.side == "st":
        return _st_child(args)
    report = run(args)
    out = results_path(args.out, device_slug(report["device"]), "embed")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
