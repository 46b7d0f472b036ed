"""The prefix cache's host tier (kv_offload_gb) off vs on, same run: multi-turn chats whose histories
together hold about 4x what the device pool holds.

    python -m bench.multiturn [--model PATH] [--conversations 16] [--turns 6] [--kv-offload-gb 0.25]
    python -m bench.multiturn --shape llama3-8b --kv-offload-gb 2   # a GPU: random 8B weights, bfloat16

Workload: --conversations chats of --turns turns. Every turn resends a shared --system-len-token system
prompt, the conversation's whole history (every earlier user message of --user-len tokens and every
answer as the model produced it) and a new user message; answers are --output-len tokens (greedy,
ignore_eos, so both sides produce the same tokens). Turns interleave across conversations: round t
sends turn t of every conversation, --concurrency conversations at a time (submitted together and run
to completion), so a conversation returns after all the others' turns have gone through the pool.
The pool is --num-blocks blocks (default: a quarter of the tokens every history holds at the end, but
at least --concurrency sequences of the longest turn): with the tier off the pool's LRU has evicted a
returning conversation's history, which is recomputed; with it on, it is copied back from host memory.

Reported per side: TTFT (first token - submission) p50 / p90 of turns >= 2, prompt tokens computed
(prefill work) and served from the cache, the tier's counters, wall time; and off/on ratios. Two
warmed-up Generators with identical settings but kv_offload_gb, each run --reps times alternately
(each run starts from an empty cache: reset_prefix_cache), and in float32 the outputs must be identical
(in bfloat16 the report counts the identical ones: a restored block keeps the rounding of the step that
computed it, a recompute has a prefill's, and a near tie can go the other way).
Results: bench/results/<date>-<device>-multiturn.json.

--shape llama3-8b (or tiny, its CPU smoke) builds a random bfloat16 model of that shape in memory
(bench/gpu/parts.random_decoder: no checkpoint to write) and serves both sides from it with the
platform's attention; its KV is 128 KiB a token, so the tier's budget must hold the evicted histories
(about 1 GiB at the defaults: --kv-offload-gb 2). On a GPU the tier's buffers are pinned host memory.

--no-attention is a diagnostic, not a serving mode: the XLA paged attention's output is replaced by zeros
(K/V are still written, restored and read by nothing), so each side's TTFT is what the rest of the work
costs (the matmuls, the sampler, the restore, the host). Both sides then produce the same, meaningless,
tokens, so the histories keep their lengths and the off/on ratio shows how far the tier could go if
attention were free. Results: <date>-<device>-multiturn-no-attention.json.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np

from bench.common import device_info, device_slug, model_path, results_path, write_json_atomic
from bench.prefix_cache import run_batch


def workload_tokens(args) -> int:
    """Tokens every conversation's history holds after its last turn, summed (the pool's yardstick)."""
    per_turn = args.user_len + args.output_len
    return args.conversations * (args.system_len + args.turns * per_turn)


def run(gen, args, seed: int) -> dict:
    """One pass of the workload: per turn (conversation, turn, TTFT), the counters' deltas, and where a
    returning batch's first tokens wait (ttft_parts)."""
    from bench.metrics import StepLog
    vocab = gen.model_cfg.vocab_size
    rng = np.random.RandomState(seed)
    system = rng.randint(3, vocab, args.system_len).tolist()
    history = [list(system) for _ in range(args.conversations)]
    before = gen.stats()
    ttft, outputs, parts = [], [], []
    log = StepLog(gen.client)
    for turn in range(args.turns):
        for first in range(0, args.conversations, args.concurrency):
            convs = range(first, min(first + args.concurrency, args.conversations))
            prompts = [history[c] + rng.randint(3, vocab, args.user_len).tolist() for c in convs]
            n0, s0 = len(log.steps), gen.stats()
            r = run_batch(gen, prompts, args.output_len)
            if turn >= 1:
                parts.append(batch_parts(log.steps[n0:], s0, gen.stats()))
            for c, p, out, t in zip(convs, prompts, r["outputs"], r["ttfts"]):
                history[c] = p + out
                ttft.append((c, turn, t))
                outputs.append(out)
    log.detach()
    after = gen.stats()
    delta = {k: after[k] - before[k] for k in ("prompt_tokens", "prefix_cache_hits", "prefix_cache_queries",
                                               "prefix_cache_evictions", "kv_host_hits", "kv_host_misses",
                                               "kv_host_bytes_offloaded", "kv_host_bytes_restored",
                                               "kv_host_restore_time_s", "num_preemptions")}
    returning = [t for _, turn, t in ttft if turn >= 1]
    return {"ttft_p50_s": float(np.percentile(returning, 50)), "ttft_p90_s": float(np.percentile(returning, 90)),
            "ttft_turn1_p50_s": float(np.median([t for _, turn, t in ttft if turn == 0])),
            "prefill_tokens_computed": delta.pop("prompt_tokens"), **delta,
            "kv_host_blocks_held": after["kv_host_blocks"],
            "ttft_parts": {k: float(np.median([p[k] for p in parts])) for k in parts[0]}, "outputs": outputs}


def batch_parts(steps: list, s0: dict, s1: dict) -> dict:
    """Where a returning batch's first tokens wait: the host time of the engine step that launched
    its first step (scheduling, prefix lookups, the tier's copies, the inputs, the dispatch; the
    engine is idle when a batch arrives, so under async scheduling that call applies nothing and its
    wall time is all host time), the first step that drew tokens (its tokens and its device time:
    the batch's first tokens, its whole prefill when it fits one step), and the tier's host time over
    the whole batch: restores (all at admission here, before the first step, since every request of
    the batch is admitted at once) and offloads (blocks evicted as the batch's steps allocate, spread
    over them)."""
    launch = steps[0]
    first = next(s for s in steps if s.spans)
    return {"launch_host_s": launch.time_s - (launch.execute_s or 0.0 if launch.spans else 0.0),
            "first_step_tokens": first.num_tokens,
            "first_step_device_s": first.execute_s,
            "restore_host_s": s1["kv_host_restore_time_s"] - s0["kv_host_restore_time_s"],
            "offload_host_s": s1["kv_host_offload_time_s"] - s0["kv_host_offload_time_s"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default=None,
                    help="a random bfloat16 model of this shape instead of --model (module docstring)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--kv-offload-gb", type=float, default=0.25, help="the tier's budget on the 'on' side")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-attention", action="store_true",
                    help="diagnostic: zeros for the paged attention's output on both sides (module docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    if args.shape and args.model:
        raise SystemExit("--shape builds its own random model: give --model or --shape, not both")
    return args


def build_generators(args, path, common: dict) -> dict:
    """{tier on: Generator} with identical settings but kv_offload_gb: from --model's folder, or both
    over one random model of --shape (its params are read only)."""
    from jaxinfer import Generator
    if args.shape:
        from bench.gpu.parts import random_decoder
        from bench.gpu.workload import LLAMA3_8B, TINY_LLAMA
        from jaxinfer.config import EngineConfig

        model = random_decoder(LLAMA3_8B if args.shape == "llama3-8b" else TINY_LLAMA)
        common = dict(common)
        budget = common.pop("max_num_batched_tokens")
        return {on: Generator(model, None, EngineConfig(dtype="bfloat16", **common,
                                                        kv_offload_bytes=int(args.kv_offload_gb * 2**30) if on else 0),
                              max_num_batched_tokens=budget)
                for on in (False, True)}
    return {on: Generator.from_pretrained(path, **common, kv_offload_gb=args.kv_offload_gb if on else 0)
            for on in (False, True)}


def run_reps(gens: dict, args) -> Iterator[tuple[dict, list[int]]]:
    """--reps passes of each side, alternating who runs first; after each rep (both sides run) yields
    the reps so far: ({on: [run]}, identical outputs per rep)."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    float32 = all(g.client.resolved.dtype == "float32" for g in gens.values())
    identical: list[int] = []
    for rep in range(args.reps):
        outs = {}
        for on in ((False, True) if rep % 2 == 0 else (True, False)):   # alternate who runs first
            gens[on].reset_prefix_cache()
            r = run(gens[on], args, seed=100 + rep)
            outs[on] = r.pop("outputs")
            runs[on].append(r)
            parts = r["ttft_parts"]
            print(f"rep {rep} tier {'on ' if on else 'off'}: TTFT turns>=2 p50 {r['ttft_p50_s'] * 1e3:.1f} ms "
                  f"p90 {r['ttft_p90_s'] * 1e3:.1f} ms, prefill tokens {r['prefill_tokens_computed']}, "
                  f"cached {r['prefix_cache_hits']}, host hits {r['kv_host_hits']} blocks, "
                  f"restore {r['kv_host_restore_time_s'] * 1e3:.0f} ms; a returning batch (medians): launched in "
                  f"{parts['launch_host_s'] * 1e3:.1f} ms of host time (restores {parts['restore_host_s'] * 1e3:.1f} ms), "
                  f"first step {parts['first_step_tokens']:.0f} tokens in {parts['first_step_device_s'] * 1e3:.1f} ms; "
                  f"offloads over the batch {parts['offload_host_s'] * 1e3:.1f} ms", flush=True)
        same = [a == b for a, b in zip(outs[True], outs[False])]
        identical.append(sum(same))
        # float32: restored K/V are the bits a recompute gives, so every greedy output must match. In
        # bfloat16 they are not: a restored block holds what the original steps computed (a decode
        # step's rounding), a recompute what a 512-token prefill computes, and a near tie of a random
        # model's logits can then go the other way (tiny shape: 92 of 96 outputs identical, the first
        # difference 25 tokens into an answer; float32: 96 of 96)
        if float32:
            assert all(same), "the host tier changed the greedy outputs"
        yield runs, identical


def summarize(runs: dict, identical: list[int], args) -> dict:
    """The reps so far -> the report's results: each side's medians and runs, the off/on ratios."""
    med = {on: {k: ({q: float(np.median([r[k][q] for r in runs[on]])) for q in v} if isinstance(v, dict)
                    else float(np.median([r[k] for r in runs[on]]))) for k, v in runs[on][0].items()} for on in runs}
    paired_ttft = [off["ttft_p50_s"] / on["ttft_p50_s"] for off, on in zip(runs[False], runs[True])]
    ratios = {
        "ttft_p50_off_over_on": med[False]["ttft_p50_s"] / med[True]["ttft_p50_s"],
        "ttft_p90_off_over_on": med[False]["ttft_p90_s"] / med[True]["ttft_p90_s"],
        "paired_ttft_p50_off_over_on": paired_ttft,
        "prefill_tokens_off_over_on": med[False]["prefill_tokens_computed"] / med[True]["prefill_tokens_computed"],
        # the most the tier could give: a returning batch's TTFT with it on no shorter than its first
        # step's own device time (its new tokens' prefill over the restored context)
        "ttft_p50_ceiling_off_over_on": med[False]["ttft_p50_s"] / med[True]["ttft_parts"]["first_step_device_s"],
    }
    return {"tier_off": med[False], "tier_on": med[True], "runs_off": runs[False], "runs_on": runs[True], **ratios,
            "outputs_identical": [f"{n} of {args.conversations * args.turns}" for n in identical],
            "points": [{"tier": on, **med[on]} for on in (False, True)]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.no_attention:
        import jax.numpy as jnp

        import jaxinfer.attention
        jaxinfer.attention.paged_attention_xla = lambda q, *_, **__: jnp.zeros_like(q)
    path = f"random {args.shape}" if args.shape else model_path(args.model)
    total = workload_tokens(args)
    longest = args.system_len + args.turns * (args.user_len + args.output_len)
    num_blocks = args.num_blocks or max(total // 4, args.concurrency * longest) // args.block_size + 1
    common = dict(max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, num_blocks=num_blocks, max_model_len=longest + args.output_len)
    gens = build_generators(args, path, common)
    if args.no_attention and any(g.client.resolved.attention != "xla" for g in gens.values()):
        raise SystemExit("--no-attention replaces the XLA paged attention; these engines run "
                         f"{gens[True].client.resolved.attention!r}")
    pool_tokens = (num_blocks - 1) * args.block_size
    print(f"pool {num_blocks - 1} blocks = {pool_tokens} tokens; histories at the end {total} tokens "
          f"({total / pool_tokens:.1f}x the pool)", flush=True)
    info = device_info()
    mode = "multiturn" + (f"-{args.shape}" if args.shape else "") + ("-no-attention" if args.no_attention else "")
    out = results_path(args.out, device_slug(info), mode)
    setup = {"benchmark": "multiturn", "device": info, "model": str(path), "config": vars(args),
             "num_blocks": num_blocks, "pool_tokens": pool_tokens, "history_tokens_at_end": total}

    for runs, identical in run_reps(gens, args):
        # rewritten after every rep, so a run cut short (a lent GPU's time limit) keeps the reps it finished
        results = summarize(runs, identical, args)
        write_json_atomic({**setup, **results, "reps_done": len(identical)}, out)
    print("off/on: TTFT p50 {ttft_p50_off_over_on:.2f}x, p90 {ttft_p90_off_over_on:.2f}x, prefill tokens "
          "{prefill_tokens_off_over_on:.2f}x; TTFT p50 ceiling (copies and host free) "
          "{ttft_p50_ceiling_off_over_on:.2f}x".format(**results), flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
