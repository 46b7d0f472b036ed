"""Which token bucket a one-row decode step should be padded to on this machine.

    python -m bench.decode_bucket [--model PATH] [--buckets 1,2,4,8] [--max-decode-steps 8]

For each smallest bucket T0, a Generator (max_num_seqs=1) whose token buckets start at T0 decodes
one greedy request (prompt --prompt-len, --max-tokens new tokens) --reps times after a warm run;
decode tok/s = (N - 1) / (total - TTFT), medians, every T0 in the same run. The engine pads a step
to the smallest bucket that holds it, so T0 is what a batch-1 decode step costs. Results:
bench/results/<date>-<device>-decode-bucket.json.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import device_info, device_slug, model_path, parse_list, release, results_path, write_report


def measure(path, t0: int, prompt: list[int], n: int, reps: int, k: int) -> dict:
    from jaxinfer import Generator, SamplingParams
    from jaxinfer.config import EngineConfig
    from jaxinfer.config.resolve import resolve_token_buckets
    # the default buckets, starting at t0
    buckets = [t0] + [b for b in resolve_token_buckets(None, EngineConfig().max_num_batched_tokens) if b > t0]
    gen = Generator.from_pretrained(path, max_num_seqs=1, max_decode_steps=k, warmup=False, token_buckets=buckets)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def once() -> tuple[float, float]:
        start, ttft = time.perf_counter(), None
        for d in gen.stream(prompt, params):
            if d.token_ids and ttft is None:
                ttft = time.perf_counter() - start
        return ttft, time.perf_counter() - start

    once()
    runs = [once() for _ in range(reps)]
    ttft, total = float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs]))
    release(gen)
    return {"smallest_bucket": t0, "ttft_s": ttft, "total_s": total, "decode_tok_s": (n - 1) / (total - ttft),
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    import jax
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--buckets", default="1,2,4,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-decode-steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = model_path(args.model)
    prompt = np.random.RandomState(0).randint(3, 1000, args.prompt_len).tolist()
    points = []
    for t0 in parse_list(args.buckets):
        p = measure(path, t0, prompt, args.max_tokens, args.reps, args.max_decode_steps)
        print(f"smallest bucket {t0}: {p['decode_tok_s']:.1f} decode tok/s (TTFT {1e3 * p['ttft_s']:.1f} ms)",
              flush=True)
        points.append(p)
    info = device_info()
    report = {"benchmark": "decode bucket", "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
              "device": info, "jax": jax.__version__, "model": str(path), "config": vars(args), "points": points}
    out = results_path(args.out, device_slug(info), "decode-bucket")
    write_report(report, out, "", "", plot=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
