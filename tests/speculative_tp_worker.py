"""Speculative decoding under tensor parallelism, run by tests/test_speculative_tp.py in a
subprocess with 8 fake CPU devices (tests/fake_devices.py). Prints one line `RESULT {json}`.

    python -m tests.speculative_tp_worker TMP_DIR     # TMP_DIR/vocab136/: tests/sharding_worker.save_llama
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# repetitive prompts, so that n-gram lookup proposes from the first decode step on
SPEC_PROMPTS = [[3, 17, 42, 9, 100, 3, 17, 42, 9, 100, 3, 17], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


def main(tmp: Path) -> dict:
    """Each speculative method at TP 2 (the target sharded; the draft model and random Medusa heads
    replicated) against the one-device engine without speculation: greedy tokens, proposals made
    and accepted, nothing compiled when the same requests run again (the shapes are warm: a
    sharding that drifted between steps would compile again), and the target's and the draft's KV
    pages as they came. The draft is the target itself (its proposals are the greedy tokens: the
    acceptance path); n-gram lookup and random heads mostly get rejected (the rollback path)."""
    import jax

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator
    from jaxinfer.runner import CompileCounter
    from tests.hf_models import random_medusa_heads

    folder = tmp / "vocab136"
    kw = dict(dtype="float32", attention="xla", max_num_seqs=2, block_size=8, num_blocks=32, max_model_len=32,
              max_num_batched_tokens=16, token_buckets=[16], max_decode_steps=2, enable_prefix_caching=False,
              speculative_max_batch=2)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = Generator.from_pretrained(folder, **kw, warmup=False)
    out = {"n_devices": len(jax.devices()), "ref_tokens": [o.token_ids for o in ref.generate(SPEC_PROMPTS, sp)]}
    ref.close()
    heads = random_medusa_heads(folder, tmp / "heads136")
    for method, extra in (("ngram", {}), ("draft", {"speculative_model": folder}),
                          ("medusa", {"speculative_model": heads, "num_speculative_tokens": 3})):
        t_m = time.perf_counter()
        gen = Generator.from_pretrained(folder, **kw, tensor_parallel=2, speculative_method=method,
                                        warmup=False, **{"num_speculative_tokens": 3, **extra})
        runner = gen.engine.runner
        pages = lambda: runner.kv_pages if method != "draft" else runner.kv_pages[0]  # noqa: E731
        before = [str(pages()[0].k.sharding.spec)] + (
            [str(runner.kv_pages[1][0].k.sharding.spec)] if method == "draft" else [])
        first = [o.token_ids for o in gen.generate(SPEC_PROMPTS, sp)]
        st = gen.stats()
        c0 = CompileCounter.count
        tokens = [o.token_ids for o in gen.generate(SPEC_PROMPTS, sp)]
        out[method] = {"seconds": time.perf_counter() - t_m, "tokens": tokens, "first_tokens": first,
                       "compiles_second_run": CompileCounter.count - c0,
                       "drafts": st["spec_decode_num_drafts"], "accepted": st["spec_decode_num_accepted_tokens"],
                       "kv_spec_before": before,
                       "kv_spec_after": [str(pages()[0].k.sharding.spec)] + (
                           [str(runner.kv_pages[1][0].k.sharding.spec)] if method == "draft" else []),
                       "target_devices": len(pages()[0].k.sharding.device_set),
                       "draft_pages_replicated": (method == "draft"
                                                  and bool(runner.kv_pages[1][0].k.sharding.is_fully_replicated))}
        gen.close()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
