"""Qwen3, Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini through the one decoder (issue 42, dense).

The XLA path's logits and 32 greedy tokens (8-token budget: 24-token prompts prefilled in 3 chunks,
sliding windows of 5-7 crossed) against transformers run for every tiny config in
test_hf_parity.py. Here: the same against transformers through the Pallas kernels (interpreted on
CPU); prefix caching and n-gram speculation on Gemma 2 against the plain engine, int8 weights (with
both) against naive decoding of the same int8 model; zero compilations after warm-up; tensor and
pipeline parallelism against one device (tests/families_worker.py); config.json parsing (LongRoPE
against transformers' own frequencies, legacy and v5 spellings of Gemma 3's per-layer RoPE) and
the refusals.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxinfer import Generator, SamplingParams
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.layers import rope_inv_freq
from tests.hf_models import CONFIGS, build_hf_model
from tests.two_rounds import GREEDY, naive_greedy, serve_two_rounds, two_round_prompts

NEW_FAMILIES = [n for n in CONFIGS if CONFIGS[n][0] in ("qwen3", "gemma2", "gemma3_text", "phi3")]
PROMPT_LEN = 24
# 8-token budget: one step shape to compile; block_size 8 for the Pallas kernels' tiles
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4, block_size=8,
              num_blocks=4 * 64 // 8 + 1, warmup=False)


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _hf_reference(name: str, n_new: int, seed: int = 0) -> tuple[list[int], np.ndarray, list[int]]:
    """(prompt, HF logits [T, V], HF greedy continuation of n_new tokens)."""
    hf = build_hf_model(name)
    ids = np.random.RandomState(seed).randint(3, hf.config.vocab_size, PROMPT_LEN).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].numpy()
        cont = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, PROMPT_LEN:].tolist()
    return ids, logits, cont


# ------------------------------------------------------------------------------ the Pallas kernels

@pytest.mark.device
@pytest.mark.parametrize("name", ["qwen3-mqa-window", "gemma2", "gemma3", "phi3-longrope"])
def test_pallas_kernels_match_transformers(name, hf_model_dir):
    """Flash attention (the full forward) and ragged paged attention (chunked prefill + decode) with
    each family's features: q/k norms, soft caps, alternating windows, per-layer RoPE, LongRoPE."""
    gen = Generator.from_pretrained(hf_model_dir(name), attention="pallas", **ENGINE)
    assert gen.engine.resolved.attention == "pallas"
    ids, ref, cont = _hf_reference(name, 16)
    assert _rel_err(gen.logits(ids), ref) < 1e-4
    out = gen.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == cont


# ------------------------------------------------------------------------------ engine features on Gemma 2

FEATURES = dict(ENGINE, max_model_len=96, max_num_batched_tokens=16, token_buckets=[16], num_blocks=4 * 96 // 8 + 1)


@pytest.fixture(scope="module")
def gemma2_plain(hf_model_dir) -> dict:
    """The reference: greedy tokens of the plain float32 engine (no prefix cache, no speculation)."""
    gen = Generator.from_pretrained(hf_model_dir("gemma2"), enable_prefix_caching=False, **FEATURES)
    first, second = two_round_prompts(gen.model_cfg.vocab_size)
    return {"first": [o.token_ids for o in gen.generate(first, GREEDY)],
            "second": [o.token_ids for o in gen.generate(second, GREEDY)]}


def test_gemma2_prefix_cache_and_ngram_same_tokens_zero_compilations(hf_model_dir, gemma2_plain):
    """A warmed engine with prefix caching and n-gram speculation: the plain engine's greedy tokens,
    and no XLA compilation while serving."""
    gen = Generator.from_pretrained(hf_model_dir("gemma2"), speculative_method="ngram", num_speculative_tokens=3,
                                    speculative_max_batch=8, **{**FEATURES, "warmup": True})
    serve_two_rounds(gen, gemma2_plain)
    assert gen.stats()["compilations_after_warmup"] == 0


def test_gemma2_int8_weights_same_tokens(hf_model_dir):
    """int8 weights with prefix caching and n-gram speculation give the greedy tokens of the same int8
    model decoded naively (full forwards, gen.logits: no cache, no speculation). Against the float
    model the tokens may differ (the tiny model's top-2 margins, down to 1e-3, are below int8's
    error), so the logits are held to int8's bound instead: per-channel rounding of at most
    max|w| / 254 per weight, ~1% per matmul, compounded over 4 layers of 7 matmuls (4-7% measured)."""
    path = hf_model_dir("gemma2")
    gen = Generator.from_pretrained(path, quantize="int8", speculative_method="ngram", num_speculative_tokens=3,
                                    speculative_max_batch=8, **FEATURES)
    first, second = two_round_prompts(gen.model_cfg.vocab_size)
    want = {"first": [naive_greedy(gen, p, GREEDY.max_tokens) for p in first],
            "second": [naive_greedy(gen, p, GREEDY.max_tokens) for p in second]}
    serve_two_rounds(gen, want)
    ref = Generator.from_pretrained(path, **FEATURES)
    assert _rel_err(gen.logits(second[1]), ref.logits(second[1])) < 0.1


# ------------------------------------------------------------------------------ config.json

@pytest.mark.parametrize("name,expect", [
    ("qwen3-mqa-window", dict(qk_norm=True, qkv_bias=True, n_kv_heads=1, sliding_window=6,
                              sliding_layers=(False, True, True), norm="rmsnorm")),
    ("gemma2", dict(norm="gemma_rmsnorm", post_norms=True, activation="gelu_tanh", attn_scale=24 ** -0.5,
                    attn_softcap=2.0, final_softcap=1.0, embed_scale=8.0, tie_embeddings=True,
                    sliding_layers=(True, False, True, False), qk_norm=False, rope_local_theta=None)),
    ("gemma3", dict(qk_norm=True, attn_softcap=None, final_softcap=1.0, rope_theta=1e6, rope_local_theta=1e4,
                    sliding_layers=(True,) * 5 + (False,), sliding_window=5)),
    ("phi3-longrope", dict(rotary_dim=12, head_dim=16, tie_embeddings=True)),
    ("phi3-mqa-window", dict(rotary_dim=None, sliding_window=7, sliding_layers=None)),
    # SmolLM3: NoPE every no_rope_layer_interval-th layer, or as no_rope_layers lists them; the window
    # on the layers layer_types names (SmolLM3Config: the NoPE ones), only with use_sliding_window
    ("smollm3-nope", dict(rope_layers=(True, False, True), sliding_window=None, sliding_layers=None,
                          tie_embeddings=True, n_kv_heads=2)),
    ("smollm3-window", dict(rope_layers=(False, True, True, False), sliding_window=6,
                            sliding_layers=(True, False, False, True), rope_theta=5e5, n_kv_heads=1)),
    ("olmo2", dict(norm="olmo_rmsnorm", pre_norms=False, post_norms=True, qk_norm=True, qk_norm_full=True,
                   sliding_window=None, norm_eps=1e-5)),
    ("olmo3", dict(sliding_window=6, sliding_layers=(True, True, True, False), rope_theta=5e5, rope_local_theta=1e4,
                   qk_norm_full=True)),
    # EXAONE 4.0: the global layer is also the one without RoPE; no window: every layer rotates
    ("exaone4", dict(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_full=False, norm="rmsnorm",
                     sliding_window=6, sliding_layers=(True, True, True, False), rope_layers=(True, True, True, False))),
    ("exaone4-nowindow", dict(sliding_window=None, sliding_layers=None, rope_layers=None, pre_norms=False)),
    # GLM-4-0414: both norms around each branch, half of head_dim 32 rotating; GLM-4: 3/4 of 16
    ("glm4", dict(pre_norms=True, post_norms=True, rotary_dim=16, qkv_bias=True, out_bias=False, gated_mlp=True)),
    ("glm-mqa", dict(post_norms=False, rotary_dim=12, qkv_bias=False, rope_theta=500.0, tie_embeddings=True)),
    ("starcoder2-window", dict(norm="layernorm", gated_mlp=False, activation="gelu_tanh", sliding_window=7,
                               sliding_layers=None, qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True)),
    ("starcoder2-mqa", dict(qkv_bias=False, out_bias=False, mlp_bias=False, sliding_window=None, n_kv_heads=1,
                            tie_embeddings=False)),
    # Cohere: logits x logit_scale as a division by its inverse (1/16 and 1/4: exact in binary)
    ("cohere", dict(norm="layernorm_nobias", parallel_block=True, logits_scaling=16.0, qkv_bias=True, out_bias=True,
                    tie_embeddings=True, sliding_window=None, rope_layers=None, qk_norm=True, qk_norm_heads=True)),
    ("cohere2", dict(parallel_block=True, logits_scaling=4.0, qk_norm=False, sliding_window=6, sliding_layers=(True,) * 3 + (False,),
                     rope_layers=(True,) * 3 + (False,), tie_embeddings=False)),
])
def test_from_hf_fields(name, expect, hf_model_dir):
    cfg = model_config_from_hf(hf_model_dir(name))
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k


def test_exaone4_layer_pattern_without_layer_types():
    """EXAONE 4.0 configs name the layers' kinds in layer_types; without it, sliding_window_pattern: a
    period (every p-th layer global, transformers' Exaone4Config) or a string of L(ocal) and G(lobal), the
    form Exaone4Config's docstring describes ("LLLG" as 4)."""
    base = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8}
    import transformers as tf
    theirs = tf.Exaone4Config(**{k: v for k, v in base.items() if k != "architectures"}, sliding_window_pattern=3)
    ours = model_config_from_hf({**base, "sliding_window_pattern": 3})
    assert ours.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types) == ours.rope_layers
    assert model_config_from_hf({**base, "sliding_window_pattern": "LLG"}).sliding_layers == ours.sliding_layers
    # "the final layer always uses global attention regardless of the pattern" (Exaone4Config's docstring)
    assert model_config_from_hf({**base, "sliding_window_pattern": "LLLG"}).sliding_layers == (
        True, True, True, False, True, False)
    with pytest.raises(ConfigError, match="sliding_window_pattern must be"):
        model_config_from_hf({**base, "sliding_window_pattern": "LX"})


def test_olmo2_refusals():
    """OLMo 2's whole-width k norm cannot follow KV heads repeated across devices (tensor_parallel
    beyond its KV heads: refused naming the degree), and the calibrated quantizers, which replay
    pre-norm blocks, refuse its post-norm ones."""
    from jaxinfer.models.decoder import FusedLayout
    from jaxinfer.quantize import calibrated_unsupported
    cfg = model_config_from_hf(cfg_dict("olmo2"))
    assert FusedLayout.for_tp(cfg, 2).kv_replicas == 1
    with pytest.raises(ConfigError, match="tensor_parallel=4 splits 2 KV heads"):
        FusedLayout.for_tp(cfg, 4)
    assert "OLMo 2" in calibrated_unsupported(cfg)


def test_smollm3_refuses_a_malformed_nope_list():
    """no_rope_layers must give one 0 / 1 per layer; no_rope_layer_interval must be positive."""
    base = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    for bad, match in (({"no_rope_layers": [1, 0]}, "no_rope_layers must be at least 3 values"),
                       ({"no_rope_layers": [1, 2, 1]}, "no_rope_layers must be at least 3 values"),
                       ({"no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive")):
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({**base, **bad})
    assert model_config_from_hf(base).rope_layers == (True, True, True)   # interval 4: layer 3 would be NoPE
    # transformers reads no_rope_layers[layer]: a longer list's tail is unused; SmolLM3Config's theta 2e6
    cfg = model_config_from_hf({**base, "no_rope_layers": [1, 0, 1, 0, 0]})
    assert cfg.rope_layers == (True, False, True) and cfg.rope_theta == 2e6


def test_olmo3_legacy_rope_spelling_as_transformers_reads_it():
    """The published OLMo 3 configs spell RoPE as rope_theta + rope_scaling (YaRN): transformers'
    Olmo3Config puts the scaling on the full layers only, the sliding ones rotating plainly."""
    import transformers as tf
    legacy = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  rope_theta=2e5, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                "original_max_position_embeddings": 8192})
    theirs = tf.Olmo3Config(**legacy).rope_parameters
    cfg = model_config_from_hf({"architectures": ["Olmo3ForCausalLM"], **legacy})
    assert theirs["full_attention"]["rope_type"] == "yarn" and theirs["sliding_attention"]["rope_type"] == "default"
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.factor == theirs["full_attention"]["factor"]
    assert cfg.rope_theta == theirs["full_attention"]["rope_theta"] == 2e5
    # the sliding layers at that base too, as vLLM and transformers 4.57 read it (5.25's Olmo3Config
    # falls back to its class default, 5e5, there: a double pop of rope_theta)
    assert cfg.rope_local_theta == 2e5


def test_granite_and_olmo_round_as_torch_in_bfloat16():
    """bfloat16: Granite's residual multiplier and OLMo's RMSNorm round as transformers' do (bit for bit):
    torch multiplies a bf16 tensor by a Python float in float32, rounding once; Olmo2RMSNorm multiplies
    its weight in float32 and casts after, where Llama's casts first."""
    import jax.numpy as jnp
    import transformers as tf

    from jaxinfer.layers import Norm
    from jaxinfer.models.decoder import Block
    from types import SimpleNamespace
    rng = np.random.default_rng(0)
    y = torch.tensor(rng.standard_normal((64, 512)), dtype=torch.bfloat16)
    ours = Block.scale_branch(SimpleNamespace(residual_scale=0.22), jnp.asarray(y.float().numpy(), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(ours, np.float32), (y * 0.22).float().numpy())
    ref = tf.models.olmo2.modeling_olmo2.Olmo2RMSNorm(512, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(rng.uniform(0.5, 1.5, 512), dtype=torch.float32))
    norm = Norm(512, "olmo_rmsnorm", 1e-5, jnp.float32, None)
    norm.scale.set_value(jnp.asarray(ref.weight.detach().numpy()))
    got = np.asarray(norm(jnp.asarray(y.float().numpy(), jnp.bfloat16)), np.float32)
    want = ref(y).float().detach().numpy()
    # XLA's and torch's float32 rsqrt may differ in an ulp or two, which flips the bf16 rounding of the
    # ~2^-15 of elements that sit that close to a rounding boundary: those are one bf16 ulp apart; the
    # other rounding order (Llama's: cast, then multiply) differs in about a quarter of them
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.abs(want))      # one bf16 ulp: at most 2^-7 relative
    assert np.mean(got != want) < 1e-3


def test_gemma3_per_layer_rope():
    cfg = model_config_from_hf(cfg_dict("gemma3"))
    assert [cfg.layer_window(i) for i in range(6)] == [5] * 5 + [None]
    assert [cfg.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    rope = (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor)
    assert rope == (1e4, 1e6, "linear", 8)
    # the legacy spelling (transformers < 5 and many hub files): the same config
    legacy = {k: v for k, v in cfg_dict("gemma3").items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert model_config_from_hf(legacy) == cfg


def cfg_dict(name: str) -> dict:
    return json.loads(build_hf_model(name).config.to_json_string()) | {"architectures": [
        {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
         "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}[name.split("-")[0]]]}


@pytest.mark.parametrize("name", ["phi3-longrope", "phi3-mqa-window"])
def test_longrope_frequencies_match_transformers(name):
    """Our inverse frequencies and cos/sin factor against transformers' own LongRoPE, with the long
    factors (seq_len past the original length) where the model serves beyond it, else the short."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = build_hf_model(name).config
    cfg = model_config_from_hf(cfg_dict(name))
    s = cfg.rope_scaling
    seq_len = s.original_max_position_embeddings + 1 if s.use_long_factor else None
    ref, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
    np.testing.assert_allclose(rope_inv_freq(cfg.rope_dim, cfg.rope_theta, s), ref.numpy(), rtol=1e-6)
    assert s.attention_factor == pytest.approx(attention_factor)
    assert s.use_long_factor == (name == "phi3-longrope")


def test_num_params_match_transformers():
    for name in NEW_FAMILIES:
        hf = build_hf_model(name)
        assert model_config_from_hf(cfg_dict(name)).num_params() == sum(p.numel() for p in hf.parameters()), name


@pytest.mark.parametrize("name", ["glm4", "glm-mqa", "starcoder2-window", "starcoder2-mqa", "cohere", "cohere2", "olmo2",
                                  "ernie4_5", "ernie4_5_moe", "gpt-neox", "gpt-neox-sequential", "phi",
                                  "phi-qk-layernorm", "stablelm", "stablelm-parallel-qk-norm", "granitemoe",
                                  "granitemoeshared", "olmoe", "hunyuan", "hunyuan-moe", "arcee", "helium",
                                  "gpt-bigcode-mqa", "gpt-bigcode-mha", "falcon-7b", "falcon-40b",
                                  "falcon-sequential", "glm4moelite", "minimax-m2", "ministral", "dots1",
                                  "solar-open", "exaone-moe", "cwm", "granite-swa",
                                  "jais2", "vaultgemma", "nemotron", "exaone", "internlm3", "afmoe", "phimoe", "apertus", "gptj", "olmo", "minicpm", "opt", "gpt-neo",
                                  "llama4-scout", "llama4-maverick", "lfm2", "lfm2-bias",
                                  "lfm2-moe", "qwen3-next", "qwen3.5", "qwen3.5-moe", "granitemoehybrid",
                                  "granitemoehybrid-dense", "bamba", "nemotron-h", "nemotron-h-moe"])
def test_glm_starcoder2_cohere_params_match_transformers(name, hf_model_dir):
    hf = build_hf_model(name)
    # the sigmoid router's choice correction: a buffer in DeepSeek-V3's and GLM-4.5's classes, which
    # num_params leaves out as their count does; AFMoE's class makes it a parameter (expert_bias)
    theirs = sum(p.numel() for n, p in hf.named_parameters() if not n.endswith(".mlp.expert_bias"))
    theirs -= 2 * hf.config.hidden_size if name == "opt" else 0   # OPT's two position rows never read
    assert model_config_from_hf(hf_model_dir(name)).num_params() == theirs


@pytest.mark.parametrize("arch", ["CohereForCausalLM", "Cohere2ForCausalLM", "Ernie4_5ForCausalLM",
                                  "Ernie4_5_MoeForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
                                  "Starcoder2ForCausalLM", "ArceeForCausalLM", "Jais2ForCausalLM",
                                  "ExaoneForCausalLM", "InternLM3ForCausalLM", "PhimoeForCausalLM",
                                  "ApertusForCausalLM"])
def test_new_families_fill_missing_fields_as_transformers(arch):
    """A config.json that leaves out the RoPE base, KV heads, context and special tokens: transformers'
    class defaults (Cohere's and ERNIE's RoPE base 500 000, GLM's and StarCoder2's 2 KV heads, ...)."""
    import transformers as tf
    # EXAONE's and PhiMoE's default of 8 KV heads needs as many query heads
    heads = 8 if arch in ("ExaoneForCausalLM", "PhimoeForCausalLM") else 4
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads)
    theirs = getattr(tf, arch.replace("ForCausalLM", "Config"))(**fields)
    cfg = model_config_from_hf({"architectures": [arch], **fields})
    eos = theirs.eos_token_id if isinstance(theirs.eos_token_id, list) else [theirs.eos_token_id]
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.max_position_embeddings, cfg.eos_token_ids, cfg.bos_token_id) == (
        theirs.rope_parameters["rope_theta"], theirs.num_key_value_heads or heads, theirs.max_position_embeddings,
        tuple(eos), theirs.bos_token_id)
    if arch in ("ArceeForCausalLM", "Jais2ForCausalLM"):   # their configs' squared ReLU, ungated
        assert (cfg.activation, cfg.gated_mlp) == (theirs.hidden_act, False)
    if arch == "ApertusForCausalLM":   # its default RoPE: Llama 3's, from 8192 positions
        s, theirs_rope = cfg.rope_scaling, theirs.rope_parameters
        assert (s.kind, s.factor, s.original_max_position_embeddings, cfg.activation) == (
            theirs_rope["rope_type"], theirs_rope["factor"], theirs_rope["original_max_position_embeddings"],
            theirs.hidden_act)
    if arch == "Jais2ForCausalLM":
        assert (cfg.norm, cfg.norm_eps, cfg.qkv_bias, cfg.mlp_bias) == ("layernorm", theirs.layer_norm_eps,
                                                                        theirs.attention_bias, theirs.mlp_bias)


def test_internlm2_is_the_llama_it_packs(tmp_path):
    """InternLM2 / 2.5 (remote code, no transformers class): a transformers Llama (GQA, biased q / k / v /
    o) written as InternLM2's modeling code names and packs it (tok_embeddings; attention.wqkv's rows
    per KV head: its query heads, its key, its value, as vLLM's internlm2.py splits them; wo;
    feed_forward.w1 / w3 / w2; attention_norm / ffn_norm; output) with its config.json (bias, dynamic
    RoPE within the context) computes the Llama's logits and greedy tokens."""
    import transformers as tf
    from safetensors.numpy import save_file
    h, kv, hd = 4, 2, 16
    torch.manual_seed(3)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=h, num_key_value_heads=kv, attention_bias=True,
                                            max_position_embeddings=256, rope_theta=50000.0,
                                            attn_implementation="eager")).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    out = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"], "model.norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(2):
        a, p = f"model.layers.{i}.self_attn", f"model.layers.{i}"
        for suffix in ("weight", "bias"):
            q, k, v = (sd[f"{a}.{n}_proj.{suffix}"] for n in "qkv")
            groups = [q.reshape(kv, h // kv, hd, -1), k.reshape(kv, 1, hd, -1), v.reshape(kv, 1, hd, -1)]
            out[f"{p}.attention.wqkv.{suffix}"] = np.concatenate(groups, axis=1).reshape(-1, *q.shape[1:])
            out[f"{p}.attention.wo.{suffix}"] = sd[f"{a}.o_proj.{suffix}"]
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f"{p}.feed_forward.{theirs}.weight"] = sd[f"{p}.mlp.{ours}.weight"]
        out[f"{p}.attention_norm.weight"] = sd[f"{p}.input_layernorm.weight"]
        out[f"{p}.ffn_norm.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": True, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96,
        "max_position_embeddings": 256, "num_attention_heads": h, "num_hidden_layers": 2, "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6, "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 50000,
        "tie_word_embeddings": False, "vocab_size": 101}))
    gen = Generator.from_pretrained(str(tmp_path), dtype="float32", max_model_len=64, max_num_batched_tokens=8,
                                    max_num_seqs=2, num_blocks=9, warmup=False)
    ids = np.random.RandomState(0).randint(3, 101, 24).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 24:].tolist()
    assert np.abs(gen.logits(ids) - ref).max() < 1e-4 * np.abs(ref).max()
    assert gen.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids == want
    assert gen.model_cfg.max_position_embeddings == 256 and gen.model_cfg.rope_scaling is None


def test_gptj_6b_published_config():
    """EleutherAI's GPT-J-6B config.json: transformers' parameter count of it (built on the meta
    device), 64 of each head's 256 features rotated, the tanh GELU, 4 x n_embd MLP (n_inner null)."""
    import transformers as tf
    published = {"activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "bos_token_id": 50256,
                 "eos_token_id": 50256, "layer_norm_epsilon": 1e-05, "model_type": "gptj", "n_embd": 4096,
                 "n_head": 16, "n_inner": None, "n_layer": 28, "n_positions": 2048, "rotary": True, "rotary_dim": 64,
                 "tie_word_embeddings": False, "vocab_size": 50400}
    cfg = model_config_from_hf(published)
    with torch.device("meta"):
        theirs = tf.GPTJForCausalLM(tf.GPTJConfig(**{k: v for k, v in published.items() if k != "architectures"}))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())
    assert (cfg.rotary_dim, cfg.head_dim, cfg.ffn_dim, cfg.activation) == (64, 256, 16384, "gelu_tanh")
    with pytest.raises(ConfigError, match="'rotary_dim' = None"):   # transformers' GPTJ cannot build it either
        model_config_from_hf({**published, "rotary_dim": None})


def test_gpt_neo_125m_published_config():
    """EleutherAI's gpt-neo-125M config.json: its attention_layers alternate global and local (a window
    of 256 on every other layer), unscaled scores, transformers' parameter count (on the meta device)."""
    import transformers as tf
    published = {"activation_function": "gelu_new", "architectures": ["GPTNeoForCausalLM"],
                 "attention_layers": ["global", "local"] * 6, "attention_types": [[["global", "local"], 6]],
                 "bos_token_id": 50256, "eos_token_id": 50256, "hidden_size": 768, "intermediate_size": None,
                 "layer_norm_epsilon": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neo",
                 "num_heads": 12, "num_layers": 12, "vocab_size": 50257, "window_size": 256}
    cfg = model_config_from_hf(published)
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.attn_scale) == (256, (False, True) * 6, 1.0)
    fields = {k: v for k, v in published.items() if k not in ("architectures", "attention_layers")}
    with torch.device("meta"):
        theirs = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(**fields))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())


def test_opt_published_configs():
    """facebook/opt-125m's config.json: transformers' parameter count (on the meta device) less the two
    position rows OPT never reads (its offset of 2); OPT-350m's post-LayerNorm blocks and projected
    embeddings refused by field."""
    import transformers as tf
    published = {"activation_function": "relu", "architectures": ["OPTForCausalLM"], "bos_token_id": 2,
                 "do_layer_norm_before": True, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
                 "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12,
                 "num_hidden_layers": 12, "pad_token_id": 1, "vocab_size": 50272, "word_embed_proj_dim": 768}
    cfg = model_config_from_hf(published)
    with torch.device("meta"):
        theirs = tf.OPTForCausalLM(tf.OPTConfig(**{k: v for k, v in published.items() if k != "architectures"}))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters()) - 2 * 768
    assert (cfg.tie_embeddings, cfg.activation, cfg.position) == (True, "relu", "learned")
    for field, value in (("do_layer_norm_before", False), ("word_embed_proj_dim", 512)):
        with pytest.raises(ConfigError, match=field):
            model_config_from_hf({**published, field: value})


def test_phi35_moe_published_config():
    """Phi-3.5-MoE-instruct's config.json (its modeling code's class name PhiMoEForCausalLM, the legacy
    rope_scaling with short / long mscale) as transformers' Phimoe reads it: LongRoPE over 4096
    original positions served to 131 072 (the long factors, long_mscale), sparsemixer's margin,
    16 experts of 6400, biases on attention and the LM head, transformers' parameter count."""
    import transformers as tf
    short, long = [1.0 + 0.01 * i for i in range(64)], [1.5 + 0.2 * i for i in range(64)]
    published = {"architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "bos_token_id": 1, "eos_token_id": 32000,
                 "hidden_act": "silu", "hidden_size": 4096, "input_jitter_noise": 0.01, "intermediate_size": 6400,
                 "lm_head_bias": True, "max_position_embeddings": 131072, "model_type": "phimoe",
                 "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                 "num_key_value_heads": 8, "num_local_experts": 16, "original_max_position_embeddings": 4096,
                 "rms_norm_eps": 1e-05, "rope_scaling": {"long_factor": long, "long_mscale": 1.243163121016122,
                                                         "original_max_position_embeddings": 4096, "short_factor": short,
                                                         "short_mscale": 1.243163121016122, "type": "longrope"},
                 "rope_theta": 10000.0, "router_jitter_noise": 0.01, "sliding_window": 131072,
                 "tie_word_embeddings": False, "vocab_size": 32064}
    cfg = model_config_from_hf(published)
    s = cfg.rope_scaling
    assert (cfg.architecture, s.kind, s.use_long_factor, s.long_factor, s.attention_factor) == (
        "PhimoeForCausalLM", "longrope", True, tuple(long), 1.243163121016122)
    assert (cfg.moe_routing, cfg.moe_router_jitter, cfg.num_experts, cfg.expert_ffn_dim, cfg.norm) == (
        "sparsemixer", 0.01, 16, 6400, "layernorm")
    assert cfg.qkv_bias and cfg.out_bias and cfg.lm_head_bias
    with torch.device("meta"):
        theirs = tf.PhimoeForCausalLM(tf.PhimoeConfig(**{k: v for k, v in published.items() if k != "architectures"}))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())


def test_afmoe_defaults_as_transformers_fill_them():
    """A Trinity config.json that names only the sizes: AfmoeConfig's defaults (its layer_types from
    global_attn_every_n_layers, one dense layer, 64 experts of 1408 with 6 chosen and 2 shared, the
    window, the context, head_dim 128, KV heads = heads), and RoPE only where a layer slides."""
    import transformers as tf
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4)
    theirs = tf.AfmoeConfig(**fields)
    cfg = model_config_from_hf({"architectures": ["AfmoeForCausalLM"], **fields})
    sliding = tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert (cfg.sliding_layers, cfg.rope_layers, cfg.sliding_window) == (sliding, sliding, theirs.sliding_window)
    assert cfg.moe_layers == tuple(i >= theirs.num_dense_layers for i in range(8))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn_dim, cfg.moe_shared_ffn_dim, cfg.moe_routed_scale) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
        theirs.moe_intermediate_size * theirs.num_shared_experts, theirs.route_scale)
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.max_position_embeddings, cfg.embed_scale) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.max_position_embeddings, 1.0)   # mup_enabled: false


@pytest.mark.parametrize("name", ["exaone", "internlm3"])
def test_llama_run_families_read_as_transformers_reads_them(name, hf_model_dir):
    """EXAONE 3.5 and InternLM3, which transformers runs as LlamaForCausalLM: their uploads' config.json
    (own field names: num_layers, layer_norm_epsilon, activation_function; qkv_bias, bias) and the one
    transformers writes back (Llama's names, architectures LlamaForCausalLM, the model_type kept) give
    one ModelConfig, with the fields transformers reads; InternLM3's "dynamic" RoPE is the plain
    rotation, served up to the original context."""
    import transformers as tf
    folder = Path(hf_model_dir(name))
    theirs = tf.AutoConfig.from_pretrained(folder)
    resaved = {**theirs.to_dict(), "architectures": ["LlamaForCausalLM"]}
    published = json.loads((folder / "config.json").read_text())
    cfg = model_config_from_hf(published)
    assert model_config_from_hf(resaved) == cfg
    assert cfg.architecture == published["architectures"][0] != "LlamaForCausalLM"
    assert (cfg.n_layers, cfg.norm_eps, cfg.activation, cfg.n_kv_heads, cfg.head_dim) == (
        theirs.num_hidden_layers, theirs.rms_norm_eps, theirs.hidden_act, theirs.num_key_value_heads, theirs.head_dim)
    assert (cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias) == (theirs.attention_bias,) * 2 + (theirs.mlp_bias,)
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (theirs.rope_parameters["rope_theta"],
                                                            theirs.max_position_embeddings)
    assert (cfg.rope_scaling is None) == (theirs.rope_parameters["rope_type"] == "dynamic")


def test_gpt_neox_config_as_transformers_reads_it():
    """Pythia's published config.json (pythia-160m: the legacy rotary_pct / rotary_emb_base, no
    attention_bias or use_parallel_residual) and one that names nothing optional, read as
    GPTNeoXConfig reads them: its RoPE parameters, biases, block layout and special ids."""
    import transformers as tf
    pythia = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
              "hidden_size": 768, "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
              "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_emb_base": 10000,
              "rotary_pct": 0.25, "tie_word_embeddings": False, "use_cache": True, "use_parallel_residual": True,
              "vocab_size": 50304}
    bare = dict(vocab_size=256, hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    for fields in (pythia, {"architectures": ["GPTNeoXForCausalLM"], **bare},
                   {"architectures": ["GPTNeoXForCausalLM"], **bare, "rotary_pct": 0.5, "rotary_emb_base": 5000,
                    "use_parallel_residual": False, "attention_bias": False, "tie_word_embeddings": True}):
        theirs = tf.GPTNeoXConfig(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        head = theirs.hidden_size // theirs.num_attention_heads
        assert (cfg.rope_theta, cfg.rope_dim, cfg.eos_token_ids, cfg.bos_token_id, cfg.max_position_embeddings) == (
            theirs.rope_parameters["rope_theta"], int(head * theirs.rope_parameters["partial_rotary_factor"]),
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.max_position_embeddings)
        assert (cfg.qkv_bias, cfg.out_bias, cfg.parallel_block, cfg.parallel_mlp_norm, cfg.tie_embeddings) == (
            theirs.attention_bias, theirs.attention_bias, theirs.use_parallel_residual,
            theirs.use_parallel_residual, theirs.tie_word_embeddings)
        if fields is not pythia:   # (160M parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.GPTNeoXForCausalLM(theirs).parameters())


def test_gemma_config_as_transformers_reads_it():
    """gemma-2b's published config.json (hidden_act "gelu", meant as the tanh GELU), gemma-1.1's
    added hidden_activation, and one that names nothing optional, read as GemmaConfig reads them."""
    import transformers as tf
    gemma_2b = {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1,
                "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 16384,
                "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8,
                "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-06,
                "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000}
    bare = {"architectures": ["GemmaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    for fields in (gemma_2b, {**gemma_2b, "hidden_activation": "gelu_pytorch_tanh"}, bare):
        theirs = tf.GemmaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")})
        cfg = model_config_from_hf(fields)
        assert (cfg.activation, cfg.head_dim, cfg.rope_theta, cfg.n_kv_heads, cfg.norm_eps) == (
            acts[theirs.hidden_act], theirs.head_dim, theirs.rope_parameters["rope_theta"],
            theirs.num_key_value_heads, theirs.rms_norm_eps)
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_position_embeddings, cfg.tie_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.max_position_embeddings, theirs.tie_word_embeddings)
        assert cfg.softmax_scale == pytest.approx(theirs.head_dim ** -0.5)
        if fields is bare:   # (2.5B parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.GemmaForCausalLM(theirs).parameters())


def test_gpt_bigcode_config_as_transformers_reads_it():
    """StarCoder's published config.json (bigcode/starcoder: exact GELU, one KV head, its own ids), one
    without multi_query, and one that names nothing optional, read as GPTBigCodeConfig reads them."""
    import transformers as tf
    starcoder = {"activation_function": "gelu", "architectures": ["GPTBigCodeForCausalLM"],
                 "attention_softmax_in_fp32": True, "bos_token_id": 0, "eos_token_id": 0, "layer_norm_epsilon": 1e-05,
                 "model_type": "gpt_bigcode", "multi_query": True, "n_embd": 6144, "n_head": 48, "n_inner": 24576,
                 "n_layer": 40, "n_positions": 8192, "scale_attention_softmax_in_fp32": True,
                 "scale_attn_weights": True, "vocab_size": 49152}
    bare = {"architectures": ["GPTBigCodeForCausalLM"], "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4}
    acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    for fields in (starcoder, bare, {**bare, "multi_query": False, "scale_attn_weights": False}):
        theirs = tf.GPTBigCodeConfig(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        hd = theirs.n_embd // theirs.n_head
        assert (cfg.activation, cfg.n_kv_heads, cfg.ffn_dim, cfg.max_position_embeddings, cfg.norm_eps) == (
            acts[theirs.activation_function], 1 if theirs.multi_query else theirs.n_head,
            theirs.n_inner or 4 * theirs.n_embd, theirs.n_positions, theirs.layer_norm_epsilon)
        assert cfg.softmax_scale == (hd ** -0.5 if theirs.scale_attn_weights else 1.0)
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.tie_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.tie_word_embeddings)
        if fields is not starcoder:   # (15.5B parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.GPTBigCodeForCausalLM(theirs).parameters())


def test_falcon_config_as_transformers_reads_it():
    """Falcon-7B's and Falcon-40B's published config.json and one that names nothing optional, read as
    FalconConfig reads them: KV heads, block layout, MLP width, ids."""
    import transformers as tf
    f7 = {"alibi": False, "apply_residual_connection_post_layernorm": False, "architectures": ["FalconForCausalLM"],
          "bias": False, "bos_token_id": 11, "eos_token_id": 11, "hidden_size": 4544, "layer_norm_epsilon": 1e-05,
          "model_type": "falcon", "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 71,
          "num_hidden_layers": 32, "parallel_attn": True, "vocab_size": 65024}
    f40 = {**f7, "hidden_size": 8192, "num_attention_heads": 128, "num_hidden_layers": 60, "num_kv_heads": 8,
           "new_decoder_architecture": True}
    bare = {"architectures": ["FalconForCausalLM"], "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    for fields in (f7, f40, bare):
        theirs = tf.FalconConfig(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        assert (cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.rope_theta, cfg.max_position_embeddings) == (
            theirs.num_key_value_heads, theirs.head_dim, theirs.ffn_hidden_size, theirs.rope_parameters["rope_theta"],
            theirs.max_position_embeddings)
        assert (cfg.parallel_block, cfg.parallel_mlp_norm, cfg.qkv_bias) == (
            theirs.parallel_attn or theirs.new_decoder_architecture, theirs.new_decoder_architecture, theirs.bias)
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.tie_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.tie_word_embeddings)
        if fields is bare:   # (7B and 40B parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.FalconForCausalLM(theirs).parameters())
    with pytest.raises(ConfigError, match="alibi"):
        model_config_from_hf({**bare, "alibi": True})


def test_minimax_m2_config_as_transformers_reads_it():
    """MiniMax-M2's published config.json (the legacy rotary_dim, rope_theta at the top level, its own
    keys for what transformers hard-codes) and one that names nothing optional, read as
    MiniMaxM2Config reads them."""
    import transformers as tf
    m2 = {"architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
          "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
          "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
          "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
          "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
          "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}
    bare = {"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 4, "num_experts_per_tok": 2}
    # a top-level partial_rotary_factor wins over the legacy rotary_dim (MiniMaxM2Config's setdefault)
    for fields in (m2, bare, {**bare, "rotary_dim": 8, "partial_rotary_factor": 0.25}):
        theirs = tf.MiniMaxM2Config(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        rotary = int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
        assert (cfg.rope_theta, cfg.rope_dim, cfg.n_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (
            theirs.rope_parameters["rope_theta"], rotary, theirs.num_key_value_heads, theirs.head_dim,
            theirs.max_position_embeddings)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.eos_token_ids, cfg.bos_token_id) == (
            theirs.num_local_experts, theirs.num_experts_per_tok, (theirs.eos_token_id,), theirs.bos_token_id)
        if fields is bare:   # (230B parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.MiniMaxM2ForCausalLM(theirs).parameters())


def test_cwm_and_ministral_defaults_as_transformers_fill_them():
    """A CWM config.json naming only its sizes: CwmConfig's layer pattern (every 4th layer from the first
    global), window, Llama 3 RoPE and end ids; Granite SWA's the same pattern, its window, tied head and
    ids; Ministral's window on every layer by default."""
    import transformers as tf
    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    theirs = tf.CwmConfig(**fields)
    cfg = model_config_from_hf({"architectures": ["CwmForCausalLM"], **fields})
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert cfg.sliding_window == theirs.sliding_window and cfg.rope_theta == theirs.rope_parameters["rope_theta"]
    rope = theirs.rope_parameters
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (
        rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"])
    assert list(cfg.eos_token_ids) == theirs.eos_token_id and cfg.bos_token_id == theirs.bos_token_id
    theirs = tf.GraniteSWAConfig(**fields)
    cfg = model_config_from_hf({"architectures": ["GraniteSWAForCausalLM"], **fields})
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert (cfg.sliding_window, cfg.tie_embeddings, cfg.eos_token_ids, cfg.rope_layers) == (
        theirs.sliding_window, theirs.tie_word_embeddings, (theirs.eos_token_id,), None)
    theirs = tf.MinistralConfig(**fields, sliding_window=32)
    cfg = model_config_from_hf({"architectures": ["MinistralForCausalLM"], **fields, "sliding_window": 32})
    assert theirs.layer_types == ["sliding_attention"] * 6 and cfg.sliding_window == 32 and cfg.sliding_layers is None


@pytest.mark.parametrize("arch,fields,message", [
    ("SolarOpenForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("Dots1ForCausalLM", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
                          "n_routed_experts": 4, "num_experts_per_tok": 2}, "partial_rotary_factor"),
    ("Glm4MoeLiteForCausalLM", {"head_dim": 32, "qk_rope_head_dim": 16}, "head_dim"),
    ("FalconForCausalLM", {"multi_query": False, "num_kv_heads": 2}, "num_kv_heads"),
    ("FalconForCausalLM", {"alibi": True}, "alibi"),
    ("GraniteSWAForCausalLM", {"num_hidden_layers": 5, "layer_rope_theta": [1e4, 50.0, 50.0, 50.0, 2e4]},
     "layer_rope_theta"),
])
def test_new_family_configs_transformers_cannot_run_are_refused_by_field(arch, fields, message):
    """Options the transformers classes do not run as the config says (Solar Open's and dots.llm1's
    partial rotary, which their apply_rotary_pos_emb cannot pass through; a head_dim that
    Glm4MoeLiteConfig silently takes for qk_rope_head_dim; a multi-head Falcon with fewer KV heads,
    which FalconAttention builds per head anyway; Falcon-RW's ALiBi; Granite SWA's full layers at two
    RoPE bases) are refused naming the field."""
    base = {"architectures": [arch], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf({**base, **fields})


def test_helium_gemma_and_qwen2_vl_defaults_as_transformers_fill_them():
    """Fields a config.json leaves out: HeliumConfig's RoPE base 100 000 and epsilon, GemmaConfig's 16 KV
    heads, Qwen2VLTextConfig's 8 KV heads and window only from layer 80."""
    import transformers as tf
    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    theirs, cfg = tf.HeliumConfig(**fields), model_config_from_hf({"architectures": ["HeliumForCausalLM"], **fields})
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (
        theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps, theirs.max_position_embeddings,
        theirs.bos_token_id, (theirs.eos_token_id,))
    sixteen = {**fields, "num_attention_heads": 16, "hidden_size": 256}
    del sixteen["num_key_value_heads"]
    theirs, cfg = tf.GemmaConfig(**sixteen), model_config_from_hf({"architectures": ["GemmaForCausalLM"], **sixteen})
    assert cfg.n_kv_heads == theirs.num_key_value_heads == 16
    text = {**sixteen, "num_hidden_layers": 30, "use_sliding_window": True, "sliding_window": 8,
            "model_type": "qwen2_vl_text"}
    theirs = tf.Qwen2VLConfig(text_config=text).text_config
    cfg = model_config_from_hf({"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": text})
    assert cfg.n_kv_heads == theirs.num_key_value_heads == 8
    assert theirs.layer_types == ["full_attention"] * 30   # (the window from layer 80: on no layer)
    assert cfg.sliding_window is None or (cfg.sliding_layers is not None and not any(cfg.sliding_layers))


def test_gpt_bigcode_without_multi_query_in_its_config_is_refused_by_tensor(tmp_path):
    """A multi-head GPTBigCode checkpoint whose config.json leaves multi_query out (GPTBigCodeConfig's
    default: one KV head) has a c_attn of 3 d rows, not d + 2 hd: refused naming the tensor, as
    transformers refuses its size, instead of loading three wrong projections."""
    from jaxinfer.errors import CheckpointError
    from tests.hf_models import save_hf_model
    folder = tmp_path / "mha"
    save_hf_model("gpt-bigcode-mha", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["multi_query"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="c_attn"):
        Generator.from_pretrained(str(folder), dtype="float32", max_model_len=32, num_blocks=5, warmup=False)


def test_nemotron_config_as_transformers_reads_it():
    """Minitron-4B's published config.json (partial_rotary_factor at the top level, norm_eps) and one that
    names nothing optional (NemotronConfig's half-rotated heads), read as NemotronConfig reads them."""
    import transformers as tf
    minitron = {"architectures": ["NemotronForCausalLM"], "bos_token_id": 2, "eos_token_id": 3, "head_dim": 128,
                "hidden_act": "relu2", "hidden_size": 3072, "intermediate_size": 9216,
                "max_position_embeddings": 4096, "model_type": "nemotron", "norm_eps": 1e-05,
                "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "partial_rotary_factor": 0.5, "rope_theta": 10000, "tie_word_embeddings": False, "vocab_size": 256000}
    bare = {"architectures": ["NemotronForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    for fields in (minitron, bare):
        theirs = tf.NemotronConfig(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        rotary = int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"])
        assert (cfg.rope_dim, cfg.head_dim, cfg.norm_eps, cfg.activation, cfg.gated_mlp, cfg.norm) == (
            rotary, theirs.head_dim, theirs.norm_eps, theirs.hidden_act, False, "layernorm1p")
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_position_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.max_position_embeddings)
        if fields is bare:   # (4B parameters: not built)
            assert cfg.num_params() == sum(p.numel() for p in tf.NemotronForCausalLM(theirs).parameters())
    from jaxinfer.quantize import calibrated_unsupported   # AWQ / SmoothQuant cannot fold into 1 + w
    assert "(1 + w)" in calibrated_unsupported(cfg)


def test_phi_config_as_transformers_reads_it():
    """Phi-2's published config.json (microsoft/phi-2, transformers' own format since 4.37) and one
    that names nothing optional, read as PhiConfig reads them: RoPE, KV heads, q / k norms, ids."""
    import transformers as tf
    phi2 = {"architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0,
            "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02,
            "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "partial_rotary_factor": 0.4, "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 51200}
    bare = {"architectures": ["PhiForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    for fields in (phi2, bare):
        theirs = tf.PhiConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")})
        cfg = model_config_from_hf(fields)
        head = theirs.hidden_size // theirs.num_attention_heads
        assert (cfg.rope_theta, cfg.rope_dim, cfg.n_kv_heads, cfg.qk_norm) == (
            theirs.rope_parameters["rope_theta"], int(head * theirs.rope_parameters["partial_rotary_factor"]),
            theirs.num_key_value_heads, theirs.qk_layernorm)
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_position_embeddings, cfg.tie_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.max_position_embeddings, theirs.tie_word_embeddings)


def test_stablelm_config_as_transformers_reads_it():
    """A StableLM 2 1.6B-style config.json, StableLM 2 12B's options, and one that names nothing
    optional (StableLmConfig's 32 KV heads, a quarter of each head rotated, ids 0), read as
    StableLmConfig reads them."""
    import transformers as tf
    two = {"architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257,
           "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5632, "layer_norm_eps": 1e-05,
           "max_position_embeddings": 4096, "model_type": "stablelm", "num_attention_heads": 32,
           "num_hidden_layers": 24, "num_key_value_heads": 32, "partial_rotary_factor": 0.25, "qk_layernorm": False,
           "rope_scaling": None, "rope_theta": 10000, "tie_word_embeddings": False, "use_parallel_residual": False,
           "use_qkv_bias": True, "vocab_size": 100352}
    bare = {"architectures": ["StableLmForCausalLM"], "vocab_size": 256, "hidden_size": 64 * 32,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 32}
    for fields in (two, {**two, "num_key_value_heads": 8, "qk_layernorm": True, "use_parallel_residual": True,
                         "use_qkv_bias": False}, bare):
        theirs = tf.StableLmConfig(**{k: v for k, v in fields.items() if k != "architectures"})
        cfg = model_config_from_hf(fields)
        head = theirs.hidden_size // theirs.num_attention_heads
        assert (cfg.rope_theta, cfg.rope_dim, cfg.n_kv_heads, cfg.qkv_bias, cfg.qk_norm_heads, cfg.parallel_block) == (
            theirs.rope_parameters["rope_theta"], int(head * theirs.rope_parameters["partial_rotary_factor"]),
            theirs.num_key_value_heads, theirs.use_qkv_bias, theirs.qk_layernorm, theirs.use_parallel_residual)
        assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_position_embeddings) == (
            (theirs.eos_token_id,), theirs.bos_token_id, theirs.max_position_embeddings)


def test_hunyuan_rope_as_transformers_computes_it():
    """HunYuan's "dynamic" RoPE with a fixed alpha: the rotation at the stretched base, frequency by
    frequency as transformers' HunYuanDenseV1RotaryEmbedding computes them (its ntk_alpha), from a
    config.json with the checkpoints' legacy keys beside it."""
    import transformers as tf
    fields = dict(vocab_size=256, hidden_size=512, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, rope_theta=10000.0, max_position_embeddings=32768,
                  rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "type": "dynamic"})
    legacy = dict(use_qk_norm=True, use_rotary_pos_emb=True, attention_head_dim=128, use_cla=False, moe_topk=1)
    theirs = tf.HunYuanDenseV1Config(**fields)
    ref = tf.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1RotaryEmbedding(theirs).inv_freq.numpy()
    cfg = model_config_from_hf({"architectures": ["HunYuanDenseV1ForCausalLM"], **fields, **legacy})
    ours = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)   # float32 powers of one base (2^-23 each, a few roundings)
    assert (cfg.qk_norm, cfg.qk_norm_after_rope, cfg.n_kv_heads, cfg.head_dim) == (True, True, 2, 128)


def test_cohere_configs_as_transformers_reads_them():
    """Cohere2 without layer_types: every sliding_window_pattern-th layer global (Cohere2Config);
    without a window no layer rotates (Cohere2Attention rotates only where the layer has one).
    Command R+'s per-head k norm cannot follow KV heads repeated for tensor parallelism: refused."""
    import transformers as tf
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4)
    theirs = tf.Cohere2Config(**fields, sliding_window_pattern=3)
    cfg = model_config_from_hf({"architectures": ["Cohere2ForCausalLM"], **fields, "sliding_window_pattern": 3})
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in theirs.layer_types) == cfg.rope_layers
    assert cfg.sliding_window == theirs.sliding_window == 4096
    cfg = model_config_from_hf({"architectures": ["Cohere2ForCausalLM"], **fields, "sliding_window": None})
    assert cfg.rope_layers == (False,) * 6 and cfg.sliding_window is None
    from jaxinfer.models.decoder import FusedLayout
    plus = model_config_from_hf({"architectures": ["CohereForCausalLM"], **fields, "num_key_value_heads": 2,
                                 "use_qk_norm": True})
    assert FusedLayout.for_tp(plus, 2).kv_replicas == 1
    with pytest.raises(ConfigError, match="weights per KV head"):
        FusedLayout.for_tp(plus, 4)


def test_ernie4_5_moe_layer_pattern_as_transformers_reads_it():
    """moe_layer_end_index -1 (the last layer, Ernie4_5_MoeConfig), an interval, a start; use_bias
    (biased dense and shared MLPs beside unbiased routed experts) refused by name."""
    import transformers as tf
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, moe_intermediate_size=16, moe_num_experts=4, moe_k=2)
    for pattern in (dict(moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1),
                    dict(moe_layer_start_index=0, moe_layer_end_index=4, moe_layer_interval=2)):
        theirs = tf.Ernie4_5_MoeForCausalLM(tf.Ernie4_5_MoeConfig(**fields, **pattern))
        moe = tuple(type(layer.mlp).__name__ == "Ernie4_5_MoeSparseMoeBlock" for layer in theirs.model.layers)
        cfg = model_config_from_hf({"architectures": ["Ernie4_5_MoeForCausalLM"], **fields, **pattern})
        assert tuple(cfg.is_moe_layer(i) for i in range(6)) == moe
    with pytest.raises(ConfigError, match="use_bias"):
        model_config_from_hf({"architectures": ["Ernie4_5_MoeForCausalLM"], **fields, "use_bias": True})


def test_glm4_published_config_spelling():
    """GLM-4-0414's config.json (rope_theta and partial_rotary_factor at the top level, no
    rope_parameters), and one that leaves the factor out, as transformers' Glm4Config reads them."""
    import transformers as tf
    fields = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, rope_theta=10000.0)
    for extra in ({"partial_rotary_factor": 0.25}, {}, {"partial_rotary_factor": 1.0}):
        theirs = tf.Glm4Config(**fields, **extra).rope_parameters
        cfg = model_config_from_hf({"architectures": ["Glm4ForCausalLM"], **fields, **extra})
        assert cfg.rope_dim == int(32 * theirs["partial_rotary_factor"]) and cfg.rope_theta == theirs["rope_theta"]
        assert cfg.qkv_bias == tf.Glm4Config(**fields).attention_bias


@pytest.mark.parametrize("change,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    # the vision-language wrapper reads its language model from text_config (tests/test_vision_language.py)
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "needs a 'text_config' object"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers with RoPE scaling"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
])
def test_refused_gemma_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(cfg_dict("gemma3") | change)


def test_longrope_factors_must_fit_the_rotated_features():
    c = cfg_dict("phi3-longrope")
    c["rope_parameters"] = dict(c["rope_parameters"], short_factor=[1.0] * 8)
    with pytest.raises(ConfigError, match="longrope needs short_factor and long_factor of 6 values"):
        model_config_from_hf(c)


# ------------------------------------------------------------------------------ tensor / pipeline parallelism

def test_tensor_and_pipeline_parallel_equal_one_device(tmp_path):
    """tests/families_worker.py on 8 fake CPU devices: Qwen3 at TP 2 and 4, Gemma 3 at TP 2 and PP 2
    (PP 2 on both attentions: the Pallas ragged kernel takes the stage's window as an input), Command R+
    at TP 2 (its per-head q / k norm weights split with the heads) give one
    device's logits (to float32 reduction order) and greedy tokens."""
    from tests.fake_devices import run_model_runs
    from tests.families_worker import RUNS

    for run, r in run_model_runs("tests.families_worker", RUNS, tmp_path).items():
        assert r["rel_err"] < 1e-5 and r["same_tokens"], (run, r)


def test_hunyuan_moe_router_stays_float32(hf_model_dir):
    """HunYuan MoE's router is float32 whatever the model's dtype (HunYuanMoEV1Gate's nn.Linear(dtype=
    torch.float32), its input cast to float): loaded in bfloat16 it is transformers' float32 values bit
    for bit, the rest bfloat16."""
    import jax.numpy as jnp
    import transformers as tf

    from jaxinfer.weights import load_model
    folder = hf_model_dir("hunyuan-moe")
    theirs = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).model.layers[0]
    assert theirs.mlp.gate.wg.weight.dtype == torch.float32 and theirs.self_attn.q_proj.weight.dtype == torch.bfloat16
    ours = load_model(folder, "bfloat16")[0].layers[0]
    assert ours.attn.q.get_value().dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours.mlp.router.get_value()), theirs.mlp.gate.wg.weight.detach().numpy().T)


@pytest.mark.parametrize("arch, hint", [("OLMoForCausalLM", "OlmoForCausalLM"), ("Phi3SmallForCausalLM", "block-sparse"),
                                        ("NoSuchForCausalLM", "supported: ")])
def test_unsupported_architecture_named(arch, hint):
    """An architecture no builder reads: one ConfigError naming it (and, for a format close to a supported
    one, what to load instead)."""
    with pytest.raises(ConfigError, match=f"unsupported architecture '{arch}'.*{hint}"):
        model_config_from_hf({"architectures": [arch], "hidden_size": 64})


def test_llama4_upload_reads_as_transformers_fills_it(hf_model_dir, tmp_path):
    """A Llama 4 upload (Llama4ForConditionalGeneration): its text_config names only some fields, the rest
    are Llama4TextConfig's (no RoPE on every fourth layer, MoE on every interleave_moe_layer_step-th, 16
    experts, top-1, the temperature tuning's scales, the chunk); its language model's tensors under
    language_model.* give transformers' text model's logits. max_model_len defaults to one attention
    chunk when that is shorter than the context, and a longer one is refused naming attention_chunk_size
    (chunked attention differs from causal past one chunk, and jaxinfer does not implement it)."""
    import transformers as tf
    from safetensors.numpy import load_file, save_file
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=16,
                  interleave_moe_layer_step=2)
    theirs = tf.Llama4TextConfig(**fields)
    cfg = model_config_from_hf({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                                "text_config": {"model_type": "llama4_text", **fields}, "vision_config": {}})
    assert cfg.architecture == "Llama4ForCausalLM" and cfg.rope_layers == tuple(map(bool, theirs.no_rope_layers))
    assert cfg.moe_layers == tuple(i in theirs.moe_layers for i in range(8)) and not all(cfg.moe_layers)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_ffn_dim, cfg.moe_shared_ffn_dim, cfg.ffn_dim) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size, theirs.intermediate_size,
        theirs.intermediate_size_mlp)
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"],
        theirs.max_position_embeddings)
    assert (cfg.attention_chunk, cfg.nope_query_scale, cfg.qk_rms_after_rope) == (
        theirs.attention_chunk_size, (theirs.attn_scale, theirs.floor_scale), theirs.use_qk_norm)

    folder = Path(hf_model_dir("llama4-scout"))
    text = json.loads((folder / "config.json").read_text())
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "vision_config": {},
        "text_config": {**text, "attention_chunk_size": 40}}))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in tensors.items()}, str(wrapped / "model.safetensors"))
    prompt = [3, 17, 42, 9, 100, 5, 77, 12, 8, 60, 33, 1, 7, 19, 20, 21, 22, 23]   # NoPE scales grow every 4
    with torch.no_grad():
        ref = build_hf_model("llama4-scout")(torch.tensor([prompt])).logits[0].numpy()
    with pytest.raises(ConfigError, match=r"longer than one attention chunk \(40 positions: config.json's "
                                          r"attention_chunk_size\)"):
        Generator.from_pretrained(wrapped, max_model_len=48, num_blocks=16, block_size=8)
    gen = Generator.from_pretrained(wrapped, dtype="float32", max_num_batched_tokens=16, token_buckets=[16],
                                    num_blocks=16, block_size=8, warmup=False)
    assert gen.client.max_model_len == 40 < gen.model_cfg.max_position_embeddings
    assert np.abs(gen.logits(prompt) - ref).max() <= 1e-4 * np.abs(ref).max()
