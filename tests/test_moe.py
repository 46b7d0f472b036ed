"""Mixtral, Qwen3-MoE and gpt-oss (issue 42, mixtures of experts) through the one decoder.

test_hf_parity.py runs every tiny config's logits and 32 greedy tokens against transformers on the
XLA attention (8-token budget: the 24-token prompt prefilled in 3 chunks; sliding windows of 5-7
crossed; GQA and MQA per family). Here: the same through the Pallas kernels (interpreted on CPU:
attention sinks in the kernels); the routers against transformers' own router modules; the grouped
expert FFN (tile loop and ragged_dot, float and quantized, with padding rows) against a float64
per-token reference; prefix caching, n-gram speculation and int8 experts on Qwen3-MoE with zero
compilations after warm-up; tensor parallelism against one device (tests/moe_worker.py); YaRN
against transformers' RoPE init; parameter counts against transformers; config.json parsing and the
refusals; fusion, quantization and the native format round trip of expert weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxinfer import Generator
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.moe import MoE, route, set_moe_impl, tile_rows
from jaxinfer.quant import QuantizedWeight, dequantize
from tests.hf_models import CONFIGS, build_hf_model
from tests.precision import assert_rel_close, dot_chain_rtol, unit_roundoff
from tests.two_rounds import GREEDY, naive_greedy, serve_two_rounds, two_round_prompts

MOE = [n for n in CONFIGS if n.startswith("gpt-oss") or n.split("-")[0] in ("qwen3moe", "mixtral", "qwen2moe", "glm4moe",
                                                                            "deepseekv3", "deepseekv2")]
ARCH = {"qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt": "GptOssForCausalLM",
        "qwen2moe": "Qwen2MoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "deepseekv3": "DeepseekV3ForCausalLM",
        "deepseekv2": "DeepseekV2ForCausalLM", "phimoe": "PhimoeForCausalLM"}
PROMPT_LEN = 24
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4, block_size=8,
              num_blocks=4 * 64 // 8 + 1, warmup=False)


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def cfg_dict(name: str, overrides: dict | None = None) -> dict:
    return (json.loads(build_hf_model(name, overrides=overrides).config.to_json_string())
            | {"architectures": [ARCH[name.split("-")[0]]]})


# ------------------------------------------------------------------------------ the Pallas kernels

@pytest.mark.device
@pytest.mark.parametrize("name", MOE)
def test_pallas_kernels_match_transformers(name, hf_model_dir):
    """Flash attention (the full forward) and ragged paged attention (chunked prefill + decode) with
    each family's attention (sinks, alternating windows, YaRN, q/k norms) and its experts."""
    gen = Generator.from_pretrained(hf_model_dir(name), attention="pallas", **ENGINE)
    assert gen.engine.resolved.attention == "pallas"
    hf = build_hf_model(name)
    ids = np.random.RandomState(0).randint(3, hf.config.vocab_size, PROMPT_LEN).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        cont = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert _rel_err(gen.logits(ids), ref) < 1e-4
    assert gen.generate([ids], GREEDY)[0].token_ids == cont


# ------------------------------------------------------------------------------ routing

@pytest.mark.parametrize("name, overrides", [
    ("mixtral-gqa", None), ("qwen3moe-gqa", None), ("qwen3moe-mqa-window-yarn", None), ("gpt-oss", None),
    ("qwen2moe-shared", None), ("glm4moe-groups", None), ("deepseekv3-mla", None), ("deepseekv2-groups", None),
    ("deepseekv2-groups", {"topk_method": "greedy"}), ("deepseekv2-groups", {"n_group": 8, "topk_group": 3}),
    ("phimoe", None)])
def test_routing_matches_transformers_routers(name, overrides):
    """Our route() on the router logits against HF's router module on the same hidden states: the
    same k experts per token with the same weights (Mixtral: softmax-top-k-renormalize in HF, top-k
    then softmax here; Qwen3-MoE with and without norm_topk_prob; gpt-oss: biased logits; GLM-4.5:
    sigmoid scores, the random correction, 2 of 4 groups kept, renormalized, times 2.5; DeepSeek-V2:
    softmax over all, 2 of 4 groups kept by their best expert, 3 of 8 one-expert groups, or none
    limited (greedy), times 16;
    PhiMoE: sparsemixer's two picks, each weighted over the logits within its margin)."""
    hf = build_hf_model(name, overrides=overrides)
    layer = next(m for m in hf.model.layers if hasattr(m.mlp, "experts"))
    router = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, scores, idx = router(x)
    cfg = model_config_from_hf(cfg_dict(name, overrides))
    correction = getattr(router, "e_score_correction_bias", None)
    weights, experts = route(jnp.asarray(logits.numpy()), cfg.num_experts_per_tok, cfg.moe_routing,
                             cfg.moe_norm_topk, None if correction is None else jnp.asarray(correction.numpy()),
                             cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale, cfg.moe_router_jitter)
    order = np.argsort(np.asarray(experts), axis=1)
    hf_order = np.argsort(idx.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(idx.numpy(), hf_order, 1))
    # softmax in float32 on both sides, in other orders (and Mixtral's renormalized over k): each
    # weight carries an exp's few-ulp error, the sum over the experts' (E terms) and the k kept ones'
    # relative error, and two divisions; the weights are at most 1
    rtol = 2 * (cfg.num_experts + cfg.num_experts_per_tok + 4) * unit_roundoff("float32")
    assert_rel_close(np.take_along_axis(np.asarray(weights), order, 1),
                     np.take_along_axis(scores.float().numpy(), hf_order, 1), rtol, f"{name} routing weights")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lfm2_moe_and_llama4_routing_match_transformers_routers(dtype):
    """LFM2-MoE's router (Lfm2MoeTopKRouter: sigmoids of the model-dtype logits, the float32 expert_bias
    added for the choice, renormalized over their sum + 1e-6, times 1.5, all in the model's dtype) and
    Llama 4's (Llama4Router: top-k of the logits, each weighted by its sigmoid, rounded to the dtype) on
    the same hidden states: the same experts, and the same weights (to float32 rounding; in bfloat16
    the very values, each operation rounded where transformers rounds it)."""
    for name in ("lfm2-moe", "llama4-maverick"):
        hf = build_hf_model(name).to(getattr(torch, dtype))
        ff = next(m.feed_forward for m in hf.model.layers if hasattr(m.feed_forward, "experts"))
        x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
        cfg = model_config_from_hf(json.loads(hf.config.to_json_string()))
        with torch.no_grad():
            if name == "lfm2-moe":
                logits, hf_w, idx = ff.gate(x, ff.expert_bias)
            else:   # [T, E] with the chosen sigmoids, -inf elsewhere (0 after the sigmoid)
                dense, logits = ff.router(x)
                idx = torch.topk(logits, cfg.num_experts_per_tok, dim=1).indices
                hf_w = dense.gather(1, idx)
        correction = jnp.asarray(ff.expert_bias.float().numpy()) if name == "lfm2-moe" else None
        weights, experts = route(jnp.asarray(logits.float().numpy()), cfg.num_experts_per_tok, cfg.moe_routing,
                                 cfg.moe_norm_topk, correction, scale=cfg.moe_routed_scale, norm_eps=cfg.moe_norm_eps,
                                 scores_dtype=jnp.bfloat16 if dtype == "bfloat16" and cfg.moe_scores_in_dtype else None)
        # a token whose k-th and (k+1)-th choice values tie (bfloat16 logits do) may take either expert
        choice = logits.float().numpy() if name != "lfm2-moe" else (
            torch.sigmoid(logits).float() + ff.expert_bias.float()).numpy()
        top = -np.sort(-choice, axis=1)
        clear = top[:, cfg.num_experts_per_tok - 1] != top[:, cfg.num_experts_per_tok]
        assert clear.sum() >= 48, clear.sum()
        order, hf_order = np.argsort(np.asarray(experts), axis=1), np.argsort(idx.numpy(), axis=1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1)[clear],
                                      np.take_along_axis(idx.numpy(), hf_order, 1)[clear])
        got = np.take_along_axis(np.asarray(weights), order, 1)[clear]
        if dtype == "bfloat16":   # Llama 4's weights are rounded when they scale the inputs (moe.py)
            got = np.asarray(jnp.asarray(got).astype(jnp.bfloat16).astype(jnp.float32))
        want = np.take_along_axis(hf_w.float().numpy(), hf_order, 1)[clear]
        # float32: a sigmoid's few ulps, a k-term sum and a division; bfloat16: bit for bit
        rtol = 8 * unit_roundoff("float32") if dtype == "float32" else 0.0
        assert_rel_close(got, want, rtol, f"{name} routing weights ({dtype})")


# ------------------------------------------------------------------------------ the grouped expert FFN

def _tiny_moe(quantize: str | None, fused: bool, limit: float | None, seed: int = 0) -> tuple[MoE, ModelConfig]:
    cfg = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64,
                      num_experts=6, num_experts_per_tok=2, mlp_bias=True, router_bias=True, swiglu_limit=limit,
                      moe_routing="softmax_topk", moe_norm_topk=False)
    moe = MoE(cfg, jnp.float32, nnx.Rngs(seed), shards=2 if fused else None)
    for _, var in nnx.state(moe, nnx.Param).flat_state():   # biases too, and large enough that the clamp bites
        var.set_value(jax.random.normal(jax.random.PRNGKey(seed + 1), var.get_value().shape) * 0.3)
        seed += 1
    if quantize:
        from jaxinfer.quant import quantize_experts
        for name in ("gate", "up", "gate_up", "down"):
            p = getattr(moe, name)
            if p is not None:
                p.set_value(quantize_experts(p.get_value(), quantize, group_size=16))
    return moe, cfg


def _reference(moe: MoE, cfg: ModelConfig, x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """float64, token by token: each valid token through its k routed experts' gated MLP, weighted."""
    val = lambda p: None if p is None else np.asarray(  # noqa: E731
        dequantize(p.get_value()) if isinstance(p.get_value(), QuantizedWeight) else p.get_value(), np.float64)
    f = cfg.expert_ffn_dim
    if moe.gate_up is not None:   # shards groups of [gate | up] columns per expert
        gu = val(moe.gate_up).reshape(cfg.num_experts, cfg.d_model, moe.shards, 2, f // moe.shards)
        gate, up = (gu[..., i, :].reshape(cfg.num_experts, cfg.d_model, f) for i in (0, 1))
        gub = val(moe.gate_up_bias).reshape(cfg.num_experts, moe.shards, 2, f // moe.shards)
        gate_b, up_b = (gub[..., i, :].reshape(cfg.num_experts, f) for i in (0, 1))
    else:
        gate, up, gate_b, up_b = val(moe.gate), val(moe.up), val(moe.gate_bias), val(moe.up_bias)
    down, down_b, router, router_b = val(moe.down), val(moe.down_bias), val(moe.router), val(moe.router_bias)
    out = np.zeros_like(x, np.float64)
    for t in np.flatnonzero(valid):
        logits = x[t] @ router + router_b
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        for e in np.argsort(-probs)[:cfg.num_experts_per_tok]:
            g, u = x[t] @ gate[e] + gate_b[e], x[t] @ up[e] + up_b[e]
            if cfg.swiglu_limit is not None:
                g, u = np.minimum(g, cfg.swiglu_limit), np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
                h = (u + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))
            else:
                h = g / (1 + np.exp(-g)) * u
            out[t] += probs[e] * (h @ down[e] + down_b[e])
    return out


@pytest.mark.parametrize("impl", ["tiles", "ragged_dot"])
@pytest.mark.parametrize("quantize,fused,limit,tokens", [(None, False, None, 37), (None, True, 0.5, 8),
                                                         ("int8", True, None, 21), ("int4", False, 0.5, 64),
                                                         ("fp8", True, None, 3)])
def test_grouped_ffn_matches_per_token_reference(impl, quantize, fused, limit, tokens):
    """Both implementations against the float64 reference, on the weights as stored (quantized ones
    dequantized): bucket padding (every fifth token invalid) outputs exactly 0; with 37 tokens over 6
    experts some expert gets rows past one tile, with 3 some experts get none."""
    moe, cfg = _tiny_moe(quantize, fused, limit)
    moe.impl = impl
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, cfg.d_model)).astype(np.float32)
    valid = np.arange(tokens) % 5 != 4
    got = np.asarray(jax.jit(lambda m, a, v: m(a, v))(moe, jnp.asarray(x), jnp.asarray(valid)))
    want = _reference(moe, cfg, x.astype(np.float64), valid)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    assert np.all(got[~valid] == 0)


def test_grouped_matmul_gets_tokens_times_k_rows():
    """The work follows T x k rows: ragged_dot's operands are the [T k, ...] sorted rows (its groups
    are the E experts' row counts), and the tile loop's tile height is the smallest power of two at
    or above half the mean rows per expert (at most 32), so it computes at most T k + used experts x
    (tile - 1) rows."""
    moe, cfg = _tiny_moe(None, True, None)
    moe.impl = "ragged_dot"
    t, k = 40, cfg.num_experts_per_tok
    jaxpr = jax.make_jaxpr(lambda m, a: m(a))(moe, jnp.zeros((t, cfg.d_model)))
    shapes = [tuple(e.invars[0].aval.shape) + tuple(e.invars[2].aval.shape) for e in jaxpr.jaxpr.eqns
              if e.primitive.name == "ragged_dot_general"]
    assert shapes == [(t * k, cfg.d_model, cfg.num_experts), (t * k, cfg.expert_ffn_dim, cfg.num_experts)]
    assert [tile_rows(r, 8) for r in (2, 16, 100, 1024, 4096)] == [1, 1, 8, 32, 32]


# ------------------------------------------------------------------------------ engine features on Qwen3-MoE

FEATURES = dict(ENGINE, max_model_len=96, max_num_batched_tokens=16, token_buckets=[16], num_blocks=4 * 96 // 8 + 1)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)


def test_prefix_cache_and_ngram_same_tokens_zero_compilations(hf_model_dir):
    """A warmed Qwen3-MoE engine with prefix caching and n-gram speculation gives the plain engine's
    greedy tokens (no prefix cache, no speculation), and compiles nothing while serving."""
    path = hf_model_dir("qwen3moe-gqa")
    plain = Generator.from_pretrained(path, enable_prefix_caching=False, **FEATURES)
    first, second = two_round_prompts(plain.model_cfg.vocab_size)
    want = {"first": [o.token_ids for o in plain.generate(first, GREEDY)],
            "second": [o.token_ids for o in plain.generate(second, GREEDY)]}
    gen = Generator.from_pretrained(path, **SPEC, **{**FEATURES, "warmup": True})
    serve_two_rounds(gen, want)
    assert gen.stats()["compilations_after_warmup"] == 0


def _routes(path, quantize: str | None, ids: list[int], monkeypatch) -> list[np.ndarray]:
    """Each MoE layer's chosen experts (sorted per token) in one eager forward of the model."""
    import jaxinfer.moe as moe_module
    from jaxinfer.models.decoder import quantize_decoder
    from jaxinfer.weights import load_model

    model, _ = load_model(path, "float32")
    if quantize:
        quantize_decoder(model, quantize)
    seen, real = [], moe_module.route

    def spy(*args):
        weights, experts = real(*args)
        seen.append(np.sort(np.asarray(experts), axis=1))
        return weights, experts
    with monkeypatch.context() as m:
        m.setattr(moe_module, "route", spy)
        model(jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32))
    return seen


def test_int8_experts_same_tokens_as_naive_int8(hf_model_dir, monkeypatch):
    """int8 weights (every expert quantized per output channel on its own) with prefix caching and
    n-gram speculation give the greedy tokens of the same int8 model decoded naively (full forwards).
    Against the float model the logits are held to int8's bound, as for the dense families (< 0.1:
    per-channel rounding of at most max|w| / 254 per weight, ~1% per matmul, over 3 layers; 4.7%
    measured), with the routing unchanged: a token whose k-th and (k+1)-th router logits are closer
    than int8's error switches experts, which no rounding bound covers (it does on 1 or 2 of 24
    tokens per layer of the other tiny MoE configs, whose int8 logits are then 15-22% off, and on
    some of the prompts served here), so the bound is checked at the positions before the first
    token that int8 routes differently in any layer (causal attention: they never saw the switch)."""
    path = hf_model_dir("qwen3moe-gqa")
    gen = Generator.from_pretrained(path, quantize="int8", **SPEC, **FEATURES)
    first, second = two_round_prompts(gen.model_cfg.vocab_size)
    want = {"first": [naive_greedy(gen, p, GREEDY.max_tokens) for p in first],
            "second": [naive_greedy(gen, p, GREEDY.max_tokens) for p in second]}
    serve_two_rounds(gen, want)
    ref = Generator.from_pretrained(path, **FEATURES)
    ids = second[1]
    int8, floats = _routes(path, "int8", ids, monkeypatch), _routes(path, None, ids, monkeypatch)
    assert len(int8) == 2                                                  # the 2 MoE layers of 3
    # causal: positions before the first token routed differently in any layer saw no switch
    same = min(int(np.argmin(np.all(a == b, axis=1))) if not np.array_equal(a, b) else len(ids)
               for a, b in zip(int8, floats))
    assert same >= 8
    assert _rel_err(gen.logits(ids)[:same], ref.logits(ids)[:same]) < 0.1


# ------------------------------------------------------------------------------ tensor parallelism

def test_tensor_parallel_equals_one_device(tmp_path):
    """tests/moe_worker.py on 8 fake CPU devices: Qwen3-MoE at TP 2 and 4 (float) and TP 2 (int8
    experts), gpt-oss at TP 2 and PP 2 x TP 2 give one device's logits (to float32 reduction order)
    and greedy tokens, each TP device holding 1 / tp of every expert's fused gate_up (split on its
    last axis)."""
    from tests.fake_devices import run_model_runs
    from tests.moe_worker import RUNS

    for run, r in run_model_runs("tests.moe_worker", RUNS, tmp_path).items():
        assert r["rel_err"] < 1e-5 and r["same_tokens"], (run, r)
        if "pipeline" not in run:
            assert r["spec"] == ["None", "None", "tensor"] and r["device0_fraction"] == 1 / r["tp"], (run, r)
            assert r["down_spec"] == ["None", "tensor"], (run, r)
        trim = lambda spec: spec[:max((i + 1 for i, a in enumerate(spec) if a != "None"), default=0)]  # noqa: E731
        if "shared_specs" in r:   # gate_up [d, 2F] column-, down [F, d] row-parallel
            assert [trim(x) for x in r["shared_specs"]] == [["None", "tensor"], ["tensor"]], (run, r)
        if "mla_specs" in r:      # k_up / v_up [r, H, n]: split by head
            assert [trim(x) for x in r["mla_specs"]] == [["None", "tensor"]] * 2, (run, r)


def test_sigmoid_router_and_its_correction_stay_float32(hf_model_dir, tmp_path):
    """transformers keeps GLM-4.5's and DeepSeek-V3's router and choice correction in float32 whatever
    the model's dtype (_keep_in_fp32_modules_strict): loaded in bfloat16, and through a native
    checkpoint, they are the checkpoint's float32 values bit for bit; the rest is bfloat16. A latent-
    attention model refuses LoRA by name."""
    from jaxinfer.lora.execute import lora_supported
    from jaxinfer.models.decoder import fuse_decoder
    from jaxinfer.weights import SafetensorsFolder, load_model, save_native
    folder = hf_model_dir("glm4moe-groups")
    st = SafetensorsFolder(Path(folder))
    model, _ = load_model(folder, "bfloat16")
    save_native(model, tmp_path / "native", "bfloat16")
    for m in (model, load_model(tmp_path / "native", "bfloat16")[0]):
        mlp = m.layers[1].mlp
        assert m.layers[1].attn.q.get_value().dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(mlp.router_correction.get_value()),
                                      st.get("model.layers.1.mlp.gate.e_score_correction_bias"))
        np.testing.assert_array_equal(np.asarray(mlp.router.get_value()), st.get("model.layers.1.mlp.gate.weight").T)
    ds, _ = load_model(hf_model_dir("deepseekv3-mla"), "float32")
    assert "latent attention" in lora_supported(fuse_decoder(ds))


def test_pipeline_refuses_mixed_moe_and_dense_layers():
    """Qwen3-MoE with a dense layer between MoE layers cannot stack its layers for pipeline stages."""
    from jax.sharding import AbstractMesh

    from jaxinfer.sharding import rules_for
    cfg = model_config_from_hf(cfg_dict("qwen3moe-gqa"))
    with pytest.raises(ValueError, match=r"mixes mixture-of-experts \(E\) and dense \(D\) MLP layers \(EDE\)"):
        rules_for(cfg, AbstractMesh((1, 3, 1), ("data", "pipeline", "tensor")))
    assert rules_for(cfg, AbstractMesh((1, 1, 2), ("data", "pipeline", "tensor")))["expert_mlp"] == "tensor"


# ------------------------------------------------------------------------------ YaRN

@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},                      # gpt-oss
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},  # Qwen3
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
     "original_max_position_embeddings": 4096, "rope_theta": 10000.0},                       # DeepSeek's mscale
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2,
     "original_max_position_embeddings": 2048, "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
])
def test_yarn_matches_transformers(params):
    """Inverse frequencies and the cos/sin factor against transformers' own YaRN init."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxinfer.layers import rope_inv_freq, rope_magnitude

    hf_cfg = tf.Qwen3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                            rope_parameters=dict(params),
                            max_position_embeddings=4 * params["original_max_position_embeddings"],
                            partial_rotary_factor=params.get("partial_rotary_factor", 1.0))
    ref, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    c = json.loads(hf_cfg.to_json_string()) | {"architectures": ["Qwen3ForCausalLM"]}
    cfg = model_config_from_hf(c)
    rotary = int(128 * params.get("partial_rotary_factor", 1.0))
    np.testing.assert_allclose(rope_inv_freq(rotary, cfg.rope_theta, cfg.rope_scaling), ref.numpy(), rtol=1e-6)
    assert rope_magnitude(cfg.rope_scaling) == pytest.approx(attention_factor)


# ------------------------------------------------------------------------------ parameters, config.json

@pytest.mark.parametrize("name", MOE)
def test_num_params_match_transformers(name):
    """All parameters, and the active ones: all but the unrouted experts of each MoE layer."""
    hf = build_hf_model(name)
    cfg = model_config_from_hf(cfg_dict(name))
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    experts = [m.mlp.experts for m in hf.model.layers if hasattr(m.mlp, "experts")]
    per_expert = [sum(p.numel() for p in e.parameters()) // cfg.num_experts for e in experts]
    unrouted = sum(per_expert) * (cfg.num_experts - cfg.num_experts_per_tok)
    assert cfg.num_active_params() == cfg.num_params() - unrouted


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "deepseek-v2-lite"])
def test_plan_presets_match_transformers(preset):
    """The planner's published MoE shapes: transformers' model of the same config (on the meta
    device: no memory) has num_params() parameters (DeepSeek-V3: 671.0 B, its published total;
    V2-Lite: 15.7 B); weight bytes per token are the active ones."""
    import transformers as tf

    from jaxinfer.plan import PRESETS, weight_bytes
    cfg = PRESETS[preset]
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  num_experts_per_tok=cfg.num_experts_per_tok, intermediate_size=cfg.ffn_dim)
    mla = dict(common, head_dim=cfg.mla_rope_dim, kv_lora_rank=cfg.mla_kv_rank, q_lora_rank=cfg.mla_q_rank or None,
               qk_nope_head_dim=cfg.mla_nope_dim, qk_rope_head_dim=cfg.mla_rope_dim, v_head_dim=cfg.mla_v_dim,
               moe_intermediate_size=cfg.moe_ffn_dim, n_routed_experts=cfg.num_experts,
               n_shared_experts=cfg.moe_shared_ffn_dim // max(cfg.moe_ffn_dim or 1, 1),
               first_k_dense_replace=sum(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)))
    hf_cfg = {"mixtral-8x7b": lambda: tf.MixtralConfig(num_local_experts=8, **common),
              "qwen3-30b-a3b": lambda: tf.Qwen3MoeConfig(num_experts=128, moe_intermediate_size=768, **common),
              "gpt-oss-20b": lambda: tf.GptOssConfig(num_local_experts=32, **common),
              "deepseek-v3": lambda: tf.DeepseekV3Config(**mla),
              "deepseek-v2-lite": lambda: tf.DeepseekV2Config(**mla)}[preset]()
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    wb = weight_bytes(cfg, "bfloat16")
    assert wb["total"] == 2 * cfg.num_params() and wb["active"] == 2 * cfg.num_active_params()


@pytest.mark.parametrize("name,expect", [
    ("qwen3moe-gqa", dict(num_experts=4, num_experts_per_tok=2, moe_ffn_dim=32, ffn_dim=96, qk_norm=True,
                          moe_routing="softmax_topk", moe_norm_topk=True, moe_layers=(True, False, True),
                          sliding_window=None, router_bias=False, attn_sinks=False)),
    ("qwen3moe-mqa-window-yarn", dict(moe_norm_topk=False, moe_layers=None, sliding_window=6, sliding_layers=None,
                                      n_kv_heads=1, tie_embeddings=True)),
    ("mixtral-mqa-window", dict(num_experts=5, num_experts_per_tok=3, moe_routing="topk_softmax", moe_ffn_dim=None,
                                sliding_window=7, head_dim=32, qk_norm=False)),
    ("gpt-oss", dict(attn_sinks=True, router_bias=True, mlp_bias=True, qkv_bias=True, out_bias=True,
                     swiglu_limit=1.0, swiglu_alpha=1.702, sliding_layers=(True, False, True, False),
                     moe_routing="topk_softmax")),
    ("gpt-oss-mqa", dict(sliding_layers=(False, True), swiglu_alpha=2.5, n_kv_heads=1)),
])
def test_from_hf_fields(name, expect):
    cfg = model_config_from_hf(cfg_dict(name))
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k


def test_gpt_oss_rope_defaults_to_transformers_yarn():
    """A gpt-oss config.json without rope settings gets GptOssConfig's YaRN (factor 32, no truncation)."""
    c = {k: v for k, v in cfg_dict("gpt-oss").items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    s = model_config_from_hf(c).rope_scaling
    assert (s.kind, s.factor, s.original_max_position_embeddings, s.truncate) == ("yarn", 32.0, 4096, False)
    assert model_config_from_hf(c).rope_theta == 150000.0


@pytest.mark.parametrize("change,message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized with 'bitsandbytes'"),  # mxfp4 loads (prequant)
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    # DeepSeek-V2: renormalized weights (transformers and DeepSeek's code disagree there), another
    # routing, MoE on every other layer
    ({"norm_topk_prob": True}, "'norm_topk_prob' = true"),
    ({"topk_method": "noaux_tc"}, "'topk_method' = 'noaux_tc'"),
    ({"moe_layer_freq": 2}, "'moe_layer_freq' = 2"),
    ({"scoring_func": "sigmoid"}, "'scoring_func' = 'sigmoid'"),
])
def test_refused_moe_configs_name_the_field(change, message):
    base = "deepseekv2-groups" if message.startswith("'") else "gpt-oss"
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(cfg_dict(base) | change)


@pytest.mark.parametrize("base,change,message", [
    ("glm4moe-groups", {"n_group": 3}, "n_routed_experts = 8 is not a multiple of n_group = 3"),
    ("glm4moe-groups", {"n_group": 8, "topk_group": 1}, "n_group = 8 leaves fewer than two of the n_routed_experts"),
    ("deepseekv3-mla", {"topk_group": 3}, "topk_group = 3 exceeds n_group = 2"),
    ("deepseekv3-mla", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9 exceeds n_routed_experts = 8"),
    ("deepseekv3-mla", {"num_experts_per_tok": 5}, "num_experts_per_tok = 5 exceeds the 4 experts of the topk_group = 1"),
    ("dots1", {"n_group": 4}, "n_routed_experts = 6 is not a multiple of n_group = 4"),
    ("exaone-moe", {"n_group": 4, "topk_group": 1}, "num_experts = 6 is not a multiple of n_group = 4"),
    ("deepseekv2-groups", {"topk_group": 5}, "topk_group = 5 exceeds n_group = 4"),
])
def test_expert_groups_that_do_not_fit_are_refused_in_the_configs_words(base, change, message):
    """DeepSeek-V3's group-limited routing in every family that has it: sizes that do not fit are
    refused naming config.json's fields, not ModelConfig's (moe_groups) with its whole repr."""
    kind, fields = CONFIGS[base][:2]
    with pytest.raises(ConfigError, match=message) as e:
        model_config_from_hf({**fields, "model_type": kind, **change})
    assert "ModelConfig" not in str(e.value)


def test_clamped_swiglu_needs_experts():
    with pytest.raises(ConfigError, match="swiglu_limit"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8,
                    swiglu_limit=7.0)


# ------------------------------------------------------------------------------ fusion, quantization, storage

def _logits_rtol(cfg: ModelConfig, tokens: int) -> float:
    """Bound on the logits' relative difference (tests.precision.dot_chain_rtol) between two float32
    evaluations of a MoE model that sum in other orders: a difference born in the first layer runs
    through every later dot, so it counts each layer's contractions (q/k/v and the experts' gate/up
    over d_model, o over the heads, scores over head_dim, values over the keys, down over the
    experts' FFN, the k experts' weighted sum) and the LM head's over d_model."""
    per_layer = (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.head_dim, tokens, cfg.d_model,
                 cfg.expert_ffn_dim, cfg.num_experts_per_tok)
    return dot_chain_rtol(*per_layer * cfg.n_layers, cfg.d_model)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])   # fp8: experts' codes [E, K, N], the rest [N, K]
def test_fuse_quantize_and_native_round_trip(hf_model_dir, tmp_path, method):
    """Quantized experts (one QuantizedWeight of E stacked experts) fuse for TP 2, unfuse to the same
    arrays, save in the native format (batch recorded) and load back to identical logits."""
    from jaxinfer.models.decoder import fuse_decoder, quantize_decoder, unfuse_decoder
    from jaxinfer.weights import load_model, save_native

    model, cfg = load_model(hf_model_dir("qwen3moe-gqa"), "float32")
    quantize_decoder(model, method)
    w = model.layers[0].mlp.gate.get_value()
    assert isinstance(w, QuantizedWeight) and w.batch == 1 and w.shape == (4, 64, 32)
    assert w.q.shape[0] == 4 and (w.bits, w.group_size) == ((4, 64) if method == "int4" else (8, None))
    if method == "fp8":
        assert w.layout == "kn" and w.q.shape == (4, 64, 32)
        assert model.layers[0].attn.o.get_value().layout == "nk"
    fused = fuse_decoder(model, tp=2)
    back = unfuse_decoder(fused)
    for (p, a), (_, b) in zip(nnx.state(model, nnx.Param).flat_state(), nnx.state(back, nnx.Param).flat_state()):
        for x, y in zip(jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value())):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))
    ids, pos = jnp.arange(3, 20, dtype=jnp.int32), jnp.arange(17, dtype=jnp.int32)
    # fused projections are one wider matmul, which XLA may tile (and so sum) differently
    assert_rel_close(fused(ids, pos)[0], model(ids, pos)[0], _logits_rtol(cfg, len(ids)), "fused vs unfused")
    save_native(fused, tmp_path / "native", "float32")
    loaded, loaded_cfg = load_model(tmp_path / "native", "float32")
    assert loaded_cfg == cfg and loaded.layers[0].mlp.down.get_value().batch == 1
    np.testing.assert_array_equal(np.asarray(loaded(ids, pos)[0]), np.asarray(model(ids, pos)[0]))


def test_set_moe_impl_switches_every_layer(hf_model_dir):
    from jaxinfer.weights import load_model
    model, cfg = load_model(hf_model_dir("gpt-oss-mqa"), "float32")
    ids, pos = jnp.arange(3, 30, dtype=jnp.int32), jnp.arange(27, dtype=jnp.int32)
    tiles = np.asarray(model(ids, pos)[0])
    set_moe_impl(model, "ragged_dot")
    assert {b.mlp.impl for b in model.layers} == {"ragged_dot"}
    # the tile loop and lax.ragged_dot sum the same float32 products in other orders
    assert_rel_close(model(ids, pos)[0], tiles, _logits_rtol(cfg, len(ids)), "ragged_dot vs the tile loop")
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        set_moe_impl(model, "dense")
