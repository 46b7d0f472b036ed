"""Where a decode step's time goes: XLA's own per-op trace of the engine's jitted step.

    python bench/profile_step.py [--model PATH] [--batch-sizes 1,64] [--out bench/results/...json]

For each batch size: `b` greedy requests (prompts of 16..128 tokens) are run until every one is
decoding, then the same decode step is timed (median of --reps, no profiler) and traced
(jax.profiler, --trace-steps steps). The trace's per-thunk events are summed per source op (the
`op_name` XLA keeps from the jnp call that made it: a dot's einsum spec, gather, exp, ...), so the
JSON says which parts of the model the step spends its time in. Traced times run about 1.3-2x the
untraced step (the profiler's own cost); compare shares, not absolute values.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import device_info, device_slug, results_path, write_report
from jaxinfer import Generator, SamplingParams
from jaxinfer.generator import default_model_path


def decode_step_inputs(gen: Generator, batch: int, seed: int):
    """Run `batch` requests until all are decoding; returns the runner's inputs for the next step."""
    client = gen.client
    rng = np.random.RandomState(seed)
    vocab = gen.model_cfg.vocab_size
    client.submit([rng.randint(3, vocab, rng.randint(16, 129)).tolist() for _ in range(batch)],
                  SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    decoding: list[bool] = []
    observe = lambda t: decoding.append(len(t.spans) == batch and all(n == 1 for _, n in t.spans))  # noqa: E731
    client.add_step_observer(observe)
    while not (decoding and decoding[-1]):   # step until one step decoded every sequence
        client.step()
    client.remove_step_observer(observe)
    return client.debug.next_step_inputs()


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the op_name metadata of the jnp call that produced it."""
    return {m.group(1): m.group(2) for m in re.finditer(r'^\s*%?(\S+) = .*?op_name="([^"]+)"', hlo_text, re.M)}


def profile(gen: Generator, batch: int, reps: int, trace_steps: int, seed: int) -> dict:
    client = gen.client
    inputs, iters = decode_step_inputs(gen, batch, seed)
    names = op_names(client.debug.step_hlo(inputs))

    def step():
        client.debug.replay_step(inputs)

    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(trace_steps):
                step()
        trace = json.load(gzip.open(next(Path(d).rglob("*perfetto_trace.json.gz"))))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_op: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        hlo_op = e.get("args", {}).get("hlo_op") if e.get("ph") == "X" else None
        if hlo_op is None or e["name"].startswith("end:"):
            continue
        op = re.sub(r"^jit\([^)]*\)/|while/body/", "", names.get(hlo_op, hlo_op))
        if op.rsplit("/", 1)[-1] in ("cond", "while"):
            continue   # a conditional's or loop's own event spans the ops inside it, counted themselves
        by_op[op] += e["dur"]
        count[op] += 1
    total = sum(by_op.values())
    return {
        "batch": batch, "tokens_bucket": int(len(inputs.tokens)), "seqs_bucket": int(len(inputs.logits_indices)),
        "context_bucket": int(inputs.meta.block_tables.shape[1] * gen.client.resolved.block_size),
        "max_context": int(np.max(inputs.meta.context_lens)), "decode_iterations_per_step": iters,
        "step_median_ms": 1e3 * float(np.median(times)), "traced_step_ms": total / 1e3 / trace_steps,
        "per_token_ms": 1e3 * float(np.median(times)) / iters,
        "ops": [{"op": op, "ms_per_step": us / 1e3 / trace_steps, "share": us / total,
                 "calls_per_step": count[op] / trace_steps} for op, us in by_op.most_common(25)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trace-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-decode-steps", type=int, default=8, help="decode iterations per step (1: off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    results = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        gen = Generator.from_pretrained(path, dtype=args.dtype, max_num_seqs=b, max_decode_steps=args.max_decode_steps,
                                        async_scheduling=False)   # the profiled step reads no in-flight tokens
        r = profile(gen, b, args.reps, args.trace_steps, args.seed)
        print(f"batch {b}: step {r['step_median_ms']:.2f} ms for {r['decode_iterations_per_step']} iterations "
              f"(T={r['tokens_bucket']}, L={r['context_bucket']}); "
              + ", ".join(f"{o['op'][:40]} {100 * o['share']:.0f}%" for o in r["ops"][:6]), flush=True)
        results.append(r)
        del gen
    info = device_info()
    report = {"benchmark": "decode step profile", "date": time.strftime("%Y-%m-%d"), "model": str(path),
              "device": info, "jax": jax.__version__, "config": vars(args), "results": results}
    out = results_path(args.out, device_slug(info), "step-profile")
    write_report(report, out, "", "", plot=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
