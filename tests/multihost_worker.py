"""One process of a two-process jax.distributed group, run by tests/test_multihost.py with
XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu (2 x 4 devices, TP=8).

    python -m tests.multihost_worker MODEL_DIR OUT_JSON                 # group from $JAXINFER_* env vars
    python -m tests.multihost_worker MODEL_DIR OUT_JSON --coordinator-address 127.0.0.1:PORT \
        --num-processes 2 --process-id 0

Process 0 serves Generator.generate (greedy, seeded sampling, penalties, n=2) and gen.logits, then
close(); process 1 runs follow(). Each writes OUT_JSON; the test compares process 0's outputs with
the same model in one process. PROMPTS / SETTINGS / sampling_params() are shared with the test.
"""
from __future__ import annotations

import argparse
import json
import time

PROMPTS = ["the quick brown fox", "seven wizards quietly", [5, 9, 13, 2, 77, 31]]
LOGITS_PROMPT = [1, 40, 7, 300, 12, 99, 5]
# float32 so that TP's different summation order cannot flip a token. One step shape (8 tokens, 4
# blocks per sequence): warm-up compiles once, prompts are prefilled in chunks over several steps.
SETTINGS = dict(dtype="float32", max_num_seqs=4, block_size=8, num_blocks=64, max_model_len=32,
                max_num_batched_tokens=8)


def sampling_params():
    from jaxinfer import SamplingParams, StructuredOutputs
    return {
        # a grammar mask and a logit bias: the leader sends them to the follower with the step
        "constrained": SamplingParams(max_tokens=10, temperature=0.0, logit_bias={5: 2.0, 9: -100},
                                      structured_outputs=StructuredOutputs(regex=r"[a-z]+( [a-z]+){0,3}")),
        "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=1234, n=2,
                                 ignore_eos=True),
        "penalties": SamplingParams(max_tokens=10, temperature=0.7, seed=7, repetition_penalty=1.3,
                                    frequency_penalty=0.4, ignore_eos=True, logprobs=2),
    }


def run_requests(gen) -> dict:
    """The outputs the test compares: per params set, per prompt, per sample (text, ids, reason)."""
    out = {}
    for name, params in sampling_params().items():
        outs = gen.generate(PROMPTS, params)
        out[name] = [[[s.text, s.token_ids, s.finish_reason, s.logprobs] for s in o.samples] for o in outs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_json")
    ap.add_argument("--coordinator-address", default=None)
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()

    from jaxinfer import Generator
    try:
        gen = Generator.from_pretrained(args.model_dir, tensor_parallel=8, num_processes=args.num_processes,
                                        coordinator_address=args.coordinator_address, process_id=args.process_id,
                                        **SETTINGS)
    except ValueError as e:   # e.g. the processes disagree on their settings
        with open(args.out_json, "w") as f:
            json.dump({"error": str(e)}, f)
        raise SystemExit(3)
    import jax
    import numpy as np
    from flax import nnx

    from jaxinfer.runner import CompileCounter
    from jaxinfer.sharding import bytes_per_device

    # weights: a global array per parameter, this process holding only its own devices' shards
    params = {"/".join(map(str, p)): v for p, v in nnx.state(gen.engine.runner.params, nnx.Param).flat_state()}
    up = params["layers/0/mlp/up"].get_value()
    per_device = bytes_per_device({"w": up})
    result = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
        "is_leader": gen.is_leader, "warmup_seconds": time.perf_counter() - t0,
        "up_shape": list(up.shape), "up_nbytes": int(up.nbytes), "up_spec": str(up.sharding.spec),
        "up_fully_addressable": bool(up.is_fully_addressable),
        "up_local_shard_bytes": sorted(per_device.values()),
        "up_local_devices": sorted(d.id for d in per_device),
        "kv_pages_spec": str(gen.engine.runner.kv_pages[0].k.sharding.spec),
        "num_blocks": gen.engine.runner.cfg.num_blocks,
    }
    c0 = CompileCounter.count
    if gen.is_leader:
        result["outputs"] = run_requests(gen)
        result["logits"] = gen.logits(LOGITS_PROMPT).tolist()
        result["stats"] = gen.stats()
        gen.close()
        gen.close()   # idempotent
        try:
            gen.generate(["the"])
            result["after_close_error"] = None
        except RuntimeError as e:
            result["after_close_error"] = str(e)
    else:
        try:
            gen.generate(["the"])
            result["follower_generate_error"] = None
        except RuntimeError as e:
            result["follower_generate_error"] = str(e)
        result["programs_followed"] = gen.follow()
        result["up_local_values"] = [np.asarray(s.data).tolist() for s in up.addressable_shards[:1]]
    result["compiles_after_warmup"] = CompileCounter.count - c0
    result["seconds"] = time.perf_counter() - t0
    with open(args.out_json, "w") as f:
        json.dump(result, f)
    print(f"process {jax.process_index()} done in {result['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
