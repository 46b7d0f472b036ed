"""Fused projections (models.decoder.fuse_decoder): one qkv and one gate_up matmul per layer.

The reference is always the unfused model built from the same weights. Fusion only concatenates
(and, for tensor parallelism, regroups) columns, so each output element is the same dot product;
XLA may sum it in another order inside a wider matmul, which moves a float32 result by a few ulps
times sqrt(K) relative to the terms' magnitude (rounding errors of K terms add up like a random
walk). The logits carry that once per layer, so they must agree within
    reorder_bound(K, L) = 4 ulps * sqrt(K) * L      (relative to max |logits|, K = d_model)
and nothing looser: a wrong column (a k head where a q head belongs) moves logits by O(1).

Single device, every family of tests/hf_models.py: logits for the plain layout and for the
4-device layout (KV heads repeated, columns regrouped: the forward is the same on one device),
exact round trips through unfuse_decoder, int8 and int4 (quantizing commutes with fusing, bit for
bit), native save and HF export writing the unfused names, and Generator.from_pretrained fusing.
On 8 fake CPU devices (a subprocess running this file as a module): TP 2 and 4 through
from_pretrained against one device, the fused weights split over "tensor" with no more collectives
than the unfused Megatron layout, the KV pages split when heads are repeated, greedy generation.

    python -m tests.test_fused_weights DIR     # the worker; DIR/folders.json: name -> HF folder
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ConfigError
from jaxinfer.models.decoder import FusedLayout, fuse_decoder, quantize_decoder, unfuse_decoder
from jaxinfer.weights import load_model

EPS32 = float(np.finfo(np.float32).eps)
PROMPT = [3, 17, 42, 9, 60, 5, 77, 12, 8, 30, 33, 1]
# name -> tensor-parallel degrees for the fake-device worker: KV heads that divide (llama tp 2),
# that are repeated (llama tp 4: 2 KV heads; MQA), MHA without a gated MLP (gpt2), and 6 heads
# over 4 devices (not divisible: the fused layout falls back to one replicated group)
TP_CASES = {"llama-gqa-llama3": (2, 4), "llama-mqa-tied-linear": (2, 4), "gpt2": (4,), "bloom-6heads-postnorm": (4,)}
TP_QUANT = ("llama-mqa-tied-linear", 2)


def reorder_bound(k: int, n_layers: int) -> float:
    """Relative bound on the logits of two float32 forwards that differ only in summation order."""
    return 4 * EPS32 * np.sqrt(k) * n_layers


def forward(model) -> np.ndarray:
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q)[0])
    return np.asarray(fn(params, jnp.asarray(PROMPT, jnp.int32), jnp.arange(len(PROMPT), dtype=jnp.int32)))


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def flat(model) -> dict:
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(model, nnx.Param).flat_state()}


def assert_same_params(a, b) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        la, lb = jax.tree.leaves(fa[name]), jax.tree.leaves(fb[name])
        assert jax.tree.structure(fa[name]) == jax.tree.structure(fb[name]), name
        assert all(x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb)), name


# ------------------------------------------------------------------------------ one device

def _families():
    from tests.hf_models import CONFIGS
    return list(CONFIGS)


import pytest  # noqa: E402  (after the worker-safe imports above)


@pytest.mark.parametrize("name", _families())
def test_fused_logits_match_unfused(hf_model_dir, name):
    model, cfg = load_model(hf_model_dir(name), "float32")
    ref = forward(model)
    bound = reorder_bound(cfg.d_model, cfg.n_layers)
    for tp in (1, 4):
        # OLMo 2's k norm spans the KV heads, Command R+'s has weights per KV head: neither is repeated
        if (cfg.qk_norm_full or cfg.qk_norm_heads) and tp > cfg.n_kv_heads:
            with pytest.raises(ConfigError, match=f"tensor_parallel={tp} splits {cfg.n_kv_heads} KV heads"):
                fuse_decoder(model, tp)
            continue
        fused = fuse_decoder(model, tp)
        names = flat(fused)
        first = next(i for i in range(cfg.n_layers) if not cfg.is_state_layer(i))   # (conv, DeltaNet layers: none)
        assert (f"layers/{first}/attn/qkv" in names) != cfg.mla   # latent attention has no q / k / v to fuse
        assert not any(n.endswith(("attn/q", "attn/k", "attn/v")) for n in names)
        assert ("layers/0/mlp/gate_up" in names) == cfg.gated_mlp and "layers/0/mlp/gate" not in names
        assert fused.cfg.n_kv_heads == cfg.n_kv_heads * fused.fused.kv_replicas
        err = rel_diff(forward(fused), ref)
        assert err <= bound, (name, tp, err, bound)
        back = unfuse_decoder(fused)
        assert back.cfg == cfg and back.fused is None
        assert_same_params(back, model)


def test_layout_for_tp():
    from jaxinfer.config import ModelConfig
    cfg = lambda h, kv, f=96: ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=h, n_kv_heads=kv,  # noqa: E731
                                          head_dim=8, ffn_dim=f)
    assert FusedLayout.for_tp(cfg(8, 2), 1) == FusedLayout(1, 1, 1)
    assert FusedLayout.for_tp(cfg(8, 2), 2) == FusedLayout(2, 2, 1)
    assert FusedLayout.for_tp(cfg(8, 2), 4) == FusedLayout(4, 4, 2)       # each KV head on 2 devices
    assert FusedLayout.for_tp(cfg(8, 1), 8) == FusedLayout(8, 8, 8)       # MQA: one copy per device
    assert FusedLayout.for_tp(cfg(6, 3), 2) == FusedLayout(2, 2, 2)       # 3 heads per device need 2 KV heads
    assert FusedLayout.for_tp(cfg(6, 2), 4) == FusedLayout(1, 4, 1)     # heads do not divide: one group
    assert FusedLayout.for_tp(cfg(8, 2, f=90), 4) == FusedLayout(4, 1, 2)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])   # fp8: codes stored [N, K], fused as [K, N]
@pytest.mark.parametrize("name", ["llama-mqa-tied-linear", "gpt2"])   # biases + MQA; MHA, plain MLP
def test_quantized_fusion(hf_model_dir, name, method):
    model, cfg = load_model(hf_model_dir(name), "float32")
    quantized = quantize_decoder(load_model(hf_model_dir(name), "float32")[0], method)
    ref = forward(quantized)
    for tp in (1, 4):
        fused = fuse_decoder(quantized, tp)
        assert_same_params(fused, quantize_decoder(fuse_decoder(model, tp), method))   # per-column scales
        assert_same_params(unfuse_decoder(fused), quantized)
        err = rel_diff(forward(fused), ref)
        assert err <= reorder_bound(cfg.d_model, cfg.n_layers), (tp, err)


def test_fused_static_activation_range_holds_every_part():
    """q / k / v with different static W8A8 input quantizers fuse into one that clips none of
    them (vLLM's rule for fused static int8 layers). By hand: symmetric scales 0.1, 0.2, 0.15 ->
    0.2; asymmetric (0.1, z -100) covers [-2.8, 22.7] and (0.05, z 100) [-11.4, 1.35]: the union
    [-11.4, 22.7] over 255 steps is 34.1 / 255 with the zero point round(-128 + 11.4 * 255 / 34.1)
    = round(-42.75) = -43. Equal quantizers stay as they are, bit for bit."""
    from jaxinfer.models.decoder import _fused_act_range
    from jaxinfer.quant import quantize_int8
    w = quantize_int8(jnp.ones((8, 4), jnp.float32))
    part = lambda s, z=None: dataclasses.replace(  # noqa: E731
        w, act_bits=8, act_scale=jnp.float32(s), act_zero=None if z is None else jnp.int32(z))
    sym = _fused_act_range([part(0.1), part(0.2), part(0.15)])
    assert sym["act_zero"] is None and float(sym["act_scale"]) == np.float32(0.2)
    asym = _fused_act_range([part(0.1, -100), part(0.05, 100)])
    assert abs(float(asym["act_scale"]) - 34.1 / 255) <= 1e-6 * 34.1 / 255 and int(asym["act_zero"]) == -43
    same = _fused_act_range([part(0.3, 7), part(0.3, 7)])
    assert float(same["act_scale"]) == np.float32(0.3) and int(same["act_zero"]) == 7
    assert _fused_act_range([w, w]) == dict(act_scale=None, act_zero=None)


def test_save_and_export_write_unfused_names(hf_model_dir, tmp_path):
    from jaxinfer.export import hf_tensors
    from jaxinfer.weights import load_native, save_native

    model, _ = load_model(hf_model_dir("llama-gqa-llama3"), "float32")
    fused = fuse_decoder(model, 4)
    save_native(fused, tmp_path / "native", "float32")
    assert_same_params(load_native(tmp_path / "native"), model)
    ours, theirs = hf_tensors(fused), hf_tensors(model)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_from_pretrained_fuses(hf_model_dir):
    from jaxinfer import Generator

    path = hf_model_dir("qwen2-tied")
    # attention="xla": the reference's attention (on a GPU "auto" would take the flash kernel, whose
    # softmax differs by more than a summation order; this test is about the fused projections)
    gen = Generator.from_pretrained(path, dtype="float32", attention="xla", max_num_seqs=2, num_blocks=16,
                                    max_model_len=64, max_num_batched_tokens=16, warmup=False)
    names = {"/".join(map(str, p)) for p, _ in nnx.state(gen.engine.runner.params, nnx.Param).flat_state()}
    assert {"layers/0/attn/qkv", "layers/0/attn/qkv_bias", "layers/0/mlp/gate_up"} <= names
    model, cfg = load_model(path, "float32")
    assert rel_diff(gen.logits(PROMPT), forward(model)) <= reorder_bound(cfg.d_model, cfg.n_layers)


# ------------------------------------------------------------------------------ 8 fake devices

@pytest.fixture(scope="module")
def tp_result(hf_model_dir, tmp_path_factory):
    from tests.fake_devices import run_worker

    tmp = tmp_path_factory.mktemp("fused-tp")
    (tmp / "folders.json").write_text(json.dumps({name: str(hf_model_dir(name)) for name in TP_CASES}))
    return run_worker("tests.test_fused_weights", tmp)


def _tp_runs(result):
    runs = result["runs"]
    assert sorted(runs) == sorted([f"{n}/tp{tp}" for n, tps in TP_CASES.items() for tp in tps] +
                                  [f"{TP_QUANT[0]}/tp{TP_QUANT[1]}/{m}" for m in ("int8", "int4")])
    return runs.items()


def test_tp_logits_match_one_device(tp_result):
    for key, run in _tp_runs(tp_result):
        assert run["rel_err"] <= run["bound"], (key, run["rel_err"], run["bound"])


def test_tp_fused_weights_split_whole_heads_per_device(tp_result):
    for key, run in _tp_runs(tp_result):
        layout, tp = run["layout"], run["tp"]
        sharded = layout["attn_shards"] == tp
        if "int" in key:    # QuantizedWeights split their columns like float weights (sharding.py)
            assert run["qkv_spec"] == ("P(None, 'tensor')" if sharded else "P()"), (key, run["qkv_spec"])
            continue
        assert run["qkv_spec"] == ("P(None, 'tensor')" if sharded else "P()"), (key, run["qkv_spec"])
        assert run["qkv_shard_bytes"] == [run["qkv_bytes"] // (tp if sharded else 1)] * tp, key
        if run["gated"]:
            assert run["gate_up_spec"] == "P(None, 'tensor')", key
        # the KV pages follow the fused cfg: split over "tensor" when heads divide or are repeated
        assert run["kv_spec"] == ("P('tensor',)" if sharded else "P()"), (key, run["kv_spec"])


def test_tp_fused_layout_adds_no_communication(tp_result):
    for key, run in _tp_runs(tp_result):
        if "int" in key:
            continue
        assert run["collectives_fused"] <= run["collectives_unfused"], (key, run)
    # the counter sees communication: a layout grouped for 2 devices placed on 4 needs some
    mis = tp_result["misgrouped"]
    assert mis["collectives"] > mis["collectives_right_layout"] and mis["rel_err"] <= mis["bound"], mis


def test_tp_greedy_generation_identical(tp_result):
    gen = tp_result["generation"]
    assert gen["tokens"] == gen["ref_tokens"] and len(set(gen["ref_tokens"][0])) > 1, gen


# ------------------------------------------------------------------------------ the worker

def _collectives(fn, args) -> int:
    hlo = fn.lower(*args).compile().as_text()
    return len(re.findall(r"\b(all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\(", hlo))


def _jitted(model):
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q)[0])
    args = (params, jnp.asarray(PROMPT, jnp.int32), jnp.arange(len(PROMPT), dtype=jnp.int32))
    return fn, args


def _worker(tmp: Path) -> dict:
    from jaxinfer import Generator, SamplingParams
    from jaxinfer.config import EngineConfig
    from jaxinfer.sharding import bytes_per_device, make_mesh, shard_decoder

    folders = json.loads((tmp / "folders.json").read_text())
    kw = dict(dtype="float32", attention="xla", max_num_seqs=2, block_size=8, num_blocks=16, max_model_len=64,
              max_num_batched_tokens=16, warmup=False)
    result: dict = {"n_devices": len(jax.devices()), "runs": {}}
    cases = [(n, tp, None) for n, tps in TP_CASES.items() for tp in tps] + \
            [(TP_QUANT[0], TP_QUANT[1], m) for m in ("int8", "int4")]
    refs = {}
    for name, tp, quant in cases:
        t0 = time.perf_counter()
        if (name, quant) not in refs:
            ref_model, cfg = load_model(folders[name], "float32")
            if quant:
                quantize_decoder(ref_model, quant)
            refs[name, quant] = forward(ref_model), cfg
        ref, cfg = refs[name, quant]
        gen = Generator.from_pretrained(folders[name], tensor_parallel=tp, quantize=quant, **kw)
        model = nnx.merge(gen.engine.runner.graphdef, gen.engine.runner.params)
        attn, mlp = model.layers[0].attn, model.layers[0].mlp
        qkv = attn.qkv.get_value()
        leaf = qkv.q if quant else qkv
        run = {"tp": tp, "layout": dataclasses.asdict(model.fused), "gated": cfg.gated_mlp,
               "rel_err": rel_diff(gen.logits(PROMPT), ref), "bound": reorder_bound(cfg.d_model, cfg.n_layers),
               "qkv_spec": str(leaf.sharding.spec), "qkv_bytes": int(leaf.nbytes),
               "qkv_shard_bytes": sorted(bytes_per_device({"w": leaf}).values()),
               "gate_up_spec": str(mlp.gate_up.get_value().sharding.spec) if cfg.gated_mlp and not quant else None,
               "kv_spec": str(gen.engine.runner.kv_pages[0].k.sharding.spec)}
        if not quant:
            mesh = make_mesh(tensor_parallel=tp)
            unfused, _ = load_model(folders[name], "float32", mesh=mesh)
            run["collectives_unfused"] = _collectives(*_jitted(unfused))
            run["collectives_fused"] = _collectives(*_jitted(model))
        if (name, tp, quant) == ("llama-gqa-llama3", 4, None):   # KV heads repeated: pages 1 head per device
            sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            prompts = [PROMPT[:5], PROMPT[5:8]]
            ecfg = EngineConfig(dtype="float32", attention="xla", max_num_seqs=2, block_size=8, num_blocks=16,
                                max_model_len=64)
            ref_gen = Generator(load_model(folders[name], "float32")[0], None, ecfg, 16, warmup=False)
            result["generation"] = {"tokens": [o.token_ids for o in gen.generate(prompts, sp)],
                                    "ref_tokens": [o.token_ids for o in ref_gen.generate(prompts, sp)]}
            # the layout grouped for 2 devices, placed on 4: still correct, but XLA must move columns
            mis = shard_decoder(fuse_decoder(load_model(folders[name], "float32")[0], 2), mesh)
            fn, args = _jitted(mis)
            result["misgrouped"] = {"collectives": _collectives(fn, args), "collectives_right_layout":
                                    run["collectives_fused"], "rel_err": rel_diff(np.asarray(fn(*args)), ref),
                                    "bound": run["bound"]}
        run["seconds"] = time.perf_counter() - t0
        result["runs"][f"{name}/tp{tp}" + (f"/{quant}" if quant else "")] = run
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(_worker(Path(sys.argv[1]))), flush=True)
