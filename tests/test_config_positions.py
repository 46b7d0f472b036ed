"""model_config_from_hf (jaxinfer/models/hf_configs.py) and the position encodings, against transformers' own code and the formulas."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from jaxinfer.config import ConfigError, ModelConfig, RopeScaling, SamplingParams
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.layers import alibi_slopes, rope_inv_freq, sinusoidal_embedding, sinusoidal_table
from tests.hf_models import build_hf_model


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = model_config_from_hf(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.kind == "llama3"
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_linear_rope_scaling_divides_frequencies():
    base = rope_inv_freq(64, 10000.0, None)
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, RopeScaling(kind="linear", factor=4.0)), base / 4.0)
    # the formula: theta^(-2i/d)
    np.testing.assert_allclose(base, [10000.0 ** (-2 * i / 64) for i in range(32)], rtol=1e-6)


def test_rope_theta_read_from_legacy_and_v5_fields():
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 16, "rope_theta": 123.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = dict(legacy, rope_parameters={"rope_theta": 456.0, "rope_type": "default"})
    del v5["rope_theta"], v5["rope_scaling"]
    a, b = model_config_from_hf(legacy), model_config_from_hf(v5)
    assert (a.rope_theta, a.rope_scaling) == (123.0, RopeScaling(kind="linear", factor=2.0))
    assert (b.rope_theta, b.rope_scaling) == (456.0, None)


def test_alibi_slopes_match_bloom():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for h in (1, 2, 4, 6, 8, 12, 16, 24, 112):
        np.testing.assert_allclose(alibi_slopes(h), _get_alibi_slopes(h, "cpu").numpy(), rtol=1e-6)


def test_sinusoidal_positions_follow_the_formula():
    d = 16
    table = sinusoidal_table(50, d)
    for p in (0, 1, 7, 49):
        for i in range(d // 2):
            assert table[p, 2 * i] == pytest.approx(math.sin(p / 10000 ** (2 * i / d)), abs=1e-6)
            assert table[p, 2 * i + 1] == pytest.approx(math.cos(p / 10000 ** (2 * i / d)), abs=1e-6)
    np.testing.assert_allclose(np.asarray(sinusoidal_embedding(np.arange(50), d)), table, atol=1e-5)


def test_sinusoidal_model_adds_the_table():
    import jax.numpy as jnp
    from flax import nnx
    from jaxinfer.models.decoder import Decoder

    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, ffn_dim=32,
                      position="sinusoidal", norm="layernorm", gated_mlp=False, activation="gelu")
    model = Decoder(cfg, jnp.float32, nnx.Rngs(0))
    tokens = jnp.array([3, 3, 3, 3])
    emb = np.asarray(model.embed[...])[3]
    # the block sees embedding + PE; check via the first layer's input: run with layers removed
    h = np.asarray(model.embed[...])[np.asarray(tokens)] + sinusoidal_table(4, 16)
    model.layers = nnx.List([])
    out, _ = model.hidden_states(tokens, jnp.arange(4))
    ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + cfg.norm_eps)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    assert not np.allclose(emb, h[1])


@pytest.mark.parametrize("name,expect", [
    ("llama-gqa-llama3", dict(n_kv_heads=2, position="rope", tie_embeddings=False, norm="rmsnorm")),
    ("qwen2-window", dict(n_kv_heads=1, qkv_bias=True, sliding_window=6, sliding_layers=(False, True, True))),
    ("mistral-window", dict(sliding_window=7, sliding_layers=None)),
    ("gpt2", dict(position="learned", norm="layernorm", activation="gelu_tanh", gated_mlp=False, ffn_dim=256)),
    ("bloom-6heads-postnorm", dict(position="alibi", embed_norm=True, residual_post_norm=True, n_heads=6)),
])
def test_from_hf_fields(name, expect, hf_model_dir):
    cfg = model_config_from_hf(hf_model_dir(name))
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k


def test_num_params_matches_transformers():
    for name in ("llama-gqa-llama3", "llama-mqa-tied-linear", "gpt2", "bloom", "qwen2-tied"):
        hf = build_hf_model(name)
        cfg = model_config_from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
        n_hf = sum(p.numel() for p in hf.parameters())  # tied weights are counted once
        assert cfg.num_params() == n_hf, name


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(ConfigError, match="T5ForConditionalGeneration"):
        model_config_from_hf(tmp_path)


def test_missing_field_is_named():
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        model_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                             "num_attention_heads": 2, "intermediate_size": 16})


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop == ("x",)


def test_fields_a_config_omits_take_transformers_defaults():
    """Qwen2 with use_sliding_window but no max_window_layers / sliding_window: transformers' Qwen2Config
    windows layers 28 on with 4096 (no layer got a window); a Phi-3 config spelling LongRoPE with the
    older name "yarn" is LongRoPE, as Phi3Config renames it (it was built as YaRN)."""
    from transformers import Phi3Config, Qwen2Config
    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
                use_sliding_window=True)
    ours = model_config_from_hf(qwen)
    hf = Qwen2Config(**{k: v for k, v in qwen.items() if k != "architectures"})
    assert ours.sliding_window == hf.sliding_window == 4096
    assert list(ours.sliding_layers) == [t == "sliding_attention" for t in hf.layer_types]
    assert sum(ours.sliding_layers) == 4
    factors = [1.0] * 4
    phi = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=1024, original_max_position_embeddings=256,
               rope_scaling={"type": "yarn", "short_factor": factors, "long_factor": [2.0] * 4})
    assert Phi3Config(**{k: v for k, v in phi.items() if k != "architectures"}).rope_parameters["rope_type"] == "longrope"
    assert model_config_from_hf(phi).rope_scaling.kind == "longrope"
