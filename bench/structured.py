"""Structured outputs: throughput of constrained requests vs the same requests unconstrained, same run.

    python -m bench.structured [--model PATH] [--reps 5] [--num-requests 64] [--output-len 64] [--out PATH]

--num-requests prompts (held-out text of the bundled model, --prompt-len tokens each), all submitted
at t=0, --output-len tokens each, greedy. Two workloads:
  schema:       every request under a JSON schema whose one string field never closes within
                --output-len tokens ({"story": string}), so constrained and free requests generate the
                same number of tokens and the ratio is the cost of the constraint alone (mask fill on
                the host, the mask on device, one draw per step, the synchronous step);
  free:         the same requests unconstrained (ignore_eos, so they too run --output-len tokens).
The two alternate --reps times on one warmed-up Generator; the report gives output tokens per
second (median), the median of the paired (back-to-back) ratios, and the host time spent filling
masks per constrained step. Results: bench/results/<date>-<device>-structured.json.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench import prefix_cache
from bench.common import device_info, device_slug, model_path, results_path, write_report
from jaxinfer.config.flags import add_engine_args

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
          "additionalProperties": False}


def run_batch(gen, prompts: list[list[int]], params) -> dict:
    """prefix_cache.run_batch's run, with the host time spent filling grammar masks."""
    mask0 = gen.client.stats()["grammar_mask_time_s"]
    r = prefix_cache.run_batch(gen, prompts, params.max_tokens, params)
    return {"wall_s": r["wall_s"], "output_tokens": r["output_tokens"], "output_tok_s": r["output_tokens"] / r["wall_s"],
            "steps": r["steps"], "mask_time_s": gen.client.stats()["grammar_mask_time_s"] - mask0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    # max_decode_steps: free rows only; constrained rows draw one per step
    add_engine_args(ap, only=("max_num_seqs", "max_num_batched_tokens", "max_decode_steps"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from jaxinfer import Generator, SamplingParams, StructuredOutputs
    path = model_path(args.model)
    gen = Generator.from_pretrained(str(path), max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_decode_steps=args.max_decode_steps)
    held = (path / "heldout.txt")
    text = held.read_text() if held.exists() else "The quick brown fox jumps over the lazy dog. " * 200
    ids = gen.tokenizer.encode(text, add_special_tokens=False)
    rng = np.random.RandomState(0)
    starts = rng.randint(0, len(ids) - args.prompt_len, args.num_requests)
    prompts = [ids[s:s + args.prompt_len] for s in starts]
    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    runs: dict[str, list[dict]] = {"schema": [], "free": []}
    run_batch(gen, prompts[:8], constrained)      # the grammar's first compilation and the tokenizer's
    for rep in range(args.reps):
        for name, p in (("schema", constrained), ("free", free)):
            r = run_batch(gen, prompts, p)
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['output_tok_s']:.0f} out tok/s, {r['output_tokens']} tokens, "
                  f"{r['steps']} steps, mask fill {r['mask_time_s'] * 1e3:.1f} ms, {r['wall_s']:.2f} s", flush=True)
    assert gen.stats()["compilations_after_warmup"] == 0
    paired = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs["schema"], runs["free"])]
    med = {k: {f: float(np.median([r[f] for r in v])) for f in v[0]} for k, v in runs.items()}
    result = {
        "schema": med["schema"], "free": med["free"], "runs": runs,
        "throughput_ratio_schema_over_free": med["schema"]["output_tok_s"] / med["free"]["output_tok_s"],
        "paired_ratios": paired, "median_paired_ratio": float(np.median(paired)),
        "mask_fill_ms_per_constrained_step": 1e3 * med["schema"]["mask_time_s"] / max(med["schema"]["steps"], 1),
    }
    print(f"schema / free: {result['throughput_ratio_schema_over_free']:.3f}x (median of paired reps "
          f"{result['median_paired_ratio']:.3f}x); mask fill {result['mask_fill_ms_per_constrained_step']:.2f} ms "
          f"per step", flush=True)
    info = device_info()
    report = {"benchmark": "structured", "device": info, "model": str(path), "config": vars(args),
              "result": result, "engine": {k: v for k, v in gen.stats().items() if not isinstance(v, (list, dict))},
              "points": [{"workload": k, **med[k]} for k in med]}
    out = results_path(args.out, device_slug(info), f"structured-mds{args.max_decode_steps}")
    write_report(report, out, "workload", "structured outputs", plot=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
