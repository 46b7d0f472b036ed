"""Tensor and pipeline parallelism of the issue-42 families, run by tests/test_families.py in a
subprocess with 8 fake CPU devices (tests/fake_devices.py). Prints one line `RESULT {json}`.

    python -m tests.families_worker TMP_DIR      # TMP_DIR/<name>/ holds the HF folders of RUNS

Each run loads one model through Generator.from_pretrained on a mesh and reports its logits'
relative error against the same model on one device and whether its greedy tokens are identical:
  - Qwen3 at TP 2 (its 2 KV heads split) and TP 4 (each KV head repeated: q/k norms per head_dim);
  - Gemma 3 at TP 2 (the post-norms, q/k norms and (1 + w) norms replicated) and PP 2 (six layers,
    five local, three per stage: local layer 2 is sliding on stage 0 and global on stage 1, so it
    picks its window and RoPE base per stage, pipeline.PipelinedDecoder._local_rope), on the XLA
    attention and on the Pallas ragged kernel (interpret mode; that window reaches it as an input);
  - SmolLM3 at PP 2 (four layers, NoPE on 0 and 3: local layer 0 rotates on stage 1 only, and is
    windowed on stage 0 only, so both are picked per stage: pipeline.PipelinedDecoder._use_rope);
  - OLMo 2 at TP 2 (its q / k norms span every head, which the devices hold in halves: the mean of
    squares is reduced across them);
  - Command R+ (Cohere) at TP 2: its per-head q / k norm weights split with the heads, attention and
    MLP side by side.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RUNS = {"qwen3-gqa": [dict(tensor_parallel=2), dict(tensor_parallel=4)],
        "gemma3": [dict(tensor_parallel=2), dict(pipeline_parallel=2),
                   dict(pipeline_parallel=2, attention="pallas")],
        "smollm3-window": [dict(pipeline_parallel=2)], "olmo2": [dict(tensor_parallel=2)],
        "cohere": [dict(tensor_parallel=2)]}
PROMPTS = [[3, 17, 42, 9, 100, 5, 77, 12, 8, 60, 33, 1, 7, 19], [5, 6, 7]]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=4,
              block_size=8, num_blocks=33, warmup=False)


def main(tmp: Path) -> dict:
    import jax
    import numpy as np

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator

    t0 = time.perf_counter()
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    result: dict = {"n_devices": len(jax.devices()), "runs": {}}
    for name, runs in RUNS.items():
        ref = Generator.from_pretrained(tmp / name, **ENGINE)
        ref_logits = ref.logits(PROMPTS[0])
        ref_tokens = [o.token_ids for o in ref.generate(PROMPTS, sp)]
        for kw in runs:
            gen = Generator.from_pretrained(tmp / name, **ENGINE, **kw)
            logits = gen.logits(PROMPTS[0])
            result["runs"][f"{name} {kw}"] = {
                "rel_err": float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
                "same_tokens": [o.token_ids for o in gen.generate(PROMPTS, sp)] == ref_tokens}
    result["seconds"] = time.perf_counter() - t0
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
