"""Multi-device tensor-parallel checks, run by tests/test_sharding.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu (the pytest process has
already initialised jax with one device). Prints one line `RESULT {json}`; the test asserts on it.

    python -m tests.sharding_worker TMP_DIR      # TMP_DIR/<name>/ holds the HF folders of CONFIGS
                                                 # (written by the test with save_llama, or by this
                                                 # script with --save, which imports torch)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# tiny Llamas: 8 query heads / 2 KV heads (tp 4 and 8 replicate KV), ffn divisible by 8;
# vocab 136 is divisible by 8 (vocab-parallel embedding + LM head), 131 is not (replicated),
# and that one is tied with q/k/v/mlp biases (bias sharding, tied LM head); initializer_range 0.1
# keeps greedy outputs from collapsing to one repeated token.
_COMMON = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=2, max_position_embeddings=128, initializer_range=0.1)
CONFIGS = {
    "vocab136": dict(_COMMON, vocab_size=136, tie_word_embeddings=False),
    "vocab131": dict(_COMMON, vocab_size=131, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
}
# tp 2 splits the 2 KV heads, tp 8 replicates them (tp 4 would repeat tp 8's case); vocab 131 does not divide
TPS = {"vocab136": (2, 8), "vocab131": (8,)}
LOGITS_PROMPT = [3, 17, 42, 9, 100, 5, 77, 12, 8, 60, 33, 1]
PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7]]   # 8 tokens: prefill and decode share the T=16 bucket
# prefix caching under TP: a second request behind the same 16-token (two-block) prefix
SHARED = [list(range(40, 56)) + [3, 4], list(range(40, 56)) + [5, 6, 7]]
CHECKED = ("q", "k", "v", "o", "up", "gate", "down", "q_bias", "k_bias", "v_bias", "up_bias", "gate_bias",
           "embed", "lm_head")


def save_llama(name: str, folder: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(1)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIGS[name], bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def main(tmp: Path) -> dict:
    import jax
    import numpy as np

    from jaxinfer.config import EngineConfig, SamplingParams
    from jaxinfer.generator import Generator
    from jaxinfer.runner import CompileCounter
    from jaxinfer.sharding import (bytes_per_device, kv_sharding, load_sharded, make_mesh, model_mesh, rules_for,
                                   shard_decoder, shard_kv_pages)
    from jaxinfer.weights import load_model
    from flax import nnx

    t0 = time.perf_counter()
    # one step program (16 tokens, the budget) per engine: tensor parallelism is what is compared
    ecfg = EngineConfig(dtype="float32", max_num_seqs=4, block_size=8, num_blocks=64, max_model_len=64,
                        token_buckets=(16,))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    result: dict = {"n_devices": len(jax.devices()), "configs": {}}

    def run(model):
        gen = Generator(model, tokenizer=None, cfg=ecfg, max_num_batched_tokens=16, warmup=False)
        return gen

    for name in CONFIGS:
        folder = tmp / name
        t_cfg = time.perf_counter()
        ref_model, cfg = load_model(folder, "float32")
        ref_gen = run(ref_model)
        ref_logits = ref_gen.logits(LOGITS_PROMPT)
        c0 = CompileCounter.count
        ref_tokens = [o.token_ids for o in ref_gen.generate(PROMPTS, sp)]
        ref_compiles = CompileCounter.count - c0
        ref_shared = [o.token_ids for o in ref_gen.generate(SHARED, sp)]
        entry = {"ref_tokens": ref_tokens, "ref_generate_compiles": ref_compiles, "tp": {}, "ref_shared": ref_shared,
                 "ref_model_mesh": model_mesh(ref_model) is None,
                 "ref_seconds": time.perf_counter() - t_cfg}
        for tp in TPS[name]:
            t_tp = time.perf_counter()
            mesh = make_mesh(tensor_parallel=tp)
            model, _ = load_model(folder, "float32")
            rules = rules_for(cfg, mesh)
            shard_decoder(model, mesh, rules)
            weights = {}
            for path, var in nnx.state(model, nnx.Param).flat_state():
                if str(path[-1]) not in CHECKED or (len(path) > 1 and str(path[1]) != "0"):
                    continue   # layer 0 and the top-level tables are enough
                arr = var.get_value()
                per = bytes_per_device({"w": arr})
                weights["/".join(map(str, path))] = {
                    "nbytes": int(arr.nbytes), "per_device": [per[d] for d in mesh.devices.flat],
                    "replicated": bool(arr.sharding.is_fully_replicated), "spec": str(arr.sharding.spec)}
            per_device = bytes_per_device(model)
            gen = run(model)
            runner = gen.engine.runner
            runner.kv_pages = shard_kv_pages(runner.kv_pages, mesh, cfg.n_kv_heads)
            kv_before = runner.kv_pages[0].k.sharding
            logits = gen.logits(LOGITS_PROMPT)
            c0 = CompileCounter.count
            tokens = [o.token_ids for o in gen.generate(PROMPTS, sp)]
            compiles = CompileCounter.count - c0
            hits0 = gen.stats()["prefix_cache_hits"]
            shared = [o.token_ids for o in gen.generate(SHARED, sp)]
            kv_after = runner.kv_pages[0].k.sharding
            rel = float(np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits)))
            entry["tp"][str(tp)] = {
                "rules": {k: v for k, v in rules.items()},
                "logits_rel_err": rel, "tokens": tokens, "generate_compiles": compiles,
                "shared_tokens": shared, "shared_cache_hits": gen.stats()["prefix_cache_hits"] - hits0,
                "weights": weights,
                "per_device_param_bytes": [per_device[d] for d in mesh.devices.flat],
                "total_param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
                "kv_expected_spec": str(kv_sharding(mesh, cfg.n_kv_heads).spec),
                "kv_spec_before": str(kv_before.spec), "kv_spec_after": str(getattr(kv_after, "spec", kv_after)),
                "kv_after_equivalent": bool(kv_after.is_equivalent_to(kv_before, 4)),
                "kv_per_device_bytes": [bytes_per_device(runner.kv_pages)[d] for d in mesh.devices.flat],
                "param_devices": sorted(d.id for d in runner.params.flat_state()[0][1].get_value().sharding.device_set),
                "model_mesh_found": model_mesh(model) == mesh and model_mesh(runner.params) == mesh,
                "seconds": time.perf_counter() - t_tp,
            }
        result["configs"][name] = entry

    # quantized weights under TP 2 (int4, groups of 32 along K): sharded like their float weights
    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.quant import QuantizedWeight
    folder = tmp / "vocab136"
    qref, cfg = load_model(folder, "float32")
    qref_gen = run(quantize_decoder(qref, "int4", group_size=32))
    q_entry = {"ref_tokens": [o.token_ids for o in qref_gen.generate(PROMPTS, sp)]}
    ref_logits = qref_gen.logits(LOGITS_PROMPT)
    mesh = make_mesh(tensor_parallel=2)
    qm, _ = load_model(folder, "float32")
    shard_decoder(quantize_decoder(qm, "int4", group_size=32), mesh)
    q_entry["weights"] = {}
    for path, var in nnx.state(qm, nnx.Param).flat_state():
        w = var.get_value()
        if isinstance(w, QuantizedWeight) and str(path[1]) == "0":
            q_entry["weights"]["/".join(map(str, path))] = {
                leaf: {"spec": str(getattr(w, leaf).sharding.spec), "nbytes": int(getattr(w, leaf).nbytes),
                       "per_device": [bytes_per_device({"x": getattr(w, leaf)})[d] for d in mesh.devices.flat]}
                for leaf in ("q", "scales")}
    gen = run(qm)
    gen.engine.runner.kv_pages = shard_kv_pages(gen.engine.runner.kv_pages, mesh, cfg.n_kv_heads)
    logits = gen.logits(LOGITS_PROMPT)
    q_entry["logits_rel_err"] = float(np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits)))
    q_entry["tokens"] = [o.token_ids for o in gen.generate(PROMPTS, sp)]
    result["quantized_tp2"] = q_entry

    # load_sharded from a memmap: each device's callback reads only its own slice
    src = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    np.save(tmp / "w.npy", src)
    mm = np.load(tmp / "w.npy", mmap_mode="r")
    mesh = make_mesh(tensor_parallel=4)
    from jax.sharding import NamedSharding, PartitionSpec
    seen = []

    def read(index):
        seen.append([[s.start, s.stop] for s in index])
        return mm[index]
    arr = load_sharded(read, (16, 12), NamedSharding(mesh, PartitionSpec(None, "tensor")), dtype=np.float16)
    result["load_sharded"] = {"equal": bool(np.array_equal(np.asarray(arr), src.astype(np.float16))),
                              "dtype": str(arr.dtype), "reads": seen, "spec": str(arr.sharding.spec),
                              "shard_shapes": [list(s.data.shape) for s in arr.addressable_shards]}
    arr2 = load_sharded(mm, (16, 12), NamedSharding(mesh, PartitionSpec("tensor")))
    result["load_sharded"]["array_source_equal"] = bool(np.array_equal(np.asarray(arr2), src))
    try:
        make_mesh(tensor_parallel=16)
        result["mesh_error"] = None
    except ValueError as e:
        result["mesh_error"] = str(e)
    result["seconds"] = time.perf_counter() - t0
    return result


if __name__ == "__main__":
    tmp = Path(sys.argv[1])
    if "--save" in sys.argv:
        for name in CONFIGS:
            save_llama(name, tmp / name)
    print("RESULT " + json.dumps(main(tmp)), flush=True)
