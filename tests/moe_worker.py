"""Tensor parallelism of the mixture-of-experts families, run by tests/test_moe.py in a subprocess with
8 fake CPU devices (tests/fake_devices.py). Prints one line `RESULT {json}`.

    python -m tests.moe_worker TMP_DIR      # TMP_DIR/<name>/ holds the HF folders of RUNS

Each run loads one model through Generator.from_pretrained on a mesh and reports its logits' relative
error against the same model (same quantization) on one device, whether its greedy tokens are
identical, and how its first MoE layer's expert weights are laid out:
  - Qwen3-MoE (a dense layer between two MoE layers) at TP 2 and TP 4 (each expert's FFN of 32
    split 2 and 4 ways; TP 4 repeats each of its 2 KV heads), and at TP 2 with int8 experts;
  - gpt-oss at TP 2 (sinks split with their heads, expert and router biases, the clamped SwiGLU), and
    at PP 2 x TP 2 (two layers per stage, sliding on one, global on the other; stacked experts);
  - GLM-4.5 at TP 2 with int8 weights (the shared experts' MLP split like a dense one, sigmoid
    routing with its float32 correction, partial rotary);
  - DeepSeek-V3 at TP 4 with int8 weights (latent attention: the query, key and value
    up-projections split by head, the latent and its one-head KV pages replicated).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RUNS = {"qwen3moe-gqa": [dict(tensor_parallel=2), dict(tensor_parallel=4), dict(tensor_parallel=2, quantize="int8")],
        "gpt-oss": [dict(tensor_parallel=2), dict(pipeline_parallel=2, tensor_parallel=2)],
        "glm4moe-groups": [dict(tensor_parallel=2, quantize="int8")],
        "deepseekv3-mla": [dict(tensor_parallel=4, quantize="int8")]}
PROMPTS = [[3, 17, 42, 9, 100, 5, 77, 12, 8, 60, 33, 1, 7, 19], [5, 6, 7]]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, token_buckets=[16], max_num_seqs=4,
              block_size=8, num_blocks=33, warmup=False)


def _expert_layout(gen) -> dict:
    """The first MoE layer's fused gate_up [E, d, 2F]: its codes' spec and the share of its bytes on
    device 0 (column-parallel: 1 / tp); down [E, F, d]: its codes' spec (row-parallel)."""
    import jax
    from flax import nnx

    from jaxinfer.moe import MoE
    from jaxinfer.quant import QuantizedWeight
    runner = gen.engine.runner
    model = nnx.merge(runner.graphdef, runner.params)
    mlp = next(b.mlp for b in model.layers if isinstance(b.mlp, MoE))
    w, down = mlp.gate_up.get_value(), mlp.down.get_value()
    codes = lambda a: a.q if isinstance(a, QuantizedWeight) else a  # noqa: E731
    dev0 = jax.devices()[0]
    local = sum(s.data.nbytes for leaf in jax.tree.leaves(w) for s in leaf.addressable_shards if s.device == dev0)
    out = {"spec": [str(a) for a in codes(w).sharding.spec], "device0_fraction": local / sum(
        leaf.nbytes for leaf in jax.tree.leaves(w)), "down_spec": [str(a) for a in codes(down).sharding.spec]}
    if mlp.shared is not None:   # the shared experts' MLP: column- then row-parallel like a dense one
        out["shared_specs"] = [[str(a) for a in codes(p.get_value()).sharding.spec]
                               for p in (mlp.shared.gate_up, mlp.shared.down)]
    if model.cfg.mla:   # latent attention: the per-head up-projections split by head
        attn = model.layers[0].attn
        out["mla_specs"] = [[str(a) for a in p.get_value().sharding.spec] for p in (attn.k_up, attn.v_up)]
    return out


def main(tmp: Path) -> dict:
    import jax
    import numpy as np

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator

    t0 = time.perf_counter()
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    result: dict = {"n_devices": len(jax.devices()), "runs": {}}
    for name, runs in RUNS.items():
        refs: dict = {}
        for kw in runs:
            quant = kw.get("quantize")
            if quant not in refs:
                ref = Generator.from_pretrained(tmp / name, quantize=quant, **ENGINE)
                refs[quant] = (ref.logits(PROMPTS[0]), [o.token_ids for o in ref.generate(PROMPTS, sp)])
            ref_logits, ref_tokens = refs[quant]
            gen = Generator.from_pretrained(tmp / name, **ENGINE, **kw)
            logits = gen.logits(PROMPTS[0])
            result["runs"][f"{name} {kw}"] = {
                "rel_err": float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
                "same_tokens": [o.token_ids for o in gen.generate(PROMPTS, sp)] == ref_tokens,
                "tp": kw["tensor_parallel"], **({} if "pipeline_parallel" in kw else _expert_layout(gen))}
    result["seconds"] = time.perf_counter() - t0
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
