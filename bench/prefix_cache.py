"""Prefix caching on vs off, same run, same engine settings, on three workloads.

    python -m bench.prefix_cache [--model PATH] [--reps 3] [--out PATH]

  shared:     --num-shared requests (64) behind one --prefix-len-token system prompt (768; the
              bundled model holds 1,024 positions), each with a unique --suffix-len-token suffix (32)
              and --output-len output tokens (64), all submitted at t=0;
  multi-turn: --conversations (16) chats of --turns (6) turns replayed turn by turn: turn t's prompt
              is the whole conversation so far (a 64-token system prompt, every earlier user turn of
              --user-len tokens and every earlier answer as the model produced it, token for token)
              plus the new user turn; --turn-output-len tokens (32) per answer;
  no-sharing: 64 random 256-token prompts, 64 output tokens: what caching costs when it never hits.

Each workload runs --reps times with caching on and off alternately (two warmed-up Generators, the
prefix cache reset before every run, fresh random prompts for no-sharing every run). Greedy decoding
with ignore_eos, so both sides generate the same tokens and do the same decode work. Per run: median
TTFT (first token - submission, seconds), output tokens / wall time, prompt tokens served from the
cache. The report gives each figure's median over the runs and the on/off ratios.
Results: bench/results/<date>-<device>-prefix-cache.json.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import device_info, device_slug, model_path, results_path, write_report
from jaxinfer.config.flags import add_engine_args


def run_batch(gen, prompts: list[list[int]], max_tokens: int, params=None) -> dict:
    """Submit every prompt at once and step the engine until all finish (through gen.client);
    greedy with ignore_eos unless `params` says otherwise."""
    from jaxinfer import SamplingParams
    client = gen.client
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = client.stats()
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    def route(d) -> None:
        if d.token_ids and d.request_id not in first:
            first[d.request_id] = time.perf_counter() - t0
        tokens.setdefault(d.request_id, []).extend(d.token_ids)

    t0 = time.perf_counter()
    rids = client.submit(prompts, params, route=route)
    client.run_until_done()
    wall = time.perf_counter() - t0
    for r in rids:
        client.release(r, abort=False)
    after = client.stats()
    n_out = sum(len(t) for t in tokens.values())
    return {"ttfts": [first[r] for r in rids], "wall_s": wall, "output_tokens": n_out,
            "outputs": [tokens[r] for r in rids],
            "prompt_tokens": sum(len(p) for p in prompts), "steps": after["num_steps"] - before["num_steps"],
            "cached_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"]}


def shared(gen, rng: np.random.RandomState, args) -> dict:
    vocab = gen.model_cfg.vocab_size
    prefix = rng.randint(3, vocab, args.prefix_len).tolist()
    prompts = [prefix + rng.randint(3, vocab, args.suffix_len).tolist() for _ in range(args.num_shared)]
    return run_batch(gen, prompts, args.output_len)


def multi_turn(gen, rng: np.random.RandomState, args) -> dict:
    vocab = gen.model_cfg.vocab_size
    system = rng.randint(3, vocab, 64).tolist()
    convs = [list(system) for _ in range(args.conversations)]
    runs = []
    for _ in range(args.turns):
        prompts = [c + rng.randint(3, vocab, args.user_len).tolist() for c in convs]
        r = run_batch(gen, prompts, args.turn_output_len)
        convs = [p + out for p, out in zip(prompts, r["outputs"])]
        runs.append(r)
    return {"ttfts": [t for r in runs for t in r["ttfts"]], "wall_s": sum(r["wall_s"] for r in runs),
            "output_tokens": sum(r["output_tokens"] for r in runs),
            "prompt_tokens": sum(r["prompt_tokens"] for r in runs),
            "cached_tokens": sum(r["cached_tokens"] for r in runs),
            "outputs": [o for r in runs for o in r["outputs"]]}


def no_sharing(gen, rng: np.random.RandomState, args) -> dict:
    vocab = gen.model_cfg.vocab_size
    prompts = [rng.randint(3, vocab, args.random_len).tolist() for _ in range(args.num_random)]
    return run_batch(gen, prompts, args.output_len)


WORKLOADS = {"shared": shared, "multi-turn": multi_turn, "no-sharing": no_sharing}


def summary(r: dict) -> dict:
    return {"median_ttft_s": float(np.median(r["ttfts"])), "wall_s": r["wall_s"],
            "output_tok_s": r["output_tokens"] / r["wall_s"], "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": r["cached_tokens"], "output_tokens": r["output_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="shared,multi-turn,no-sharing")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-shared", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--turn-output-len", type=int, default=32)
    ap.add_argument("--num-random", type=int, default=64)
    ap.add_argument("--random-len", type=int, default=256)
    add_engine_args(ap, only=("max_num_seqs", "max_num_batched_tokens"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None, help="suffix of the results file name")
    args = ap.parse_args(argv)
    from jaxinfer import Generator

    path = model_path(args.model)
    gens = {on: Generator.from_pretrained(path, max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                          enable_prefix_caching=on) for on in (True, False)}
    report_points, results = [], {}
    for name in args.workloads.split(","):
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for rep in range(args.reps):
            order = (True, False) if rep % 2 == 0 else (False, True)   # alternate who runs first
            outs = {}
            for on in order:
                gens[on].reset_prefix_cache()
                r = WORKLOADS[name](gens[on], np.random.RandomState(1000 + rep), args)
                outs[on] = r.pop("outputs")
                runs[on].append(summary(r))
                s = runs[on][-1]
                print(f"{name} rep {rep} caching {'on ' if on else 'off'}: median TTFT {s['median_ttft_s'] * 1e3:.0f} ms, "
                      f"{s['output_tok_s']:.0f} out tok/s, {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens "
                      f"cached, {s['wall_s']:.1f} s", flush=True)
            assert outs[True] == outs[False], f"{name}: caching changed the greedy outputs"
        med = {on: {k: float(np.median([r[k] for r in runs[on]])) for k in runs[on][0]} for on in runs}
        # each rep's on and off ran back to back: their ratio cancels the machine's slow drift
        paired = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[True], runs[False])]
        paired_ttft = [b["median_ttft_s"] / a["median_ttft_s"] for a, b in zip(runs[True], runs[False])]
        results[name] = {
            "caching_on": med[True], "caching_off": med[False], "runs_on": runs[True], "runs_off": runs[False],
            "ttft_ratio_off_over_on": med[False]["median_ttft_s"] / med[True]["median_ttft_s"],
            "throughput_ratio_on_over_off": med[True]["output_tok_s"] / med[False]["output_tok_s"],
            "paired_throughput_ratios_on_over_off": paired,
            "median_paired_throughput_ratio_on_over_off": float(np.median(paired)),
            "paired_ttft_ratios_off_over_on": paired_ttft,
            "median_paired_ttft_ratio_off_over_on": float(np.median(paired_ttft)),
            "outputs_identical": True,
        }
        for on in (True, False):
            report_points.append({"workload": name, "caching": on, **med[on]})
        print(f"{name}: TTFT off/on {results[name]['ttft_ratio_off_over_on']:.2f}x, "
              f"throughput on/off {results[name]['throughput_ratio_on_over_off']:.3f}x "
              f"(median of paired reps {results[name]['median_paired_throughput_ratio_on_over_off']:.3f}x)", flush=True)
    info = device_info()
    report = {"benchmark": "prefix-cache", "device": info, "model": str(path), "config": vars(args),
              "workloads": results, "points": report_points}
    out = results_path(args.out, device_slug(info), "prefix-cache" + (f"-{args.tag}" if args.tag else ""))
    write_report(report, out, "workload", "prefix caching", plot=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
