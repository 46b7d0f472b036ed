"""Multi-device pipeline-parallel checks, run by tests/test_pipeline.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu (the pytest process has
already initialised jax with one device). Prints one line `RESULT {json}`; the test asserts on it.

    python -m tests.pipeline_worker TMP_DIR            # TMP_DIR/<name>/: HF folders of MODELS
    python -m tests.pipeline_worker --bubble TMP_DIR   # step times for M = 1, pp, 2 pp (no asserts)

TMP_DIR/<name>/ are written by the test with tests.hf_models.save_hf_model(name, folder, MODELS[name])
(torch is imported there, never here); for --bubble, TMP_DIR/bubble/ is
save_hf_model("llama-gqa-llama3", TMP_DIR / "bubble", BUBBLE_MODEL).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

# two families from tests/hf_models.py CONFIGS, with 4 layers so that pp 2 and 4 divide them;
# initializer_range 0.1 keeps greedy outputs from collapsing to one repeated token.
#   llama-gqa-llama3: 4 heads / 2 KV heads (TP 4 > 2 KV heads: k, v and the pages replicated over "tensor")
#   qwen2-window: 1 KV head (TP 2 > 1), layer windows [None, 6, 6, 6]: with pp 2 local layer 0 is
#     unwindowed on rank 0 and windowed on rank 1 (the traced-window path)
MODELS = {
    "llama-gqa-llama3": {"num_hidden_layers": 4, "initializer_range": 0.1},
    "qwen2-window": {"num_hidden_layers": 4, "initializer_range": 0.1},
}
BUBBLE_MODEL = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
                "num_key_value_heads": 2, "initializer_range": 0.05}
# (tensor_parallel, pipeline_parallel, micro-batches or None for the default = pp)
LAYOUTS = {
    "llama-gqa-llama3": [(1, 2, None), (2, 2, None), (4, 2, 3)],
    "qwen2-window": [(1, 2, 3), (1, 4, None)],
}
LOGITS_PROMPT = [3, 17, 42, 9, 60, 5, 77, 12, 8, 60, 33, 1, 14, 15]
# mixed lengths, more prompts than max_num_seqs; the 21-token one is prefilled in chunks (token budget
# 8: one token bucket, so warm-up compiles one step per layout), its later chunks continuing a cached
# context (the XLA attention's chunk work items, AttentionMetadata.chunk_items)
PROMPTS = [[3, 17, 42, 9, 50], [5, 6, 7], list(range(10, 31)), [20], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
MAX_TOKENS = 8
TOKEN_BUDGET = 8
# prefix caching across stages: three prompts behind one 16-token (two-block) prefix; the first
# computes it in chunks, the others start from its cached blocks
SHARED_PREFIX = list(range(40, 56))
SHARED = [SHARED_PREFIX + [3, 4], SHARED_PREFIX + [5], SHARED_PREFIX + [6, 7, 8]]


def engine_config(tp: int = 1, pp: int = 1, microbatches: int | None = None, kv_dtype: str | None = None):
    from jaxinfer.config import EngineConfig
    return EngineConfig(dtype="float32", attention="xla", max_num_seqs=4, block_size=8, num_blocks=48,
                        max_model_len=32, tensor_parallel=tp, pipeline_parallel=pp,
                        pipeline_microbatches=microbatches, kv_dtype=kv_dtype)


def pipelined_generator(folder: Path, tp: int, pp: int, micro: int | None, kv_dtype: str | None = None):
    from jaxinfer.generator import Generator
    ecfg = engine_config(tp, pp, micro, kv_dtype)
    return Generator.from_pretrained(folder, dtype=ecfg.dtype, attention=ecfg.attention, kv_dtype=kv_dtype, tensor_parallel=tp,
                                     pipeline_parallel=pp, max_num_seqs=ecfg.max_num_seqs, block_size=ecfg.block_size,
                                     num_blocks=ecfg.num_blocks, max_model_len=ecfg.max_model_len,
                                     max_num_batched_tokens=TOKEN_BUDGET, pipeline_microbatches=micro)


def _weights(model, mesh) -> dict:
    """Per stacked layer parameter: bytes, spec, bytes on each device, and the layers each device holds."""
    from flax import nnx
    from jaxinfer.sharding import bytes_per_device

    out = {}
    for path, var in nnx.state(model.layers, nnx.Param).flat_state():
        arr = var.get_value()
        per = bytes_per_device({"w": arr})
        index = arr.sharding.devices_indices_map(arr.shape)
        out["/".join(map(str, path))] = {
            "nbytes": int(arr.nbytes), "spec": [None if s is None else str(s) for s in arr.sharding.spec],
            "logical_axes": list(var.get_metadata()["logical_axes"]),
            "per_device": [per.get(d, 0) for d in mesh.devices.flat],
            "layers": [list(range(*index[d][0].indices(arr.shape[0]))) for d in mesh.devices.flat]}
    return out


def _quantized_leaves(model, mesh) -> dict:
    """Per stacked quantized layer weight and leaf: spec, total bytes, bytes on each device."""
    from flax import nnx
    from jaxinfer.quant import QuantizedWeight
    from jaxinfer.sharding import bytes_per_device

    out = {}
    for path, var in nnx.state(model.layers, nnx.Param).flat_state():
        qw = var.get_value()
        if not isinstance(qw, QuantizedWeight):
            continue
        for field in ("q", "scales", "zeros", "act_scale", "act_zero"):
            arr = getattr(qw, field)
            if arr is not None:
                per = bytes_per_device({"w": arr})
                out[f"{'/'.join(map(str, path))}/{field}"] = {
                    "nbytes": int(arr.nbytes), "shape": list(arr.shape), "spec": [None if s is None else str(s) for s in arr.sharding.spec],
                    "per_device": [per.get(d, 0) for d in mesh.devices.flat]}
    return out


def quantized_runs(tmp: Path, folder: Path, sp) -> dict:
    """Quantized weights across stages, each against the same quantized model on one device:
    int4 (group 64, or 32 where K = 96) at load time at TP 2 x PP 2, and a W8A8 SmoothQuant checkpoint with static
    asymmetric activation scales and zero points (jaxinfer quantize's format) at PP 2."""
    import numpy as np
    from flax import nnx

    from jaxinfer.generator import Generator
    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.quantize import QuantizeSettings, quantize_model
    from jaxinfer.weights import load_model, save_native

    out = {}
    model, cfg = load_model(folder, "float32")
    settings = QuantizeSettings("smoothquant", bits=8, group_size=-1, act_scales="static", act_calib="minmax",
                                act_symmetric=False, calib_window=16)
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    quantize_model(model, settings, windows, progress=False)
    save_native(model, tmp / "w8a8-native", "float32", extra={"quantization": settings.to_json()})
    int4, _ = load_model(folder, "float32")
    quantize_decoder(int4, "int4")
    for label, source, tp, pp, quantize in (("int4", folder, 2, 2, "int4"), ("w8a8_static", tmp / "w8a8-native", 1, 2, None)):
        ref_model = int4 if quantize else load_model(source, "float32")[0]
        ref = Generator(ref_model, None, engine_config(), max_num_batched_tokens=TOKEN_BUDGET)
        ecfg = engine_config(tp, pp)
        gen = Generator.from_pretrained(source, dtype="float32", attention="xla", tensor_parallel=tp, pipeline_parallel=pp,
                                        quantize=quantize, max_num_seqs=ecfg.max_num_seqs, block_size=ecfg.block_size,
                                        num_blocks=ecfg.num_blocks, max_model_len=ecfg.max_model_len,
                                        max_num_batched_tokens=TOKEN_BUDGET)
        runner = gen.engine.runner
        pmodel = nnx.merge(runner.graphdef, runner.params)
        ref_logits, logits = ref.logits(LOGITS_PROMPT), gen.logits(LOGITS_PROMPT)
        out[label] = {"tp": tp, "pp": pp, "ref_tokens": [o.token_ids for o in ref.generate(PROMPTS, sp)],
                      "tokens": [o.token_ids for o in gen.generate(PROMPTS, sp)],
                      "logits_rel_err": float(np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits))),
                      "compilations_after_warmup": gen.stats()["compilations_after_warmup"],
                      "leaves": _quantized_leaves(pmodel, pmodel.mesh)}
    return out


def main(tmp: Path) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator
    from jaxinfer.pipeline import load_pipelined, pipeline_decoder
    from jaxinfer.runner import CompileCounter
    from jaxinfer.sharding import bytes_per_device, make_mesh
    from jaxinfer.weights import load_model, save_native

    t0 = time.perf_counter()
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    # logit_bias rides in the stacked micro-batches' sampling rows (a +5 and a ban)
    sp_bias = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias={3: 5.0, 7: -100})
    result: dict = {"n_devices": len(jax.devices()), "configs": {}}
    for name, layouts in LAYOUTS.items():
        folder = tmp / name
        ref_model, cfg = load_model(folder, "float32")
        ref = Generator(ref_model, None, engine_config(), max_num_batched_tokens=TOKEN_BUDGET)
        ref_logits = ref.logits(LOGITS_PROMPT)
        ref_tokens = [o.token_ids for o in ref.generate(PROMPTS, sp)]
        ref_shared = [o.token_ids for o in ref.generate(SHARED, sp)]
        ref_biased = [o.token_ids for o in ref.generate(PROMPTS, sp_bias)]
        entry = {"ref_tokens": ref_tokens, "ref_shared": ref_shared, "ref_biased": ref_biased, "ref_compiles": ref.stats()["compilations_after_warmup"], "layouts": {}}
        for tp, pp, micro in layouts:
            t_layout = time.perf_counter()
            gen = pipelined_generator(folder, tp, pp, micro)
            runner = gen.engine.runner
            model = nnx.merge(runner.graphdef, runner.params)
            mesh = model.mesh
            assert mesh.shape["tensor"] == tp and mesh.shape["pipeline"] == pp
            logits = gen.logits(LOGITS_PROMPT)
            c0 = CompileCounter.count
            tokens = [o.token_ids for o in gen.generate(PROMPTS, sp)]
            hits0 = gen.stats()["prefix_cache_hits"]
            shared = [o.token_ids for o in gen.generate(SHARED, sp)]
            biased = [o.token_ids for o in gen.generate(PROMPTS, sp_bias)]
            per_device = bytes_per_device(model)
            entry["layouts"][f"tp{tp}pp{pp}"] = {
                "tp": tp, "pp": pp, "microbatches": runner.microbatches,
                "logits_rel_err": float(np.max(np.abs(logits - ref_logits)) / np.max(np.abs(ref_logits))),
                "tokens": tokens, "generate_compiles": CompileCounter.count - c0, "biased_tokens": biased,
                "shared_tokens": shared, "shared_cache_hits": gen.stats()["prefix_cache_hits"] - hits0,
                "compilations_after_warmup": gen.stats()["compilations_after_warmup"],
                "kv_blocks_free_after": gen.stats()["kv_blocks_free"], "kv_blocks_total": gen.stats()["kv_blocks_total"],
                "compute_bound_tokens": gen.engine.scheduler.cfg.compute_bound_tokens,
                "weights": _weights(model, mesh),
                "per_device_param_bytes": [per_device[d] for d in mesh.devices.flat],
                "kv_per_device_bytes": [bytes_per_device(runner.kv_pages)[d] for d in mesh.devices.flat],
                "kv_spec": list(runner.kv_pages[0].k.sharding.spec),
                "seconds": time.perf_counter() - t_layout,
            }
        if name == "llama-gqa-llama3":   # int8 KV pages (with their scales) split over stages too
            ref8 = Generator(ref_model, None, engine_config(kv_dtype="int8"), max_num_batched_tokens=TOKEN_BUDGET)
            gen8 = pipelined_generator(folder, 2, 2, None, kv_dtype="int8")
            entry["int8_kv"] = {"ref_tokens": [o.token_ids for o in ref8.generate(PROMPTS, sp)],
                                "tokens": [o.token_ids for o in gen8.generate(PROMPTS, sp)],
                                "compilations_after_warmup": gen8.stats()["compilations_after_warmup"],
                                "scale_spec": list(gen8.engine.runner.kv_pages[0].k_scale.sharding.spec)}
        if name == "llama-gqa-llama3":
            entry["quantized"] = quantized_runs(tmp, folder, sp)
        # the other two ways in: an in-memory Decoder and a native checkpoint, same stacked values
        mesh = make_mesh(pipeline_parallel=2)
        from_hf = nnx.state(load_pipelined(folder, "float32", mesh), nnx.Param)
        save_native(ref_model, tmp / f"{name}-native", "float32")
        others = {"decoder": pipeline_decoder(ref_model, mesh),
                  "native": load_pipelined(tmp / f"{name}-native", "float32", mesh)}
        entry["same_stacking"] = {
            k: bool(jax.tree.all(jax.tree.map(lambda a, b: a.sharding == b.sharding and np.array_equal(a, b),
                                              from_hf, nnx.state(m, nnx.Param))))
            for k, m in others.items()}
        result["configs"][name] = entry
    try:   # 3 layers do not split over 2 stages
        load_pipelined(tmp / "three-layers", "float32", make_mesh(pipeline_parallel=2))
        result["indivisible_error"] = None
    except ValueError as e:
        result["indivisible_error"] = str(e)
    # pipeline.py's direct way in (a PipelinedDecoder into Generator, the config's pipeline_parallel
    # left at 1): the same refusals as from_pretrained's, by the model's kind (prompt_logprobs once
    # killed the engine, the host tier crashed the build); a one-stage mesh is refused by name
    direct = Generator(load_pipelined(tmp / "llama-gqa-llama3", "float32", make_mesh(pipeline_parallel=2)), None,
                       engine_config(), max_num_batched_tokens=TOKEN_BUDGET, warmup=False)
    refusals = {}
    for key, fn in (("prompt_logprobs", lambda: direct.generate([PROMPTS[0]], SamplingParams(max_tokens=2, prompt_logprobs=1))),
                    ("kv_offload", lambda: Generator(load_pipelined(tmp / "llama-gqa-llama3", "float32",
                                                                    make_mesh(pipeline_parallel=2)), None,
                                                     dataclasses.replace(engine_config(), kv_offload_bytes=1 << 20),
                                                     warmup=False)),
                    ("one_stage", lambda: load_pipelined(tmp / "llama-gqa-llama3", "float32", make_mesh(pipeline_parallel=1)))):
        try:
            fn()
            refusals[key] = None
        except ValueError as e:
            refusals[key] = str(e)
    refusals["after"] = [o.token_ids for o in direct.generate(PROMPTS[:1], sp)]
    result["direct_refusals"] = refusals
    result["seconds"] = time.perf_counter() - t0
    return result


def bubble(tmp: Path, pp: int = 4, n_seqs: int = 8, prompt_len: int = 16, repeats: int = 5) -> dict:
    """Median engine step time of one fixed batch (n_seqs prompts of prompt_len: one prefill step,
    then decode steps of n_seqs tokens) for M = 1, pp, 2 pp micro-batches, and on one device."""
    import numpy as np

    from jaxinfer.config import SamplingParams
    from jaxinfer.generator import Generator
    from jaxinfer.pipeline import bubble_fraction, load_pipelined
    from jaxinfer.sharding import make_mesh
    from jaxinfer.weights import load_model

    from jaxinfer.config import EngineConfig
    folder = tmp / "bubble"
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(prompt_len)] for i in range(n_seqs)]
    out = {"pp": pp, "n_seqs": n_seqs, "prompt_len": prompt_len, "runs": {}}
    for label, micro in [("one device", None), ("M=1", 1), (f"M={pp}", pp), (f"M={2 * pp}", 2 * pp)]:
        if micro is None:
            model, _ = load_model(folder, "float32")
        else:
            model = load_pipelined(folder, "float32", make_mesh(pipeline_parallel=pp))
        ecfg = EngineConfig(dtype="float32", attention="xla", max_num_seqs=n_seqs, block_size=8, num_blocks=64,
                            max_model_len=64, pipeline_parallel=pp if micro else 1, pipeline_microbatches=micro)
        # no warm-up (it would compile every token bucket): the first repeat compiles the two shapes
        # used, and the medians over the repeats leave those compiling steps out
        gen = Generator(model, None, ecfg, max_num_batched_tokens=n_seqs * prompt_len, warmup=False)
        prefill, decode = [], []
        for _ in range(repeats):
            engine = gen.engine
            for p in prompts:
                engine.add_request(p, sp)
            first = True
            while engine.has_unfinished():
                t = time.perf_counter()
                engine.step()
                (prefill if first else decode).append(time.perf_counter() - t)
                first = False
        out["runs"][label] = {"prefill_step_ms": 1e3 * float(np.median(prefill)),
                              "decode_step_ms": 1e3 * float(np.median(decode)),
                              "bubble_model": None if micro is None else bubble_fraction(min(micro, n_seqs), pp)}
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--bubble":
        print("RESULT " + json.dumps(bubble(Path(sys.argv[2]))), flush=True)
    else:
        print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
