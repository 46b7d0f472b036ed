"""Static vs dynamic vs continuous batching on one workload, in one run.

    python bench/bench_policies.py [--model PATH] [--num-requests 128] [--out bench/results/...json]

Workload (the engine issue's): N requests, prompt lengths uniform in [16, 512] tokens drawn from
the held-out text (or random ids for a model without one), max_tokens uniform in [16, 256],
ignore_eos so every request produces exactly its max_tokens; all requests arrive at t=0.
For each policy: output tokens/s (total output tokens / wall time), and the medians of
TTFT (first token - arrival) and TPOT ((last - first token) / (n - 1)) over requests.
Warm-up (compilation) happens before the clock starts.

Also reported, from the host scheduler alone (no model): each policy's number of steps on the same
workload, and the continuous/static ratio the policies would reach if every step cost the same
(`constant_step_ratio`, the memory-bound limit where a step's time does not grow with its batch).
On a compute-bound device (a CPU at batch >> B*) step time grows with the tokens in the step and
the measured ratio falls toward 1: finished requests of a static batch free their compute too.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer import Generator, SamplingParams
from jaxinfer.config.flags import add_engine_args
from jaxinfer.generator import default_model_path
from jaxinfer.host.block_manager import BlockManager
from jaxinfer.host.request import Request
from jaxinfer.host.scheduler import Scheduler, SchedulerConfig, StepSample


def workload(gen: Generator, n: int, seed: int, prompt_range=(16, 512), out_range=(16, 256)):
    rng = np.random.RandomState(seed)
    heldout = Path(gen.tokenizer.files[0]).parent / "heldout.txt" if gen.tokenizer else None
    pool = (gen.tokenizer.encode(heldout.read_text()) if heldout and heldout.exists()
            else rng.randint(3, gen.model_cfg.vocab_size, 200_000).tolist())
    prompts, params = [], []
    for i in range(n):
        length = int(rng.randint(prompt_range[0], prompt_range[1] + 1))
        start = int(rng.randint(0, len(pool) - length))
        prompts.append(pool[start: start + length])
        params.append(SamplingParams(max_tokens=int(rng.randint(out_range[0], out_range[1] + 1)),
                                     temperature=0.0, ignore_eos=True))
    return prompts, params


def simulate_steps(policy: str, prompts, params, args) -> list[int]:
    """Tokens of every step the scheduler plans for this workload (fake outputs, ample blocks): a
    host-only benchmark of the scheduler itself, which runs no engine (so it builds the Scheduler and
    BlockManager, as the scheduler's tests do; every engine run below goes through the client)."""
    blocks = BlockManager(1 + len(prompts) * -(-args.max_model_len // args.block_size), args.block_size)
    sched = Scheduler(SchedulerConfig(policy=policy, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_model_len=args.max_model_len, batch_window_s=0.0), blocks, clock=lambda: 0.0)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sched.add(Request(f"r{i}", list(p), sp, 0, arrival_time=0.0))
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append(out.num_batched_tokens)
        sched.update(out, {q.request.request_id: StepSample(3, 0.0) for q in out.seqs if q.sample})
    return steps


def run_policy(path, policy: str, prompts, params, args) -> dict:
    gen = Generator.from_pretrained(path, dtype=args.dtype, batching=policy, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len, block_size=args.block_size)
    client = gen.client
    t0 = time.monotonic()
    rids = client.submit(prompts, params, arrival_time=t0)
    client.run_until_done()
    wall = time.monotonic() - t0
    reqs = [m for rid in rids for m in client.release(rid)]   # per-request metrics (n = 1)
    out_tokens = sum(r.num_output_tokens for r in reqs)
    ttft = [r.ttft for r in reqs]
    tpot = [r.tpot for r in reqs if r.tpot is not None]
    stats = gen.stats()
    return {
        "policy": policy, "wall_s": wall, "output_tokens": out_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(reqs) / wall,
        "ttft_median_s": float(np.median(ttft)), "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_median_s": float(np.median(tpot)), "tpot_p90_s": float(np.percentile(tpot, 90)),
        "e2e_median_s": float(np.median([r.finish_time - r.arrival_time for r in reqs])),
        "num_steps": stats["num_steps"], "num_preemptions": stats["num_preemptions"],
        "compilations_after_warmup": stats["compilations_after_warmup"],
        "median_step_time_s": stats["median_step_time_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--policies", default="static,dynamic,continuous")
    ap.add_argument("--dtype", default="float32", help="float32 is the fast dtype on CPU")
    add_engine_args(ap, only=("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"),
                    defaults={"max_model_len": 768})   # the longest prompt + output of the workload
    ap.add_argument("--prompt-range", default="16,512", help="min,max prompt tokens")
    ap.add_argument("--output-range", default="16,256", help="min,max output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    probe = Generator.from_pretrained(path, dtype=args.dtype, warmup=False)
    rng_of = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    prompts, params = workload(probe, args.num_requests, args.seed, rng_of(args.prompt_range),
                               rng_of(args.output_range))
    del probe
    results = []
    simulated = {pol: simulate_steps(pol, prompts, params, args) for pol in args.policies.split(",")}
    for policy in args.policies.split(","):
        r = run_policy(path, policy, prompts, params, args)
        r["simulated_steps"] = len(simulated[policy])
        print(f"{policy:>10}: {r['output_tokens_per_s']:8.1f} out tok/s  TTFT p50 {r['ttft_median_s']:7.2f} s  "
              f"TPOT p50 {1000 * r['tpot_median_s']:7.1f} ms  steps {r['num_steps']}  wall {r['wall_s']:.1f} s",
              flush=True)
        results.append(r)
    by = {r["policy"]: r for r in results}
    ratio = (by["continuous"]["output_tokens_per_s"] / by["static"]["output_tokens_per_s"]
             if "continuous" in by and "static" in by else None)
    report = {
        "benchmark": "batching policies", "date": time.strftime("%Y-%m-%d"), "model": str(path),
        "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
        "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
        "config": vars(args), "results": results, "continuous_over_static_tok_s": ratio,
        "constant_step_ratio": (len(simulated["static"]) / len(simulated["continuous"])
                                if "continuous" in simulated and "static" in simulated else None),
    }
    if ratio is not None:
        print(f"continuous / static output tokens/s: {ratio:.2f}x (at a constant step time the scheduler's "
              f"step counts would give {report['constant_step_ratio']:.2f}x)")
    out = Path(args.out or f"bench/results/{time.strftime('%Y-%m-%d')}-cpu-policies.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
