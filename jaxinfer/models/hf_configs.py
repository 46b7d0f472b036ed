"""Hugging Face config.json -> ModelConfig, one builder per family.

The only place that knows how each supported family's config.json spells things (its weight
names live beside it in hf_maps.py); the model code reads ModelConfig only. A family is a builder
here plus a weight map there: Llama, Mistral, Qwen2 and Qwen3 share one builder (Qwen3 adds the
per-head q/k norms), which Mixtral and Qwen3-MoE extend with their experts; Gemma 2 and Gemma 3
(text) another, then Phi-3 (Phi-4-mini: the same class), gpt-oss, GPT-2 and BLOOM. transformers >= 5
writes RoPE settings as `rope_parameters` (per layer type for
Gemma 3); older files write rope_theta / rope_scaling / rope_local_base_freq at the top level: both
are read. model_config_from_hf is the entry point (a config.json's path or its parsed dict).
This module never imports jax.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxinfer.config import MAX_POSITIONS, ConfigError, ModelConfig, RopeScaling, _is_int, _is_number

# config.json fields (every supported family's names) that must be positive integers / numbers
_HF_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_embed", "n_head",
                  "n_layer", "n_inner", "n_positions", "seq_length", "max_window_layers", "num_layers",
                  "original_max_position_embeddings", "num_experts", "num_local_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "decoder_sparse_step", "shared_expert_intermediate_size",
                  "n_routed_experts", "n_group", "topk_group", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "moe_shared_expert_intermediate_size")
_HF_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "norm_epsilon", "layer_norm_eps", "logit_scale", "rope_theta",
                    "rope_local_base_freq", "swiglu_alpha")
# integer fields an architecture's config may set to 0, meaning none (a dense Granite 4.0 upload: 0
# experts, 0 of them a token; the builder then reads shared_intermediate_size)
_HF_ZERO_MEANS_NONE = {"GraniteMoeHybridForCausalLM": ("num_local_experts", "num_experts", "num_experts_per_tok")}
_HF_OPTIONAL_POSITIVE = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                         "partial_rotary_factor", "swiglu_limit")

# config.json `hidden_act` -> ModelConfig.activation
_ACTIVATIONS = {"xielu": "xielu", "silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "relu2": "relu2",
                "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def model_config_from_hf(config: str | Path | dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a path to the file or its folder, or the parsed dict)."""
    where = "config.json"
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        where = str(path)
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
        cfg = build_model_config(config, where)
        head = _has_head(path.parent) if _wrapper(config) in _MULTIMODAL else None
        return cfg if head is None else dataclasses.replace(cfg, tie_embeddings=not head)
    return build_model_config(config, where)


def is_bare_model(arch: str) -> bool:
    """Whether config.json's architecture is a decoder without its LM head's class (Qwen3Model, a
    ...ForSequenceClassification: _BARE_MODELS)."""
    return arch in _BARE_MODELS


def _wrapper(config: dict[str, Any]) -> str:
    """config.json's architecture (architectures[0], else by model_type; a checkpoint transformers
    re-saved from LlamaForCausalLM keeps its model_type: _AS_LLAMA)."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type", "")
    if archs[:1] == ["LlamaForCausalLM"] and model_type in _AS_LLAMA:
        return _AS_LLAMA[model_type]
    return _ALIASES.get(archs[0], archs[0]) if archs else _ARCH_BY_MODEL_TYPE.get(model_type, "")


def build_model_config(config: dict[str, Any], where: str) -> ModelConfig:
    """The ModelConfig of a parsed config.json (`where`: its path, for messages)."""
    model_type = config.get("model_type", "")
    arch = _wrapper(config)
    if arch in _MULTIMODAL:
        return build_model_config(_language_config(config, arch, where), where)
    # the bare base model (an embedding model's Transformer, e.g. Qwen3Model): the same decoder
    arch = _BARE_MODELS.get(arch, arch)
    builder = _HF_BUILDERS.get(arch)
    if builder is None:
        hint = _NOT_SUPPORTED.get(arch, "")
        raise ConfigError(
            f"unsupported architecture {arch or model_type!r} (config.json 'architectures'){hint}; "
            f"supported: {sorted([*_HF_BUILDERS, *_MULTIMODAL])}")
    config = {**_HF_DEFAULTS.get(arch, {}), **config}   # an explicit null stays null
    check_hf_fields(config, where, arch)
    try:
        return builder(config, arch)
    except KeyError as e:
        raise ConfigError(f"{where} for {arch} is missing field {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:   # a field of a type the checks above did not foresee
        raise ConfigError(f"{where}: a field has the wrong type for {arch} ({e})") from None


# vision-language checkpoints whose language model is a supported decoder, served text-only (as
# vLLM with an image limit of 0): config.json's text_config, the weights under language_model
# (weights.stored_name), a request with an image part refused (serve/protocol.py). Each: its
# text_config's model types (the first: its class's default) and the decoder each is. Qwen2-VL's,
# Qwen2.5-VL's and Qwen3-VL's M-RoPE gives every text token one position on its three axes: plain
# RoPE. LLaVA's text_config is any causal LM's (AutoConfig): the ones its releases use (LLaVA 1.5:
# Vicuna, a llama; LLaVA-NeXT: Vicuna, Mistral, Llama 3, Yi; Pixtral: Mistral; LLaVA-OneVision and
# LLaVA-Interleave: Qwen2).
_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MULTIMODAL = {"Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
               "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"},
               "LlavaForConditionalGeneration": _LLAVA_TEXT, "LlavaNextForConditionalGeneration": _LLAVA_TEXT,
               "LlavaOnevisionForConditionalGeneration": {"qwen2": "Qwen2ForCausalLM", **_LLAVA_TEXT},
               "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
               "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
               "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
               "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
               "Llama4ForConditionalGeneration": {"llama4_text": "Llama4ForCausalLM"},
               "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": "Qwen3_5ForCausalLM"},
               "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}}
# Qwen2-VL's and Qwen2.5-VL's config.json before transformers 5 keep the text fields at the top level
_FLAT_TEXT = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# fields the wrapper's config.json holds for its language model (Gemma 3's eos_token_id [1, 106])
_INHERITED = ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config", "compression_config")
# the text config classes' defaults where they differ from the decoders' (Qwen3VLTextConfig's,
# Qwen2_5_VLTextConfig's)
_QWEN2_VL_TEXT = {"rope_theta": 1000000.0, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                  "num_key_value_heads": 8, "max_window_layers": 80, "bos_token_id": 151643, "eos_token_id": 151645}
_BASE_SIZES = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
_TEXT_DEFAULTS = {"qwen3_vl_text": {"rope_theta": 500000.0, "max_position_embeddings": 128000, "head_dim": 128,
                                    "rms_norm_eps": 1e-6, "num_key_value_heads": 32, "intermediate_size": 22016},
                  "qwen2_5_vl_text": _QWEN2_VL_TEXT, "qwen2_vl_text": _QWEN2_VL_TEXT,
                  # LlamaConfig's, MistralConfig's and Qwen2Config's sizes: LLaVA 1.5's and LLaVA-NeXT's
                  # text_config names only the fields that differ from them
                  "llama": {**_BASE_SIZES, "intermediate_size": 11008, "max_position_embeddings": 2048,
                            "bos_token_id": 1, "eos_token_id": 2},
                  "mistral": {**_BASE_SIZES, "intermediate_size": 14336, "num_key_value_heads": 8,
                              "max_position_embeddings": 131072, "sliding_window": 4096, "bos_token_id": 1,
                              "eos_token_id": 2},
                  "qwen2": {**_BASE_SIZES, "vocab_size": 151936, "intermediate_size": 22016,
                            "max_position_embeddings": 32768},
                  "qwen3_vl_moe_text": {"rope_theta": 500000.0, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                                        "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_key_value_heads": 16,
                                        "num_local_experts": 60, "num_experts_per_tok": 4}}
# (Qwen3-VL-MoE's default expert count under the alias transformers 5 saves: a config's own num_experts
# or num_local_experts still wins, _num_experts)
# what the text model computes whatever its config says: Qwen3-VL-MoE's router always renormalizes the
# chosen experts' probabilities (Qwen3VLMoeTextTopKRouter) and no layer has a window
_TEXT_FIXED = {"qwen3_vl_moe_text": {"norm_topk_prob": True, "use_sliding_window": False}}


def _language_config(config: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The text_config of a vision-language config.json as a causal LM's config.json."""
    text = config.get("text_config")
    if text is None and arch in _FLAT_TEXT:
        text = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "vision_config")}
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: {arch} needs a 'text_config' object (its language model's config)")
    kinds = _MULTIMODAL[arch]
    kind = text.get("model_type", next(iter(kinds)))
    if kind not in kinds:
        raise ConfigError(f"{where}: {arch} with a text_config of model_type {kind!r} is not supported; "
                          f"supported: {list(kinds)}")
    for key in ("rope_scaling", "rope_parameters"):   # Qwen2.5-VL's legacy {"type": "mrope", "mrope_section": ...}
        p = text.get(key)
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) == "mrope":
            text = {**text, key: {**p, "rope_type": "default"}}
    inherited = {k: config[k] for k in _INHERITED if k in config and k not in text}
    out = {**_TEXT_DEFAULTS.get(kind, {}), **inherited, **text, **_TEXT_FIXED.get(kind, {}), "model_type": kind,
           "architectures": [kinds[kind]]}
    if kind == "gemma3_text":   # Gemma3ForConditionalGeneration's head never soft-caps (the published set none)
        out["final_logit_softcapping"] = None
    return out


def _has_head(folder: Path) -> bool | None:
    """Whether a checkpoint folder stores an LM head (lm_head.weight, or its language model's), from
    its safetensors index or the files' headers; None without safetensors. A vision-language
    checkpoint ties its embeddings exactly when it stores none: transformers 5 unties a wrapper whose
    config says tied when both tensors are present, and its configs disagree between the top level
    and text_config (a re-saved Mistral Small: tied above, untied in text_config, a head stored)."""
    from jaxinfer.errors import CheckpointError
    from jaxinfer.safetensors_file import SafetensorsFile
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = set(json.loads(index.read_text())["weight_map"])
        else:
            names = {n for f in sorted(folder.glob("*.safetensors")) for n in SafetensorsFile(f).tensors}
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None   # unreadable: the weights' loader names the file
    if not names:
        return None
    return bool(names & {"lm_head.weight", "language_model.lm_head.weight"})


def check_hf_fields(c: dict[str, Any], where: str, arch: str = "") -> None:
    """One clear line for a field of the wrong type or an absurd size, before any arithmetic on it
    (`arch`: the architecture, whose _HF_ZERO_MEANS_NONE fields may be 0)."""
    may_be_zero = _HF_ZERO_MEANS_NONE.get(arch, ())
    for k in _HF_INT_FIELDS:
        v = c.get(k)
        if v is not None and (not _is_int(v) or v < 0 or (v == 0 and k not in may_be_zero)):
            raise ConfigError(f"{where}: field {k!r} must be a positive integer, got {v!r}")
    for k in _HF_FLOAT_FIELDS:
        v = c.get(k)
        if v is not None and not _is_number(v):
            raise ConfigError(f"{where}: field {k!r} must be a number, got {v!r}")
    for k in _HF_OPTIONAL_POSITIVE:
        v = c.get(k)
        if v is not None and not (_is_number(v) and v > 0):
            raise ConfigError(f"{where}: field {k!r} must be a positive number or null, got {v!r}")
    w = c.get("sliding_window")
    if w == 0 and c.get("use_sliding_window") is False:   # Qwen2MoeConfig writes 0 for "no window"
        w = None
    if w is not None and (not _is_int(w) or w <= 0):
        raise ConfigError(f"{where}: field 'sliding_window' must be a positive integer or null, got {w!r}")
    for k in ("max_position_embeddings", "n_positions", "seq_length"):
        v = c.get(k)
        if v is not None and v > MAX_POSITIONS:
            raise ConfigError(f"{where}: field {k!r} = {v} is beyond the {MAX_POSITIONS} positions jaxinfer "
                              "supports")


def _eos_ids(c: dict[str, Any]) -> tuple[int, ...]:
    eos = c.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _activation(c: dict[str, Any], *names: str, default: str = "silu") -> str:
    act = next((c[n] for n in names if c.get(n) is not None), default)
    if act not in _ACTIVATIONS:
        raise ConfigError(f"unsupported {names[0]} {act!r} in config.json; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[act]


# ------------------------------------------------------------------------------------------ RoPE

def _rope(params: dict[str, Any], c: dict[str, Any], default_theta: float = 10000.0,
          head_dim: int | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one RoPE parameter dict (rope_parameters or a legacy rope_scaling, merged);
    fields it lacks come from the top level of config.json (rope_theta, original_max_position_embeddings).
    head_dim: the rotated features (LongRoPE checks its factors against them)."""
    theta = float(params.get("rope_theta", c.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3", factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    if kind in ("longrope", "su"):
        return theta, _longrope(params, c)
    if kind == "yarn":
        return theta, _yarn(params, c)
    raise ConfigError(f"unsupported rope scaling type {kind!r} (config.json rope_parameters/rope_scaling); "
                      "supported: default, linear, llama3, longrope, yarn")


def _yarn(params: dict[str, Any], c: dict[str, Any]) -> RopeScaling:
    """YaRN (HF modeling_rope_utils._compute_yarn_parameters): factor defaults to max_position_embeddings /
    original_max_position_embeddings; the cos/sin magnitude (attention factor) to 0.1 ln(factor) + 1,
    or DeepSeek's ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given;
    beta_fast / beta_slow default to 32 / 1 (also when null or 0, as HF's `or` does); truncate to true."""
    original = int(params.get("original_max_position_embeddings") or c["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(c["max_position_embeddings"] / original if factor is None else factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32.0),
                       beta_slow=float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)))


def _longrope(params: dict[str, Any], c: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE (HF modeling_rope_utils._compute_longrope_parameters): factor defaults to
    max_position_embeddings / original_max_position_embeddings, the cos/sin magnitude (attention
    factor) to sqrt(1 + ln(factor) / ln(original)) when factor > 1.

    Which factors: HF rotates a whole sequence with the long ones once it is longer than
    original_max_position_embeddings and with the short ones before (its generate() drops the
    cache and recomputes every key at the crossing). A paged cache keeps each key as first
    rotated, so the choice here is static, as in vLLM (by max_model_len) and llama.cpp (by the
    context size): the long factors when the model serves contexts beyond the original length,
    i.e. max_position_embeddings > original_max_position_embeddings. That equals HF for every
    sequence longer than the original length, and for all sequences of a model whose served
    length is the original one; a short sequence of a long-context model gets the long factors,
    where HF would use the short ones."""
    original = int(params.get("original_max_position_embeddings") or c["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(c["max_position_embeddings"] / original if factor is None else factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in params["short_factor"]),
                       long_factor=tuple(float(x) for x in params["long_factor"]),
                       attention_factor=float(attention),
                       use_long_factor=c.get("max_position_embeddings", original) > original)


def _rotary_dim(params: dict[str, Any], c: dict[str, Any], head_dim: int, default: float) -> int | None:
    """The features of each head RoPE rotates (None: all of them) from partial_rotary_factor, in the
    RoPE parameters or at the top level of config.json (the family's default where neither has it);
    ModelConfig refuses an odd or empty count."""
    rotary = int(head_dim * float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", default))))
    return None if rotary == head_dim else rotary


def _rope_params(c: dict[str, Any]) -> dict[str, Any]:
    """The one RoPE parameter dict of a family without per-layer-type RoPE (new and legacy spellings)."""
    return {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}


# --------------------------------------------------------------------------------------- families

def _sliding_kinds(c: dict[str, Any], n: int, default: list[str]) -> tuple[bool, ...]:
    """Which of the n layers slide: config.json's layer_types (else `default`), checked."""
    types = c.get("layer_types") or default
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"field 'layer_types' must name 'sliding_attention' or 'full_attention' for each of "
                          f"the {n} layers, got {types!r}")
    return tuple(t == "sliding_attention" for t in types)


def _windows(window: int | None, sliding: tuple[bool, ...]) -> dict[str, Any]:
    """ModelConfig's sliding_window / sliding_layers for a window on the `sliding` layers."""
    on = bool(window) and any(sliding)
    return {"sliding_window": window if on else None, "sliding_layers": sliding if on and not all(sliding) else None}


def _sparse_kinds(c: dict[str, Any], n: int, default: list[str]) -> tuple[bool, ...] | None:
    """Which of the n layers are mixtures: config.json's mlp_layer_types (else `default`), checked;
    None when all are."""
    types = c.get("mlp_layer_types") or default
    if not isinstance(types, list) or len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"field 'mlp_layer_types' must list 'dense' or 'sparse' for each of the {n} layers, "
                          f"got {types!r}")
    sparse = tuple(t == "sparse" for t in types)
    return None if all(sparse) else sparse


def _qwen_window(c: dict[str, Any]) -> tuple[int | None, tuple[bool, ...] | None]:
    """Qwen2 / Qwen3 use the window only when use_sliding_window is set, and then only on some layers
    (a field the config lacks takes transformers' Qwen2Config / Qwen3Config default: a window of
    4096 from layer 28)."""
    if not c.get("use_sliding_window", False):
        return None, None
    window = c.get("sliding_window", 4096)
    types = c.get("layer_types")
    if types is not None:
        return window, tuple(t == "sliding_attention" for t in types)
    start = c.get("max_window_layers", 28)
    return window, tuple(i >= start for i in range(c["num_hidden_layers"]))


def _llama_like(c: dict[str, Any], arch: str) -> ModelConfig:
    """Llama, Mistral, Qwen2, Qwen3: RMSNorm, RoPE, GQA, SwiGLU (Qwen3: + q/k norms); the attention
    half of Mixtral and Qwen3-MoE (_moe adds their experts); Arcee (AFM-4.5B): Llama with an ungated
    MLP, up_proj then down_proj, of squared ReLU (ArceeConfig's hidden_act default); Helium: Llama
    with q / k features rotated in pairs (hf_maps._PAIRED_ROPE) and attention_bias on q / k / v only."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    theta, scaling = _rope(_rope_params(c), c)
    window, sliding_layers = c.get("sliding_window"), None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window, sliding_layers = _qwen_window(c)
    elif arch == "Qwen3MoeForCausalLM":   # every layer windowed, and only when use_sliding_window
        window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
    elif arch in ("LlamaForCausalLM", "ArceeForCausalLM", "HeliumForCausalLM", "ExaoneForCausalLM",
                  "InternLM3ForCausalLM"):   # (the last two: run as transformers' Llama, which has no window)
        window = None
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=c.get("head_dim") or d // h,
        ffn_dim=c["intermediate_size"], activation=_activation(c, "hidden_act"),
        gated_mlp=arch not in ("ArceeForCausalLM", "ApertusForCausalLM"), norm="rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        position="rope", rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        sliding_window=window, sliding_layers=sliding_layers,
        qkv_bias=bias or arch == "Qwen2ForCausalLM", out_bias=bias and arch != "HeliumForCausalLM",
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _jais2(c: dict[str, Any], arch: str) -> ModelConfig:
    """Jais 2 (transformers' Jais2): Llama's block with LayerNorms (biased, layer_norm_eps), biases on
    q / k / v / o (attention_bias) and an ungated squared-ReLU MLP, up_proj then down_proj, with
    biases (mlp_bias)."""
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)), gated_mlp=False)


_APERTUS_ROPE = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _apertus(c: dict[str, Any], arch: str) -> ModelConfig:
    """Apertus (transformers' Apertus): Llama's attention with per-head q / k norms, its norms named
    attention_layernorm / feedforward_layernorm (hf_maps._block_norms), an ungated MLP of xIELU
    (two learned scalars and its beta / eps per layer), up_proj then down_proj; Llama 3 RoPE by default."""
    if c.get("hidden_act", "xielu") != "xielu":
        raise ConfigError(f"field 'hidden_act' = {c['hidden_act']!r}: Apertus checkpoints use xielu")
    if not c.get("rope_parameters") and not c.get("rope_scaling"):   # ApertusConfig's default
        c = {**c, "rope_parameters": {**_APERTUS_ROPE, "rope_theta": c.get("rope_theta", 12000000.0)}}
    return dataclasses.replace(_llama_like({**c, "sliding_window": None}, arch), qk_norm=True)


def _nemotron(c: dict[str, Any], arch: str) -> ModelConfig:
    """Nemotron (Minitron 4B / 8B, Nemotron-Mini-4B, Mistral-NeMo-Minitron-8B; transformers' Nemotron):
    Llama's attention (biases where attention_bias) with the first half of each head rotated by
    default (partial_rotary_factor 0.5), LayerNorm1P (weight 1 + w, with bias) and an ungated
    squared-ReLU MLP (up_proj, down_proj; biases where mlp_bias)."""
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, norm="layernorm1p", norm_eps=float(c.get("norm_eps", 1e-5)), gated_mlp=False,
                               rotary_dim=_rotary_dim(_rope_params(c), c, cfg.head_dim, 0.5))


def _ministral(c: dict[str, Any], arch: str) -> ModelConfig:
    """Ministral 8B (2410; transformers' Ministral): Mistral's block with its window on the layers
    layer_types names sliding (by default every layer, where a window is set). CWM (Meta's Code World
    Model; transformers' Cwm): Llama's, by default every 4th layer from the first global and the
    others sliding, Llama 3's RoPE scaled 16x from 8192 positions when config.json names none."""
    if arch == "CwmForCausalLM" and not c.get("rope_parameters") and not c.get("rope_scaling"):
        c = {**c, "rope_parameters": _CWM_ROPE}
    cfg = _llama_like({**c, "sliding_window": c.get("sliding_window") or None}, arch)
    if cfg.sliding_window is None:
        return cfg
    default = (["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(cfg.n_layers)]
               if arch == "CwmForCausalLM" else ["sliding_attention"] * cfg.n_layers)
    return dataclasses.replace(cfg, **_windows(cfg.sliding_window, _sliding_kinds(c, cfg.n_layers, default)))


# CwmConfig's RoPE when config.json names none
_CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
             "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
# Ministral3Config's RoPE when config.json names none
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def _ministral3(c: dict[str, Any], arch: str) -> ModelConfig:
    """Ministral 3 (3B / 8B / 14B; Mistral3ForConditionalGeneration's text model): Mistral's block with
    YaRN (Ministral3Config's default when config.json names no RoPE) and the queries after RoPE times
    1 + llama_4_scaling_beta log(1 + floor(position / original_max_position_embeddings))."""
    if not c.get("rope_parameters") and not c.get("rope_scaling"):
        c = {**c, "rope_parameters": _MINISTRAL3_ROPE}
    params = _rope_params(c)
    beta = params.get("llama_4_scaling_beta")
    period = params.get("original_max_position_embeddings")
    if beta is not None and (not _is_number(beta) or not _is_int(period) or period <= 0):
        raise ConfigError(f"llama_4_scaling_beta={beta!r} needs a number and a positive integer "
                          f"original_max_position_embeddings in rope_parameters, got {period!r}")
    cfg = _llama_like(c, arch)
    return dataclasses.replace(cfg, query_log_scale=None if beta is None else (float(beta), int(period)))


def _hunyuan(c: dict[str, Any], arch: str) -> ModelConfig:
    """HunYuan dense (Hunyuan 0.5B-7B, Hunyuan-MT; transformers' HunYuanDenseV1): Llama's block with
    an RMSNorm of each q / k head after RoPE (query_layernorm / key_layernorm), and the checkpoints'
    "dynamic" RoPE with a fixed alpha, which transformers runs as the plain rotation at the base
    rope_theta * alpha ** (head_dim / (head_dim - 2)) (its ntk_alpha)."""
    params = _rope_params(c)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if params.get("rope_type", params.get("type")) == "dynamic" and params.get("alpha"):
        theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
        base = theta * float(params["alpha"]) ** (hd / (hd - 2))
        c = {**c, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": base}}
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, qk_norm=True, qk_norm_after_rope=True)


def _internlm3(c: dict[str, Any], arch: str) -> ModelConfig:
    """InternLM3 (InternLM3ForCausalLM; transformers runs it as LlamaForCausalLM): Llama's block with
    qkv_bias on q / k / v and bias on the output projection and the MLP (InternLM's modeling code;
    transformers' attribute_map reads them as attention_bias and mlp_bias, the spellings of a
    checkpoint it re-saved), and "dynamic" RoPE (_dynamic_ntk)."""
    attention_bias = bool(c.get("attention_bias", False))
    return dataclasses.replace(_llama_like(_dynamic_ntk(c), arch),
                               qkv_bias=bool(c.get("qkv_bias", attention_bias)),
                               out_bias=bool(c.get("bias", attention_bias)),
                               mlp_bias=bool(c.get("bias", c.get("mlp_bias", False))))


def _dynamic_ntk(c: dict[str, Any]) -> dict[str, Any]:
    """config.json with "dynamic" (NTK) RoPE read as transformers runs it: the plain rotation for
    sequences up to max_position_embeddings (its dynamic_rope_update's threshold), its base rescaled
    to every longer sequence's length. A paged cache keeps each key as first rotated, so the served
    length stops at max_position_embeddings, where the two agree (vLLM instead rotates every sequence
    at the base of max_position_embeddings * factor positions)."""
    params = _rope_params(c)
    if params.get("rope_type", params.get("type")) != "dynamic":
        return c
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    return {**c, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def _internlm2(c: dict[str, Any], arch: str) -> ModelConfig:
    """InternLM2 / 2.5 (remote code: InternLM2ForCausalLM): Llama's block with q, k and v fused in
    attention.wqkv in KV groups (hf_maps._internlm2_map), biases on wqkv and wo where `bias` (its
    config class's default: true), and "dynamic" RoPE (_dynamic_ntk)."""
    bias = bool(c.get("bias", True))
    return dataclasses.replace(_llama_like(_dynamic_ntk({**c, "sliding_window": None}), arch), qkv_bias=bias,
                               out_bias=bias, mlp_bias=False)


_EXAONE_FIELDS = (("num_layers", "num_hidden_layers"), ("layer_norm_epsilon", "rms_norm_eps"),
                  ("activation_function", "hidden_act"))


def _exaone(c: dict[str, Any], arch: str) -> ModelConfig:
    """EXAONE 3.0 / 3.5 (ExaoneForCausalLM; transformers runs it as LlamaForCausalLM): Llama's block
    under GPT-2-like names (hf_maps._EXAONE_NAMES) and its config's own spellings of three fields
    (ExaoneConfig.attribute_map), read before Llama's (the class defaults' spelling)."""
    c = {**c, **{ours: c[theirs] for theirs, ours in _EXAONE_FIELDS if theirs in c}}
    return _llama_like(_dynamic_ntk(c), arch)


def _per_layer_one(c: dict[str, Any], key: str, default: int) -> int:
    """A HunYuan MoE field that may be one value or one per layer (moe_topk; different values per
    layer are refused)."""
    v = c.get(key, default)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise ConfigError(f"{key}={v!r}: a different value per layer is not supported")
        v = v[0]
    if not _is_int(v) or v <= 0:
        raise ConfigError(f"field {key!r} must be a positive integer, got {v!r}")
    return v


def _hunyuan_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """HunYuan MoE (Hunyuan-A13B; transformers' HunYuanMoEV1): the dense HunYuan attention, and on every
    layer num_experts experts of intermediate_size (softmax over all, top moe_topk, renormalized; the
    router in float32) beside a shared MLP of intermediate_size, its output added."""
    cfg = _hunyuan(c, arch)
    topk = "moe_topk" if "moe_topk" in c or "num_experts_per_tok" not in c else "num_experts_per_tok"   # (its alias)
    return dataclasses.replace(cfg, num_experts=_num_experts(c, arch), num_experts_per_tok=_per_layer_one(c, topk, 1),
                               moe_routing="softmax_topk", moe_norm_topk=True, moe_router_fp32=True,
                               moe_shared_ffn_dim=c["intermediate_size"])


def _rope_flags(c: dict[str, Any]) -> list[int]:
    """SmolLM3's and Llama 4's no_rope_layers (1 where a layer rotates; an empty list or none: every
    no_rope_layer_interval-th layer, default 4, without), one per layer."""
    n = c["num_hidden_layers"]
    flags = c.get("no_rope_layers")
    if not flags:
        interval = c.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ConfigError(f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"no_rope_layers must be at least {n} values of 0 or 1 (one per layer), got {flags!r}")
    return flags[:n]   # transformers reads no_rope_layers[layer]: entries past the last layer are unused


def _llama4(c: dict[str, Any], arch: str) -> ModelConfig:
    """Llama 4 (Scout 17B-16E, Maverick 17B-128E: Llama4ForCausalLM, or the text model of
    Llama4ForConditionalGeneration): Llama's attention with q / k features rotated in pairs
    (hf_maps._PAIRED_ROPE), no RoPE on the layers no_rope_layers marks 0 (every fourth by default) and
    the queries there scaled by position (attn_temperature_tuning: nope_query_scale), a weightless RMS
    norm of q and k after RoPE on the others (use_qk_norm); MoE on the layers moe_layers lists (default
    every interleave_moe_layer_step-th): experts of intermediate_size picked by top-k of the router logits,
    each token's input to an expert times the sigmoid of its logit (topk_sigmoid, moe_scale_inputs), plus
    a shared expert of intermediate_size; dense MLPs of intermediate_size_mlp on the other layers. Its
    RoPE layers attend within chunks of attention_chunk_size (attention_chunk: served up to one chunk)."""
    n = c["num_hidden_layers"]
    flags = _rope_flags(c)
    step = c.get("interleave_moe_layer_step", 1)
    listed = c.get("moe_layers")
    if listed is None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"interleave_moe_layer_step must be a positive integer, got {step!r}")
        listed = range(step - 1, n, step)
    if not isinstance(listed, (list, range)) or not all(isinstance(i, int) and 0 <= i < n for i in listed):
        raise ConfigError(f"moe_layers must list layer indices below num_hidden_layers ({n}), got {listed!r}")
    layers = tuple(i in set(listed) for i in range(n))
    chunk = c.get("attention_chunk_size")
    tuning = bool(c.get("attn_temperature_tuning", True))
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(
        cfg, ffn_dim=c["intermediate_size_mlp"], rope_layers=tuple(bool(f) for f in flags),
        qk_rms_after_rope=bool(c.get("use_qk_norm", True)), attention_chunk=chunk if any(flags) else None,
        nope_query_scale=(float(c["attn_scale"]), int(c["floor_scale"])) if tuning and not all(flags) else None,
        num_experts=_num_experts(c, arch), num_experts_per_tok=c["num_experts_per_tok"],
        moe_ffn_dim=c["intermediate_size"], moe_layers=None if all(layers) else layers, moe_routing="topk_sigmoid",
        moe_scale_inputs=True, moe_shared_ffn_dim=c["intermediate_size"])


def _lfm2(c: dict[str, Any], arch: str) -> ModelConfig:
    """LFM2 (Liquid: 350M ... 2.6B, LFM2.5; transformers' Lfm2): attention layers (per-head RMSNorm of q
    and k before RoPE) and short-convolution layers (layer_types "conv"; by default those not in
    full_attn_idxs) of conv_L_cache taps, each block's mixer and SwiGLU MLP behind RMSNorms
    (operator_norm, ffn_norm), the final norm named embedding_norm, tied embeddings. The MLP's width:
    intermediate_size (its uploads' block_ff_dim), and with block_auto_adjust_ff_dim 2/3 of it, times
    block_ffn_dim_multiplier and rounded up to block_multiple_of (Lfm2MLP)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        attn = c.get("full_attn_idxs")
        attn = set(range(n)) if attn is None else set(attn)
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"full_attention", "conv"}:
        raise ConfigError(f"layer_types must name one of 'full_attention' / 'conv' per layer ({n}), got {types!r}")
    f = c.get("block_ff_dim", c["intermediate_size"])
    if c.get("block_auto_adjust_ff_dim", True):
        f = int(2 * f / 3)
        if c.get("block_ffn_dim_multiplier", 1.0) is not None:
            m = c.get("block_multiple_of", 256)
            f = m * ((int(c.get("block_ffn_dim_multiplier", 1.0) * f) + m - 1) // m)
    taps = c.get("conv_L_cache", 3)
    if not _is_int(taps) or taps < 2:
        raise ConfigError(f"conv_L_cache must be an integer >= 2 (the conv layers' taps), got {taps!r}")
    cfg = _llama_like({**c, "intermediate_size": f, "rms_norm_eps": c.get("norm_eps", 1e-5), "sliding_window": None,
                       "tie_word_embeddings": c.get("tie_embedding", c.get("tie_word_embeddings", True))}, arch)
    kinds = tuple("conv" if t == "conv" else "attention" for t in types)
    return dataclasses.replace(cfg, qk_norm=True, layer_kinds=kinds, conv_kernel=taps,
                               conv_bias=bool(c.get("conv_bias", False)))


def _lfm2_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """LFM2-MoE (LFM2-8B-A1B; transformers' Lfm2Moe): LFM2's layers with dense MLPs of intermediate_size
    (as given) on the first num_dense_layers and experts of moe_intermediate_size on the others: the
    router's sigmoids plus the learned expert_bias choose the top-k (use_expert_bias), the chosen
    sigmoids renormalized (norm_topk_prob; over their sum + 1e-6) and times routed_scaling_factor, in
    the model dtype (the router's logits too)."""
    if not c.get("use_expert_bias", True):
        raise ConfigError("use_expert_bias=false (LFM2-MoE without its routing correction) is not supported: "
                          "the published LFM2-MoE models route with it")
    n = c["num_hidden_layers"]
    cfg = _lfm2({**c, "block_auto_adjust_ff_dim": False}, arch)
    layers = tuple(i >= c.get("num_dense_layers", 2) for i in range(n))
    if not any(layers):
        raise ConfigError(f"num_dense_layers={c.get('num_dense_layers')!r} leaves no MoE layer of {n}")
    return dataclasses.replace(
        cfg, num_experts=_num_experts(c, arch), num_experts_per_tok=c["num_experts_per_tok"],
        moe_ffn_dim=c["moe_intermediate_size"], moe_layers=None if all(layers) else layers, moe_routing="sigmoid_topk",
        moe_norm_topk=bool(c.get("norm_topk_prob", True)), moe_routed_scale=float(c.get("routed_scaling_factor", 1.0)),
        moe_norm_eps=1e-6, moe_router_in_dtype=True, moe_scores_in_dtype=True)


def _qwen3_next(c: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen3-Next (80B-A3B), Qwen3.5 (dense) and Qwen3.5-MoE: Gated DeltaNet layers (layer_types
    "linear_attention"; by default all but every full_attention_interval-th, 4) of linear_num_key_heads
    query / key heads of linear_key_head_dim, linear_num_value_heads value heads of
    linear_value_head_dim and a convolution of linear_conv_kernel_dim taps (models/deltanet.py)
    between attention layers whose q_proj also gives a sigmoid gate on each head's output
    (attn_out_gate), with q / k norms per head and RoPE on partial_rotary_factor of each head
    (default 0.25); every norm zero-centred (1 + w: gemma_rmsnorm). Qwen3-Next's and Qwen3.5-MoE's
    MLPs: Qwen2-MoE's (softmax top-k, renormalized where norm_topk_prob, always for Qwen3.5-MoE, plus
    the shared expert behind its sigmoid gate) on the layers Qwen3-MoE's pattern names; Qwen3.5's:
    SwiGLU. Text only: Qwen3.5's interleaved M-RoPE gives a text token one position on its three axes."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        every = c.get("full_attention_interval", 4)
        if not _is_int(every) or every < 1:
            raise ConfigError(f"full_attention_interval must be a positive integer, got {every!r}")
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"layer_types must name one of 'full_attention' / 'linear_attention' per layer ({n}), "
                          f"got {types!r}")
    linear = {k: c[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                "linear_value_head_dim", "linear_conv_kernel_dim")}
    wrong = [f"{k}={v!r}" for k, v in linear.items() if not (_is_int(v) and v > 0)]
    if wrong or linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ConfigError(f"the Gated DeltaNet's sizes must be positive integers, linear_num_value_heads a multiple "
                          f"of linear_num_key_heads: {linear}")
    if _activation(c, "hidden_act") != "silu":   # (the Gated DeltaNet's convolution applies it too)
        raise ConfigError(f"hidden_act={c.get('hidden_act')!r} is not supported for this family (every published "
                          "model uses silu, which jaxinfer's Gated DeltaNet layer applies after its convolution)")
    if c.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for this family (no published model has it: its "
                          "q_proj bias would hold the output gate's too)")
    moe = arch != "Qwen3_5ForCausalLM"
    base = {**c, "sliding_window": None, "use_sliding_window": False}
    if moe:
        base.update(num_experts=_num_experts(c, arch), shared_expert_intermediate_size=c[
            "shared_expert_intermediate_size"], intermediate_size=c.get("intermediate_size") or c["moe_intermediate_size"])
        if arch == "Qwen3_5MoeForCausalLM":   # (its router always renormalizes; every layer has experts)
            base.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    cfg = _moe(base, "Qwen3MoeForCausalLM") if moe else _llama_like(base, "Qwen3ForCausalLM")
    if moe:
        cfg = dataclasses.replace(cfg, moe_shared_ffn_dim=c["shared_expert_intermediate_size"], moe_shared_gate=True)
    kinds = tuple("linear" if t == "linear_attention" else "attention" for t in types)
    return dataclasses.replace(
        cfg, norm="gemma_rmsnorm", qk_norm=True, attn_out_gate=True,
        rotary_dim=_rotary_dim(_rope_params(c), c, cfg.head_dim, 0.25), layer_kinds=kinds,
        conv_kernel=linear["linear_conv_kernel_dim"], linear_k_heads=linear["linear_num_key_heads"],
        linear_v_heads=linear["linear_num_value_heads"], linear_k_dim=linear["linear_key_head_dim"],
        linear_v_dim=linear["linear_value_head_dim"], architecture=arch)


def _smollm3(c: dict[str, Any], arch: str) -> ModelConfig:
    """SmolLM3: Llama's block with no position encoding on some layers (transformers' SmolLM3Config:
    no_rope_layers, 1 where a layer rotates, default every no_rope_layer_interval-th layer (4) without),
    and a window only where use_sliding_window and layer_types say so."""
    flags = _rope_flags(c)
    window, sliding = None, None
    if c.get("use_sliding_window", False) and c.get("sliding_window") is not None:
        types = c.get("layer_types") or ["sliding_attention" if not f else "full_attention" for f in flags]
        window, sliding = c["sliding_window"], tuple(t == "sliding_attention" for t in types)
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, rope_layers=tuple(bool(f) for f in flags), sliding_window=window,
                               sliding_layers=sliding)


def _granite(c: dict[str, Any], arch: str) -> ModelConfig:
    """Granite (3.x dense): Llama's block with four multipliers (transformers' GraniteConfig): the
    token embeddings times embedding_multiplier, q.k times attention_multiplier (instead of
    1/sqrt(head_dim)), each branch's output times residual_multiplier before its residual add, the
    logits divided by logits_scaling."""
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, embed_scale=float(c.get("embedding_multiplier", 1.0)),
                               attn_scale=float(c.get("attention_multiplier", 1.0)),
                               residual_scale=float(c.get("residual_multiplier", 1.0)),
                               logits_scaling=float(c.get("logits_scaling", 1.0)))


def _minicpm(c: dict[str, Any], arch: str) -> ModelConfig:
    """MiniCPM 1 / 2 / 4 (remote code: MiniCPMForCausalLM): Llama's block with muP's three scales, as
    Granite's multipliers: the token embeddings times scale_emb, each branch's output times
    scale_depth / sqrt(num_hidden_layers) before its residual add, the final hidden states divided by
    hidden_size / dim_model_base before the LM head (here the logits: the same product). Its mixture of
    experts (num_experts) and MiniCPM4's InfLLM v2 sparse attention (sparse_config) are refused."""
    if c.get("num_experts"):
        raise ConfigError(f"MiniCPM-MoE (num_experts={c['num_experts']!r}) is not supported")
    if c.get("sparse_config"):
        raise ConfigError("MiniCPM4's sparse attention (config.json sparse_config: InfLLM v2) is not supported; "
                          "the checkpoint without sparse_config serves its dense attention")
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, embed_scale=float(c["scale_emb"]),
                               residual_scale=float(c["scale_depth"]) / math.sqrt(cfg.n_layers),
                               logits_scaling=c["hidden_size"] / float(c["dim_model_base"]))


def _granite_swa(c: dict[str, Any], arch: str) -> ModelConfig:
    """Granite SWA (transformers' GraniteSWA): Granite's multipliers, a learnable sink logit per head
    (sigmoid(lse - sink) times the output: gpt-oss's sinks), a window on the layers layer_types names
    sliding (by default all but every fourth from the first), and a RoPE base per layer
    (layer_rope_theta; 0: no RoPE). jaxinfer runs one base for the full layers and one for the
    sliding ones (the latter unscaled): other per-layer bases are refused by name."""
    cfg = _granite(c, arch)
    n = cfg.n_layers
    sliding = _sliding_kinds(c, n, ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)])
    thetas = c.get("layer_rope_theta") or [cfg.rope_theta] * n
    if len(thetas) != n or not all(_is_number(t) and t >= 0 for t in thetas):
        raise ConfigError(f"field 'layer_rope_theta' must give a RoPE base (0: none) for each of the {n} layers, "
                          f"got {thetas!r}")
    full_bases = {float(t) for t, s in zip(thetas, sliding) if t and not s}
    local_bases = {float(t) for t, s in zip(thetas, sliding) if t and s}
    base = next(iter(full_bases or local_bases), cfg.rope_theta)
    local = next(iter(local_bases), base)
    if len(full_bases) > 1 or len(local_bases) > 1 or (local != base and cfg.rope_scaling is not None):
        raise ConfigError(f"field 'layer_rope_theta' = {thetas!r}: jaxinfer runs one RoPE base for the full "
                          "layers and one unscaled base for the sliding ones")
    return dataclasses.replace(
        cfg, attn_sinks=True, rope_theta=base, rope_local_theta=None if local == base else local,
        rope_layers=None if all(thetas) else tuple(bool(t) for t in thetas),
        **_windows(c.get("sliding_window"), sliding))


def _granitemoe(c: dict[str, Any], arch: str) -> ModelConfig:
    """Granite 3.x MoE (GraniteMoe: 1B-A400M, 3B-A800M) and GraniteMoeShared: Granite's four
    multipliers on a mixture of num_local_experts experts of intermediate_size on every layer, Mixtral's
    routing (top-k of the router logits, softmax over the k); GraniteMoeShared adds a gated MLP of
    shared_intermediate_size (0: none) beside the experts, its output added to theirs."""
    shared = int(c.get("shared_intermediate_size") or 0) if arch == "GraniteMoeSharedForCausalLM" else 0
    return dataclasses.replace(_granite(c, arch), num_experts=_num_experts(c, arch),
                               num_experts_per_tok=c["num_experts_per_tok"], moe_routing="topk_softmax",
                               moe_shared_ffn_dim=shared)


def _granitemoehybrid(c: dict[str, Any], arch: str) -> ModelConfig:
    """Granite 4.0-H (transformers' GraniteMoeHybrid: -Micro dense, -Tiny 7B-A1B, -Small 32B-A9B):
    Mamba-2 layers (layer_types "mamba", or transformers' newer "linear_attention"; models/mamba2.py)
    of mamba_n_heads heads of mamba_d_head ("auto": mamba_expand hidden_size / mamba_n_heads),
    mamba_n_groups groups of mamba_d_state, a convolution of mamba_d_conv taps (biased where
    mamba_conv_bias), the step clamped to time_step_limit, between attention layers ("attention" /
    "full_attention") with RoPE only where position_embedding_type is "rope" (the uploads: none);
    Granite's four multipliers; each layer's MLP GraniteMoeShared's (num_local_experts > 0: experts
    plus the shared MLP of shared_intermediate_size) or that shared MLP alone (0). The class's
    all-attention uploads (Granite 4.0-Micro, -1B, -350M) are Granite (3.x)'s blocks under these names;
    an all-Mamba model (no attention layer, the class's default layer_types) is refused."""
    n = c["num_hidden_layers"]
    remap = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
    types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n
    if not isinstance(types, list) or len(types) != n or set(types) - set(remap):
        raise ConfigError(f"layer_types must name 'mamba' / 'attention' for each of the {n} layers, got {types!r}")
    kinds = tuple(remap[t] for t in types)
    if "attention" not in kinds:
        raise ConfigError("a model whose every layer is Mamba-2 (layer_types absent, or all 'mamba') is not "
                          "supported: jaxinfer's engine needs at least one attention layer")
    experts = c.get("num_local_experts", c.get("num_experts")) or 0
    if experts and not c.get("num_experts_per_tok"):   # (check_hf_fields lets it be 0 for a dense upload)
        raise ConfigError(f"field 'num_experts_per_tok' must be a positive integer with {experts} experts, "
                          f"got {c.get('num_experts_per_tok')!r}")
    base = {**c, "sliding_window": None}
    if experts:
        cfg = dataclasses.replace(_granitemoe(base, "GraniteMoeSharedForCausalLM"), architecture=arch)
    else:
        cfg = _granite({**base, "intermediate_size": c["shared_intermediate_size"]}, arch)
    rope = c.get("position_embedding_type") == "rope"
    cfg = dataclasses.replace(cfg, rope_layers=None if rope else (False,) * n)
    if "mamba" not in kinds:   # Granite 4.0-Micro / -1B / -350M: attention only
        return cfg
    return dataclasses.replace(cfg, layer_kinds=kinds, **_mamba2_fields(c))


def _bamba(c: dict[str, Any], arch: str) -> ModelConfig:
    """Bamba (IBM's Bamba-9B v1 / v2; transformers' Bamba): Granite 4.0-H's dense form without its
    multipliers. Mamba-2 layers everywhere but attn_layer_indices, whose attention rotates the first
    half of each head (BambaConfig's partial_rotary_factor 0.5, unless rope_parameters gives another),
    and on every layer Llama's gated MLP of intermediate_size (feed_forward; mlp_bias). A config
    without attn_layer_indices (the class's default) is all Mamba-2, refused."""
    n = c["num_hidden_layers"]
    idx = c.get("attn_layer_indices") or []
    if not isinstance(idx, list) or not all(_is_int(i) and 0 <= i < n for i in idx):
        raise ConfigError(f"field 'attn_layer_indices' must list layers 0 .. {n - 1}, got {idx!r}")
    if not idx:
        raise ConfigError("a Bamba model without attn_layer_indices is all Mamba-2 layers, which is not supported: "
                          "jaxinfer's engine needs at least one attention layer")
    types = ["attention" if i in idx else "mamba" for i in range(n)]
    hybrid = {**c, "layer_types": types, "num_local_experts": 0, "shared_intermediate_size": c["intermediate_size"],
              "position_embedding_type": "rope"}
    cfg = _granitemoehybrid(hybrid, arch)
    # (BambaConfig sets a top-level partial_rotary_factor to 0.5; one in rope_parameters wins, as
    # transformers' RoPE reads it; Granite's multipliers, which _granite read, are not Bamba's)
    return dataclasses.replace(cfg, attn_scale=None, embed_scale=1.0, residual_scale=1.0, logits_scaling=1.0,
                               rotary_dim=_rotary_dim(c.get("rope_parameters") or {}, {}, cfg.head_dim, 0.5))


# Nemotron-H's layer types (config.json layers_block_type, or the legacy hybrid_override_pattern's letters)
_NEMOTRON_H_KINDS = {"M": "mamba", "mamba": "mamba", "linear_attention": "mamba", "*": "attention",
                     "attention": "attention", "full_attention": "attention", "-": "mlp", "mlp": "mlp",
                     "E": "moe", "moe": "moe"}


def _nemotron_h_blocks(c: dict[str, Any]) -> tuple[list[str], list[str | None]]:
    """Nemotron-H's layers as blocks: each mixer (a Mamba-2 or attention layer) with the MLP or
    mixture-of-experts layer that follows it, where one does; an MLP or MoE layer after another (or
    first) a block of its own, "mlp" -> (each block's kind, its MLP: "mlp", "moe" or None)."""
    types = c.get("layers_block_type") or c.get("layer_types") or list(c.get("hybrid_override_pattern") or "")
    if not isinstance(types, list) or not types or any(t not in _NEMOTRON_H_KINDS for t in types):
        raise ConfigError(f"layers_block_type (or hybrid_override_pattern) must name each layer 'mamba', "
                          f"'attention', 'mlp' or 'moe' (M, *, -, E), got {types!r}")
    kinds = [_NEMOTRON_H_KINDS[t] for t in types]
    mixers, mlps = [], []
    for i, k in enumerate(kinds):
        ffn = k in ("mlp", "moe")
        if ffn and i and kinds[i - 1] not in ("mlp", "moe"):   # the MLP after a mixer: that mixer's block's
            mlps[-1] = k
        else:   # a mixer, or an MLP after another (Nemotron-H-47B's ---): a block of its own
            mixers.append("mlp" if ffn else k)
            mlps.append(k if ffn else None)
    if "mamba" not in mixers or "attention" not in mixers:
        raise ConfigError(f"a Nemotron-H model needs Mamba-2 and attention layers (jaxinfer's engine keeps an "
                          f"attention layer's KV beside the Mamba-2 states), got {types!r}")
    return mixers, mlps


def _nemotron_h_moe(c: dict[str, Any], moe: tuple[bool, ...]) -> dict[str, Any]:
    """Nemotron 3's mixture-of-experts fields: n_routed_experts ungated experts of moe_intermediate_size
    (the MLPs' activation), DeepSeek-V3's sigmoid routing (the correction e_score_correction_bias,
    n_group / topk_group, norm_topk_prob, routed_scaling_factor) and one ungated shared MLP of
    moe_shared_expert_intermediate_size, which NemotronHMoE builds whatever n_shared_experts says. The
    latent projections of Nemotron 3 Super (moe_latent_size) are refused."""
    if c.get("moe_latent_size") is not None:
        raise ConfigError(f"field 'moe_latent_size' = {c['moe_latent_size']!r} is not supported (Nemotron 3 Super's "
                          "latent projections around the experts); Nemotron 3 Nano's mixtures (no latent size) are")
    if c.get("mlp_bias"):   # (NemotronHExperts has no biases whatever mlp_bias says; its shared MLP would)
        raise ConfigError("field 'mlp_bias' = true is not supported with mixture-of-experts layers (no published "
                          "Nemotron 3 model has biased MLPs)")
    # (NemotronHConfig's alias num_local_experts, where a config spells it)
    field = _experts_field(c, "num_local_experts", "n_routed_experts")   # (the class default fills n_routed_experts)
    experts, k = c[field], c["num_experts_per_tok"]
    groups, top_groups = _expert_groups(c, experts, field)
    return dict(num_experts=experts, num_experts_per_tok=k, moe_ffn_dim=c["moe_intermediate_size"],
                moe_layers=None if all(moe) else moe, moe_routing="sigmoid_topk",
                moe_norm_topk=bool(c["norm_topk_prob"]), moe_groups=groups, moe_topk_groups=top_groups,
                moe_routed_scale=float(c["routed_scaling_factor"]),
                moe_shared_ffn_dim=c["moe_shared_expert_intermediate_size"])


def _expert_groups(c: dict[str, Any], experts: int, experts_field: str, pair_scored: bool = True) -> tuple[int, int]:
    """DeepSeek-V3's group-limited choice (n_group / topk_group; null or absent: 1), checked against
    the experts in the config's own field names, where ModelConfig would refuse the same sizes naming
    its internal fields: num_experts_per_tok within the experts, the experts in n_group equal groups
    (of at least two where pair_scored: DeepSeek-V3's group is scored by the sum of its best two, as
    transformers' topk(2) needs; DeepSeek-V2's by its best), topk_group within n_group, and (where
    pair_scored) num_experts_per_tok within the kept groups' experts: transformers' V3 router fills the
    others with -inf and would pick among them by how torch breaks ties, with nonzero weights (V2's
    fills them with 0, so its extra picks weigh nothing). check_hf_fields has checked each a positive
    integer."""
    k, groups, top = c["num_experts_per_tok"], c.get("n_group") or 1, c.get("topk_group") or 1
    for wrong, why in ((k > experts, f"num_experts_per_tok = {k} exceeds {experts_field} = {experts}"),
                       (experts % groups, f"{experts_field} = {experts} is not a multiple of n_group = {groups}"),
                       (pair_scored and groups > 1 and experts // groups < 2, f"n_group = {groups} leaves fewer than two of the "
                        f"{experts_field} = {experts} experts in a group (a group is scored by its best two)"),
                       (top > groups, f"topk_group = {top} exceeds n_group = {groups}"),
                       (pair_scored and groups > 1 and k > top * (experts // groups),
                        f"num_experts_per_tok = {k} exceeds the {top * (experts // groups)} experts of the "
                        f"topk_group = {top} groups kept (of {experts_field} = {experts} in n_group = {groups})")):
        if wrong:
            raise ConfigError(f"field {why}")
    return groups, top


def _experts_field(c: dict[str, Any], *names: str) -> str:
    """The field the experts' count was read from, for a message: the first of `names` the config
    sets, else the first (its class default)."""
    return next((n for n in names if c.get(n)), names[0])


def _nemotron_h(c: dict[str, Any], arch: str) -> ModelConfig:
    """Nemotron-H (NVIDIA's Nemotron-H 8B / 47B / 56B, Nemotron Nano 2 9B / 12B; transformers'
    NemotronH): layers of one part each, a Mamba-2 mixer (M: mamba_num_heads heads of mamba_head_dim,
    n_groups groups of ssm_state_size, conv_kernel taps), attention without positions (*) or an
    ungated MLP of intermediate_size (-, mlp_hidden_act: squared ReLU), each x + part(norm(x)). A
    mixer and the MLP after it are one of jaxinfer's blocks; a mixer without one is a block with no
    MLP (ModelConfig.mlp_layers), an MLP layer after another (47B's runs) one with no mixer ("mlp" in
    layer_kinds). Nemotron 3 Nano's mixture-of-experts layers (E) take an MLP layer's place
    (_nemotron_h_moe). The head is never the embedding (NemotronHForCausalLM ties nothing, whatever
    tie_word_embeddings says); the next-token-prediction layers (mtp.*) are not read."""
    mixers, mlps = _nemotron_h_blocks(c)
    # NVIDIA's remote-code spellings, which NemotronHConfig renames too (they win where both are given)
    legacy = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
              "mamba_dt_limit": "time_step_limit"}
    mamba = _mamba2_fields({**c, **{ours: c[old] for old, ours in legacy.items() if old in c}}, _NEMOTRON_H_MAMBA2)
    # (NVIDIA's remote-code config spells head_dim attention_head_dim; NemotronHConfig's default: 128)
    head_dim = c.get("head_dim") or c.get("attention_head_dim") or 128
    base = {**c, "num_hidden_layers": len(mixers), "hidden_act": c.get("mlp_hidden_act", "relu2"), "head_dim": head_dim,
            "rms_norm_eps": c.get("layer_norm_epsilon", 1e-5), "attention_bias": False, "sliding_window": None,
            "tie_word_embeddings": False}
    cfg = _llama_like(base, arch)
    moe = tuple(m == "moe" for m in mlps)
    return dataclasses.replace(cfg, gated_mlp=False, rope_layers=(False,) * len(mixers), layer_kinds=tuple(mixers),
                               mlp_layers=tuple(m is not None for m in mlps), **mamba,
                               **(_nemotron_h_moe(c, moe) if any(moe) else {}))


# a family's config.json names of the Mamba-2 fields _mamba2_fields reads (expand: Granite's width check)
_GRANITE_MAMBA2 = {"heads": "mamba_n_heads", "head_dim": "mamba_d_head", "groups": "mamba_n_groups",
                   "state": "mamba_d_state", "taps": "mamba_d_conv", "conv_bias": "mamba_conv_bias",
                   "bias": "mamba_proj_bias", "act": "hidden_act", "limit": "time_step_limit", "expand": "mamba_expand"}
_NEMOTRON_H_MAMBA2 = {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "groups": "n_groups",
                      "state": "ssm_state_size", "taps": "conv_kernel", "conv_bias": "use_conv_bias", "bias": "use_bias",
                      "act": "mamba_hidden_act", "limit": "time_step_limit"}


def _mamba2_fields(c: dict[str, Any], names: dict[str, str] = _GRANITE_MAMBA2) -> dict[str, Any]:
    """A family's Mamba-2 sizes, convolution bias and step limit (their config.json `names`, each
    named in its refusal) as ModelConfig's fields. With an "expand" name (Granite 4.0-H, Bamba):
    heads x head dim = expand x hidden_size, the head dim "auto" derived from it; without (Nemotron-H),
    heads x head dim is a width of its own."""
    heads = c[names["heads"]]
    sizes = {names[k]: c.get(names[k], "auto") if k == "head_dim" else c[names[k]]
             for k in ("heads", "head_dim", "groups", "state", "taps")}
    expand = names.get("expand")
    if expand:
        times = c[expand]
        if sizes[names["head_dim"]] == "auto" and _is_int(heads) and heads > 0 and _is_int(times):
            sizes[names["head_dim"]] = times * c["hidden_size"] // heads
        sizes[expand] = times
    head_dim, groups = sizes[names["head_dim"]], sizes[names["groups"]]
    if (not all(_is_int(v) and v > 0 for v in sizes.values()) or heads % groups
            or (expand and heads * head_dim != sizes[expand] * c["hidden_size"])):
        width = f" and {names['heads']} * {names['head_dim']} = {expand} * hidden_size" if expand else ""
        raise ConfigError(f"the Mamba-2 layers' sizes must be positive integers, {names['heads']} a multiple of "
                          f"{names['groups']}{width}: {sizes}")
    if c.get(names["bias"]):
        raise ConfigError(f"{names['bias']}=true is not supported (biased Mamba-2 projections: no published model "
                          "of this family has them)")
    if c.get(names["act"], "silu") not in ("silu", "swish"):   # (the Mamba-2 convolution applies it too)
        raise ConfigError(f"{names['act']}={c.get(names['act'])!r} is not supported for this family (every published "
                          "model uses silu, which jaxinfer's Mamba-2 layer applies after its convolution)")
    limit = c.get(names["limit"]) or (0.0, math.inf)
    if isinstance(limit, (list, tuple)):   # transformers >= 5 saves an infinity as {"__float__": "Infinity"}
        limit = [float(v["__float__"]) if isinstance(v, dict) and isinstance(v.get("__float__"), str) else v
                 for v in limit]
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)  # noqa: E731
    if not (isinstance(limit, (list, tuple)) and len(limit) == 2 and all(map(real, limit)) and 0 <= limit[0] <= limit[1]):
        raise ConfigError(f"field 'time_step_limit' must be [low, high] with 0 <= low <= high, got {limit!r}")
    return dict(conv_kernel=sizes[names["taps"]], conv_bias=bool(c.get(names["conv_bias"], True)),
                linear_k_heads=groups, linear_v_heads=heads, linear_k_dim=sizes[names["state"]], linear_v_dim=head_dim,
                ssm_dt_limit=None if tuple(limit) == (0.0, math.inf) else (float(limit[0]), float(limit[1])))


def _olmo1(c: dict[str, Any], arch: str) -> ModelConfig:
    """OLMo 1 (transformers' Olmo: OLMo-1B-hf, OLMo-7B-0424-hf): Llama's block with LayerNorms that have
    no weight or bias (eps 1e-5), q / k / v clamped to clip_qkv where set, biases where attention_bias."""
    return dataclasses.replace(_llama_like({**c, "sliding_window": None}, arch), norm="layernorm_noparam",
                               norm_eps=1e-5, clip_qkv=None if c.get("clip_qkv") is None else float(c["clip_qkv"]))


def _olmoe(c: dict[str, Any], arch: str) -> ModelConfig:
    """OLMoE (transformers' Olmoe): Llama's pre-norm block with q / k RMSNorms over the whole projection
    (OLMo 2's, Llama's norm), and on every layer a mixture of num_experts experts of intermediate_size,
    Qwen3-MoE's routing (softmax over all experts, top-k, renormalized only when norm_topk_prob).
    clip_qkv (q, k, v clamped) is refused."""
    if c.get("clip_qkv") is not None:
        raise ConfigError(f"OLMoE with clip_qkv={c['clip_qkv']!r} (q, k and v clamped) is not supported")
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    return dataclasses.replace(cfg, qk_norm=True, qk_norm_full=True, num_experts=_num_experts(c, arch),
                               num_experts_per_tok=c["num_experts_per_tok"], moe_routing="softmax_topk",
                               moe_norm_topk=bool(c.get("norm_topk_prob", False)))


def _minimax_m2(c: dict[str, Any], arch: str) -> ModelConfig:
    """MiniMax-M2 / M2.1 (transformers' MiniMaxM2): Llama's block with q / k RMSNorms over the whole
    projection (before RoPE), the first rotary_dim features of each head rotated (the published
    configs' legacy rotary_dim, or partial_rotary_factor), and on every layer Mixtral's experts chosen
    by sigmoid scores plus a learned correction (e_score_correction_bias), weighted by the sigmoid
    scores renormalized over the chosen. No shared experts (shared_intermediate_size refused)."""
    if c.get("shared_intermediate_size"):
        raise ConfigError(f"MiniMax-M2 with shared_intermediate_size={c['shared_intermediate_size']!r} (shared "
                          "experts) is not supported")
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"MiniMax-M2 with scoring_func={c['scoring_func']!r} is not supported (sigmoid)")
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    params = _rope_params(c)
    if c.get("rotary_dim") is not None and "partial_rotary_factor" not in params and "partial_rotary_factor" not in c:
        params = {**params, "partial_rotary_factor": c["rotary_dim"] / cfg.head_dim}
    return dataclasses.replace(
        cfg, rotary_dim=_rotary_dim(params, c, cfg.head_dim, 1.0), qk_norm=True, qk_norm_full=True,
        num_experts=_num_experts(c, arch), num_experts_per_tok=c["num_experts_per_tok"], moe_routing="sigmoid_topk",
        moe_norm_topk=True)


def _olmo(c: dict[str, Any], arch: str) -> ModelConfig:
    """OLMo 2 and OLMo 3: Llama's projections and MLP with the norms after each branch only
    (post_attention_layernorm, post_feedforward_layernorm; no input norm), q / k norms over the whole
    projection, the weight times the float32 value (Olmo2RMSNorm). OLMo 3 adds sliding layers
    (layer_types; by default three of every four, window 4096) whose RoPE is the plain rotation at
    their own base (rope_parameters["sliding_attention"]), the full layers' possibly scaled."""
    cfg = _llama_like({**c, "sliding_window": None, "rms_norm_eps": c.get("rms_norm_eps", 1e-5)}, arch)
    cfg = dataclasses.replace(cfg, norm="olmo_rmsnorm", pre_norms=False, post_norms=True, qk_norm=True,
                              qk_norm_full=True)
    if arch != "Olmo3ForCausalLM":
        return cfg
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    # one dict (or legacy rope_theta + rope_scaling): the scaling is the full layers' (Olmo3Config), the
    # sliding layers rotate plainly at the same base (vLLM, transformers 4.57)
    base = _rope(_rope_params(c), c, default_theta=500000.0)[0]
    theta, scaling, local_theta = _layer_type_rope(c, "OLMo 3", {"rope_theta": base}, 500000.0, 500000.0)
    return dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                               sliding_window=c.get("sliding_window", 4096),
                               sliding_layers=tuple(t == "sliding_attention" for t in types))


def _exaone4(c: dict[str, Any], arch: str) -> ModelConfig:
    """EXAONE 4.0: OLMo 2's block order (norms after each branch only) with per-head q / k norms; with a
    window, the sliding layers rotate and the global ones do not (NoPE), without one every layer
    rotates (transformers' Exaone4Attention). The layers' kinds: layer_types, else
    sliding_window_pattern, a period (every p-th layer global; default 4) or a string such as "LLLG"
    (repeated; the last layer global whatever it says: Exaone4Config's docstring)."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    types = c.get("layer_types")
    if types is None and window is not None:
        pattern = c.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:   # the last layer always global
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" and i < n - 1 else "full_attention"
                     for i in range(n)]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            raise ConfigError(f"sliding_window_pattern must be a positive period or a string of L and G, got {pattern!r}")
    cfg = _llama_like({**c, "sliding_window": None, "rms_norm_eps": c.get("rms_norm_eps", 1e-5)}, arch)
    cfg = dataclasses.replace(cfg, pre_norms=False, post_norms=True, qk_norm=True)
    if window is None:
        return cfg
    sliding = tuple(t == "sliding_attention" for t in types)
    return dataclasses.replace(cfg, sliding_window=window, sliding_layers=sliding, rope_layers=sliding)


def _exaone_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """K-EXAONE (transformers' ExaoneMoe): EXAONE 4.0's attention (per-head q / k norms, sliding layers
    with RoPE, global ones without) in a pre-norm block (OLMoE's), and DeepSeek-V3's mixture
    (num_experts, num_shared_experts) on the layers mlp_layer_types names sparse (by default all but
    the first first_k_dense_replace)."""
    n = c["num_hidden_layers"]
    layers = _sparse_kinds(c, n, ["dense" if i < c["first_k_dense_replace"] else "sparse" for i in range(n)])
    moe_f, experts = c["moe_intermediate_size"], _num_experts(c, arch)
    groups, top_groups = _expert_groups(c, experts, _experts_field(c, "num_experts", "num_local_experts"))
    return dataclasses.replace(
        _exaone4(c, arch), pre_norms=True, post_norms=False, num_experts=experts,
        num_experts_per_tok=c["num_experts_per_tok"], moe_ffn_dim=moe_f, moe_layers=layers,
        moe_routing="sigmoid_topk", moe_norm_topk=bool(c["norm_topk_prob"]), moe_groups=groups,
        moe_topk_groups=top_groups, moe_routed_scale=float(c["routed_scaling_factor"]),
        moe_shared_ffn_dim=moe_f * c["num_shared_experts"])


def _seed_oss(c: dict[str, Any], arch: str) -> ModelConfig:
    """Seed-OSS: Llama's block with biases on q / k / v (attention_bias, default true) and, apart, on
    o (attention_out_bias) and the MLP (mlp_bias); transformers' SeedOssConfig."""
    cfg = _llama_like({**c, "sliding_window": None, "attention_bias": False}, arch)
    return dataclasses.replace(cfg, qkv_bias=bool(c.get("attention_bias", True)),
                               out_bias=bool(c.get("attention_out_bias", False)))


def _glm(c: dict[str, Any], arch: str) -> ModelConfig:
    """GLM-4 (GlmForCausalLM: GLM-4-9B-chat-hf) and GLM-4-0414 / GLM-Z1 (Glm4ForCausalLM): Llama's
    block with gate and up fused in gate_up_proj, q/k/v biases (attention_bias, default true) and
    partial rotary (partial_rotary_factor, default 0.5) whose rotated features come in pairs (x0, x1),
    (x2, x3), ... (transformers' GLM rotate_half; hf_maps de-interleaves q and k). Glm4 adds a norm
    of each branch's output before its residual add (post_self_attn_layernorm, post_mlp_layernorm)."""
    cfg = _llama_like({**c, "sliding_window": None, "attention_bias": c.get("attention_bias", True)}, arch)
    return dataclasses.replace(cfg, rotary_dim=_rotary_dim(_rope_params(c), c, cfg.head_dim, 0.5), out_bias=False,
                               mlp_bias=False, post_norms=arch == "Glm4ForCausalLM")


def _cohere(c: dict[str, Any], arch: str) -> ModelConfig:
    """Command R / R7B / A, Aya (transformers' Cohere and Cohere2): one LayerNorm without bias per
    block feeding attention and MLP side by side (x + attn + mlp), RoPE over whole heads with the
    features in pairs (de-interleaved by hf_maps), biases on q / k / v / o where attention_bias, the
    logits times logit_scale, tied embeddings. Cohere2: sliding layers (layer_types, else every
    sliding_window_pattern-th layer global) that rotate, global ones that do not. use_qk_norm
    (Command R+): bias-free LayerNorms of each q and k head, with weights per head."""
    if arch == "Cohere2ForCausalLM":   # Cohere2Config sets head_dim = hidden_size // heads whatever the file says
        c = {**c, "head_dim": None}
    cfg = _llama_like({**c, "sliding_window": None, "rms_norm_eps": c.get("layer_norm_eps", 1e-5)}, arch)
    scale = c.get("logit_scale", 0.0625)
    if not _is_number(scale) or scale <= 0:
        raise ConfigError(f"logit_scale must be a positive number, got {scale!r}")
    heads_norm = arch == "CohereForCausalLM" and bool(c.get("use_qk_norm", False))   # not in Cohere2
    cfg = dataclasses.replace(cfg, norm="layernorm_nobias", parallel_block=True, logits_scaling=1.0 / float(scale),
                              tie_embeddings=bool(c.get("tie_word_embeddings", True)), qk_norm=heads_norm,
                              qk_norm_heads=heads_norm)
    if arch != "Cohere2ForCausalLM":
        return cfg
    n, window = c["num_hidden_layers"], c.get("sliding_window", 4096)
    types = c.get("layer_types")
    if not types:   # Cohere2Config: every sliding_window_pattern-th layer global
        period = c.get("sliding_window_pattern", 4)
        if not (_is_int(period) and period > 0):
            raise ConfigError(f"sliding_window_pattern must be a positive integer, got {period!r}")
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    # transformers' Cohere2Attention rotates where the layer has a window: with none, no layer does
    sliding = tuple(t == "sliding_attention" and window is not None for t in types)
    return dataclasses.replace(cfg, sliding_window=window if any(sliding) else None,
                               sliding_layers=sliding if any(sliding) else None, rope_layers=sliding)


def _ernie4_5(c: dict[str, Any], arch: str) -> ModelConfig:
    """ERNIE 4.5 dense (transformers' Ernie4_5): Llama's block with RoPE over whole heads in pairs
    (GLM's layout; de-interleaved by hf_maps), biases on every projection where use_bias, tied
    embeddings by default."""
    bias = bool(c.get("use_bias", False))
    cfg = _llama_like({**c, "sliding_window": None, "attention_bias": bias, "mlp_bias": bias,
                       "rms_norm_eps": c.get("rms_norm_eps", 1e-5)}, arch)
    return dataclasses.replace(cfg, tie_embeddings=bool(c.get("tie_word_embeddings", True)))


def _ernie4_5_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """ERNIE 4.5 MoE (transformers' Ernie4_5_Moe: ERNIE-4.5-21B-A3B, 300B-A47B): the dense block of
    _ernie4_5 with mixtures on the layers i with (i + 1) % moe_layer_interval == 0 and
    moe_layer_start_index <= i <= moe_layer_end_index (-1: the last layer), dense MLPs of
    intermediate_size on the others; moe_num_experts experts of moe_intermediate_size, moe_k per
    token by softmax_corrected_topk (the correction: moe_statics), moe_num_shared_experts ungated
    shared experts of moe_intermediate_size each (one MLP of their total width)."""
    n = c["num_hidden_layers"]
    e, k = c.get("moe_num_experts", c.get("num_experts", 64)), c.get("moe_k", c.get("num_experts_per_tok", 6))
    start, end = c.get("moe_layer_start_index", 1), c.get("moe_layer_end_index", -1)
    every = c.get("moe_layer_interval", 1)
    for field, v in (("moe_num_experts", e), ("moe_k", k), ("moe_layer_interval", every),
                     ("moe_intermediate_size", c.get("moe_intermediate_size", 1536))):
        if not (_is_int(v) and v > 0):
            raise ConfigError(f"field {field!r} must be a positive integer, got {v!r}")
    if not (_is_int(start) and _is_int(end) and start >= 0):
        raise ConfigError(f"moe_layer_start_index / moe_layer_end_index must be integers, got {start!r} / {end!r}")
    end = n - 1 if end == -1 else end
    if c.get("use_bias"):   # transformers: biases on attention, dense and shared MLPs, none on the routed experts
        raise ConfigError("use_bias = true on ERNIE 4.5 MoE (biased dense and shared MLPs beside unbiased experts) "
                          "is not supported")
    norm_min = c.get("moe_norm_min", 1e-12)
    if norm_min != 1e-12:
        raise ConfigError(f"moe_norm_min = {norm_min!r} is not supported (1e-12, transformers' default)")
    layers = tuple((i + 1) % every == 0 and start <= i <= end for i in range(n))
    if not any(layers):
        raise ConfigError(f"moe_layer_start_index {start} / moe_layer_end_index {end} / moe_layer_interval {every} "
                          f"leave no mixture-of-experts layer of {n}")
    cfg = _ernie4_5(c, arch)
    return dataclasses.replace(
        cfg, num_experts=e, num_experts_per_tok=k, moe_ffn_dim=c.get("moe_intermediate_size", 1536),
        moe_layers=None if all(layers) else layers, moe_routing="softmax_corrected_topk", moe_norm_topk=True,
        moe_shared_ffn_dim=c.get("moe_intermediate_size", 1536) * int(c.get("moe_num_shared_experts") or 0))


def _starcoder2(c: dict[str, Any], arch: str) -> ModelConfig:
    """StarCoder2 (transformers' Starcoder2): LayerNorms with biases (norm_epsilon), GQA with RoPE, a
    window on every layer when sliding_window is set, an ungated MLP (c_fc, act, c_proj), biases on
    every projection where use_bias (default true), tied embeddings by default."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    theta, scaling = _rope(_rope_params(c), c)
    bias = bool(c.get("use_bias", True))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=c.get("head_dim") or d // h,
        ffn_dim=c["intermediate_size"], activation=_activation(c, "hidden_act", default="gelu_pytorch_tanh"),
        gated_mlp=False, norm="layernorm", norm_eps=float(c.get("norm_epsilon", 1e-5)), position="rope",
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 4096),
        sliding_window=c.get("sliding_window"), qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """Mixtral and Qwen3-MoE: the Llama-like block with a mixture of experts for its MLP. Mixtral:
    every layer, experts of intermediate_size, top-k of the router logits then softmax over the k
    (HF writes it as softmax, top-k, renormalize: the same numbers). Qwen3-MoE: softmax over all
    experts, top-k, renormalized only when norm_topk_prob; experts of moe_intermediate_size on the
    layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers, dense MLPs of intermediate_size
    on the others."""
    n = c["num_hidden_layers"]
    moe = dict(num_experts=_num_experts(c, arch), num_experts_per_tok=c["num_experts_per_tok"],
               moe_routing="topk_softmax")
    if arch == "Qwen3MoeForCausalLM":
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        moe.update(moe_ffn_dim=c["moe_intermediate_size"], moe_routing="softmax_topk",
                   moe_norm_topk=bool(c.get("norm_topk_prob", False)),
                   moe_layers=None if all(layers) else layers)
    return dataclasses.replace(_llama_like(c, arch), **moe)


def _phimoe(c: dict[str, Any], arch: str) -> ModelConfig:
    """Phi-3.5-MoE (transformers' Phimoe): Mixtral's block on LayerNorms (eps rms_norm_eps), biases on
    q / k / v / o where attention_bias and on the LM head where lm_head_bias, experts chosen by
    sparsemixer (top-2, router_jitter_noise), LongRoPE with the cos / sin magnitude its parameters name
    (long_mscale with the long factors, short_mscale with the short ones). Which factors: Phi-3's
    static choice (_longrope; Microsoft's modeling code and vLLM take the long ones past the original
    length, transformers 5's Phimoe class the short ones at every length)."""
    if c["num_experts_per_tok"] != 2:
        raise ConfigError(f"field 'num_experts_per_tok' = {c['num_experts_per_tok']!r}: PhiMoE's sparsemixer "
                          "picks two experts per token")
    cfg = _moe(c, arch)
    scaling, params = cfg.rope_scaling, _rope_params(c)
    if scaling is not None and scaling.kind == "longrope":
        mscale = params.get("long_mscale" if scaling.use_long_factor else "short_mscale")
        scaling = scaling if mscale is None else dataclasses.replace(scaling, attention_factor=float(mscale))
    bias = bool(c.get("attention_bias", False))
    return dataclasses.replace(cfg, norm="layernorm", qkv_bias=bias, out_bias=bias, rope_scaling=scaling,
                               lm_head_bias=bool(c.get("lm_head_bias", False)), moe_routing="sparsemixer",
                               moe_router_jitter=float(c["router_jitter_noise"]))


def _qwen2_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen1.5-MoE / Qwen2-MoE: Qwen3-MoE's routing (softmax over all experts, top-k, renormalized only
    when norm_topk_prob) and layer pattern (decoder_sparse_step, mlp_only_layers) on Qwen2's attention
    (q/k/v biases: qkv_bias), plus a shared expert of shared_expert_intermediate_size whose output is
    scaled by sigmoid(shared_expert_gate(x)). A window only when use_sliding_window, on the layers
    layer_types names (transformers' default: the odd-numbered ones below max_window_layers)."""
    n = c["num_hidden_layers"]
    cfg = _moe({**c, "use_sliding_window": False, "num_experts": _num_experts(c, arch)}, "Qwen3MoeForCausalLM")
    window, sliding = None, None
    if c.get("use_sliding_window", False):
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < c.get("max_window_layers", 28)
                                         else "full_attention" for i in range(n)]
        window, sliding = c.get("sliding_window", 4096), tuple(t == "sliding_attention" for t in types)
    return dataclasses.replace(cfg, qkv_bias=bool(c.get("qkv_bias", True)), qk_norm=False, sliding_window=window,
                               sliding_layers=sliding, moe_shared_ffn_dim=c["shared_expert_intermediate_size"],
                               moe_shared_gate=True, architecture=arch)


def _glm4_moe(c: dict[str, Any], arch: str) -> ModelConfig:
    """GLM-4.5 / 4.6 (transformers' Glm4Moe): Llama's block with partial rotary (partial_rotary_factor,
    default 0.5: the first half of each head rotated, rotate_half style), q/k/v biases where
    attention_bias, per-head q/k norms where use_qk_norm; dense MLPs of intermediate_size on the
    first first_k_dense_replace layers, mixtures on the others: sigmoid routing with a learned
    correction and group-limited choice (n_group, topk_group), weights renormalized (norm_topk_prob)
    and times routed_scaling_factor, and n_shared_experts shared experts of moe_intermediate_size
    each (one MLP of their total width). The checkpoint's next-token-prediction layers (past
    num_hidden_layers) are not read."""
    n, e = c["num_hidden_layers"], c.get("n_routed_experts") or _num_experts(c, arch)
    if not (_is_int(e) and e > 0):
        raise ConfigError(f"field 'n_routed_experts' must be a positive integer, got {e!r}")
    first_dense = c["first_k_dense_replace"]
    groups, top_groups = _expert_groups(c, e, _experts_field(c, "n_routed_experts", "num_experts", "num_local_experts"))
    cfg = _llama_like({**c, "sliding_window": None}, arch)
    layers = tuple(i >= first_dense for i in range(n))
    return dataclasses.replace(
        cfg, rotary_dim=_rotary_dim(_rope_params(c), c, cfg.head_dim, 0.5), qk_norm=bool(c.get("use_qk_norm", False)),
        qkv_bias=bool(c.get("attention_bias", False)), out_bias=False,
        num_experts=e, num_experts_per_tok=c["num_experts_per_tok"], moe_ffn_dim=c["moe_intermediate_size"],
        moe_layers=None if all(layers) else layers, moe_routing="sigmoid_topk",
        moe_norm_topk=bool(c["norm_topk_prob"]), moe_groups=groups, moe_topk_groups=top_groups,
        moe_routed_scale=float(c["routed_scaling_factor"]),
        moe_shared_ffn_dim=c["moe_intermediate_size"] * c["n_shared_experts"])


def _dots1(c: dict[str, Any], arch: str) -> ModelConfig:
    """dots.llm1 (transformers' Dots1): Qwen3's attention (per-head q / k norms, biases on q / k / v / o
    where attention_bias, a window on the layers layer_types names sliding: by default those from
    max_window_layers on) and DeepSeek-V3's mixture (_glm4_moe's routing, shared experts, the first
    first_k_dense_replace layers dense)."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if not c.get("n_routed_experts") or not c.get("num_experts_per_tok"):
        raise ConfigError("dots.llm1 needs n_routed_experts and num_experts_per_tok (Dots1Config has no default)")
    sliding = _sliding_kinds(c, n, ["sliding_attention" if window is not None and i >= c["max_window_layers"]
                                    else "full_attention" for i in range(n)])
    bias = bool(c.get("attention_bias", False))
    _whole_heads_rotated(c, "dots.llm1")
    cfg = _glm4_moe({**c, "partial_rotary_factor": 1.0, "use_qk_norm": True}, arch)
    return dataclasses.replace(cfg, out_bias=bias, **_windows(window, sliding))


def _afmoe(c: dict[str, Any], arch: str) -> ModelConfig:
    """Arcee Trinity (transformers' Afmoe): OLMo 2's RMSNorm before and after attention and MLP,
    per-head q / k norms, a sigmoid gate (gate_proj) on the heads' outputs, RoPE and the window on the
    sliding layers only (layer_types; by default every global_attn_every_n_layers-th is global), the
    embeddings times sqrt(hidden_size) where mup_enabled; the first num_dense_layers MLPs dense, then
    DeepSeek-V3's mixture without groups (sigmoid scores, choice by score + expert_bias, the chosen
    renormalized and times route_scale; num_shared_experts shared experts of moe_intermediate_size)."""
    n, window, every = c["num_hidden_layers"], c.get("sliding_window"), c["global_attn_every_n_layers"]
    sliding = _sliding_kinds(c, n, ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)])
    cfg = _glm4_moe({**c, "first_k_dense_replace": c["num_dense_layers"], "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": c["route_scale"],
                     "n_shared_experts": c["num_shared_experts"], "use_qk_norm": True, "partial_rotary_factor": 1.0},
                    arch)
    return dataclasses.replace(   # its router's logits in the model dtype, as AfmoeTokenChoiceRouter's
        cfg, norm="olmo_rmsnorm", post_norms=True, attn_out_gate=True, out_bias=cfg.qkv_bias, rope_layers=sliding,
        moe_router_in_dtype=True,
        embed_scale=math.sqrt(cfg.d_model) if c.get("mup_enabled") else 1.0, **_windows(window, sliding))


def _solar_open(c: dict[str, Any], arch: str) -> ModelConfig:
    """Solar Open (transformers' SolarOpen): Llama's attention (biases on q / k / v only, where
    attention_bias; whole heads rotated unless rope_parameters says otherwise) and GLM-4.5's mixture
    on every layer."""
    _whole_heads_rotated(c, "Solar Open")
    return _glm4_moe({**c, "first_k_dense_replace": 0, "use_qk_norm": False, "partial_rotary_factor": 1.0,
                      "intermediate_size": c["moe_intermediate_size"]}, arch)


def _whole_heads_rotated(c: dict[str, Any], family: str) -> None:
    """Refuses a partial_rotary_factor other than 1 for a family whose transformers class rotates
    whole heads only (its apply_rotary_pos_emb has no pass-through part)."""
    for where in (c, _rope_params(c)):
        if where.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{family} with partial_rotary_factor={where['partial_rotary_factor']!r} is not "
                              "supported: transformers rotates its whole heads")


def _deepseek_v3(c: dict[str, Any], arch: str) -> ModelConfig:
    """DeepSeek-V3 / R1, Kimi K2, Moonlight (transformers' DeepseekV3): latent attention (kv_lora_rank,
    q_lora_rank or a plain q_proj, qk_nope_head_dim + qk_rope_head_dim per query head, v_head_dim;
    RoPE features interleaved in pairs where rope_interleave; the softmax scale 1/sqrt(qk) times
    YaRN's mscale(factor, mscale_all_dim)^2), and GLM-4.5's mixture (_glm4_moe: sigmoid routing with a
    correction, n_group / topk_group, routed_scaling_factor, n_shared_experts, dense first
    first_k_dense_replace layers). The checkpoint's next-token-prediction layers are not read."""
    h, r = c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    for k, val in (("kv_lora_rank", r), ("qk_nope_head_dim", nope), ("qk_rope_head_dim", rope), ("v_head_dim", v)):
        if not (_is_int(val) and val > 0):
            raise ConfigError(f"field {k!r} must be a positive integer, got {val!r}")
    qr = c.get("q_lora_rank") or 0
    params = _rope_params(c)
    scale = (nope + rope) ** -0.5
    if params.get("rope_type", params.get("type", "default")) not in (None, "default") and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    moe = _glm4_moe({**c, "head_dim": r + rope, "num_key_value_heads": 1, "partial_rotary_factor": 1.0,
                     "use_qk_norm": False, "attention_bias": False}, arch)
    return dataclasses.replace(
        moe, n_kv_heads=1, head_dim=r + rope, rotary_dim=rope, attn_scale=scale, qkv_bias=False,
        out_bias=bool(c.get("attention_bias", False)), qk_norm=False, mla_kv_rank=r, mla_q_rank=qr,
        mla_nope_dim=nope, mla_rope_dim=rope, mla_v_dim=v, mla_rope_interleave=bool(c.get("rope_interleave", True)))


def _glm4_moe_lite(c: dict[str, Any], arch: str) -> ModelConfig:
    """GLM-4.7-Flash (transformers' Glm4MoeLite): DeepSeek-V3's latent attention and mixture, its dense
    and mixture layers named by mlp_layer_types (default: the first dense, the rest mixtures)."""
    n = c["num_hidden_layers"]
    if c.get("head_dim") is not None and c["head_dim"] != c["qk_rope_head_dim"]:
        raise ConfigError(f"field 'head_dim' = {c['head_dim']!r} differs from qk_rope_head_dim = "
                          f"{c['qk_rope_head_dim']!r}, which Glm4MoeLiteConfig makes it an alias of")
    layers = _sparse_kinds(c, n, ["dense"] + ["sparse"] * (n - 1))
    return dataclasses.replace(_deepseek_v3({**c, "first_k_dense_replace": 0}, arch), moe_layers=layers)


def _deepseek_v2(c: dict[str, Any], arch: str) -> ModelConfig:
    """DeepSeek-V2 / V2.5 / V2-Lite, DeepSeek-Coder-V2 (transformers' DeepseekV2): DeepSeek-V3's latent
    attention (its RoPE features always interleaved in pairs) and shared experts, routed by softmax
    over all experts: topk_method greedy, or group_limited_greedy (the topk_group best of n_group
    groups, a group scored by its best expert), the chosen probabilities times routed_scaling_factor
    and never renormalized (transformers' router; DeepSeek's own code renormalizes where
    norm_topk_prob and then skips the scale: a config with norm_topk_prob true is refused, as one
    whose moe_layer_freq is not 1 or whose scoring_func is not softmax)."""
    method = c.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"field 'topk_method' = {method!r} is not supported (greedy, group_limited_greedy)")
    if c.get("norm_topk_prob"):
        raise ConfigError("field 'norm_topk_prob' = true is not supported for DeepSeek-V2 (transformers never "
                          "renormalizes its routing weights; DeepSeek's code does and then drops the scale)")
    if c.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(f"field 'scoring_func' = {c['scoring_func']!r} is not supported for DeepSeek-V2 (softmax)")
    if c.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"field 'moe_layer_freq' = {c['moe_layer_freq']!r} is not supported (1: every layer from "
                          "first_k_dense_replace on is a mixture)")
    cfg = _deepseek_v3({**c, "rope_interleave": True, "norm_topk_prob": False, "n_group": 1, "topk_group": 1}, arch)
    groups = (1, 1)   # (greedy ignores n_group / topk_group)
    if method == "group_limited_greedy":
        groups = _expert_groups(c, cfg.num_experts, "n_routed_experts", pair_scored=False)
    return dataclasses.replace(cfg, moe_routing="softmax_group_topk", moe_groups=groups[0], moe_topk_groups=groups[1])


def _num_experts(c: dict[str, Any], arch: str) -> int:
    """num_experts or num_local_experts (transformers >= 5 saves the latter for every MoE family: an
    attribute_map alias), else the class default."""
    n = c.get("num_experts") or c.get("num_local_experts") or _DEFAULT_EXPERTS[arch]
    if not (_is_int(n) and n > 0):
        raise ConfigError(f"field 'num_experts' must be a positive integer, got {n!r}")
    return n


def quantization_config(raw: dict[str, Any]) -> Any | None:
    """config.json's quantization settings where the producers put them: `quantization_config`, a
    multimodal model's `text_config.quantization_config`, or `compression_config` (older
    compressed-tensors checkpoints), in the order compressed_tensors' get_quantization_config and
    vLLM read them; None without any."""
    text = raw.get("text_config")
    for qc in (raw.get("quantization_config"), text.get("quantization_config") if isinstance(text, dict) else None,
               raw.get("compression_config")):
        if qc is not None:
            return qc
    return None


def _gpt_oss(c: dict[str, Any], arch: str) -> ModelConfig:
    """gpt-oss: attention with biases, one learned sink logit per head and sliding / global layers
    (layer_types; alternating by default), YaRN RoPE, and on every layer experts with biases, routed
    by top-k of the biased router logits then softmax over the k, each a clamped SwiGLU (swiglu_limit,
    swiglu_alpha; the checkpoint interleaves gate and up columns, hf_maps de-interleaves them)."""
    qc = quantization_config(c)
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in (None, "mxfp4"):   # mxfp4 experts: jaxinfer/prequant/mxfp4.py
        raise ConfigError(f"{arch} checkpoints quantized with {method!r} (config.json quantization_config) are not "
                          "supported: load a bfloat16 copy (e.g. transformers with Mxfp4Config(dequantize=True), "
                          "then save_pretrained) and quantize with jaxinfer instead")
    d, h, n = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    theta, scaling = _rope(_rope_params(c) or dict(_GPT_OSS_ROPE), c)
    bias = bool(c.get("attention_bias", True))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=n, n_heads=h, n_kv_heads=c.get("num_key_value_heads") or h,
        head_dim=c.get("head_dim") or d // h, ffn_dim=c["intermediate_size"], activation="silu", gated_mlp=True,
        norm="rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-5)), position="rope", rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=c["max_position_embeddings"],
        sliding_window=c.get("sliding_window"), sliding_layers=tuple(t == "sliding_attention" for t in types),
        qkv_bias=bias, out_bias=bias, mlp_bias=True, attn_sinks=True,
        num_experts=_num_experts(c, arch), num_experts_per_tok=c["num_experts_per_tok"],
        moe_routing="topk_softmax", router_bias=True, swiglu_limit=float(c["swiglu_limit"]),
        swiglu_alpha=float(c["swiglu_alpha"]), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


# Gemma 2's layer pattern, one RoPE and soft-capped attention: Gemma 2, and VaultGemma (Gemma 2 without
# the norms after attention and MLP)
_GEMMA2_LIKE = ("Gemma2ForCausalLM", "VaultGemmaForCausalLM")


def _gemma_rope(c: dict[str, Any], arch: str) -> tuple[float, RopeScaling | None, float | None]:
    """(global theta, global scaling, local theta or None). Gemma 3's sliding layers have their own
    base (rope_local_base_freq; rope_parameters["sliding_attention"] in transformers >= 5)."""
    if arch in _GEMMA2_LIKE:
        return (*_rope(_rope_params(c), c), None)
    # legacy: rope_theta + rope_scaling for the global layers, rope_local_base_freq for the rest
    return _layer_type_rope(c, "Gemma 3", {"rope_theta": c.get("rope_local_base_freq", 10000.0)},
                            1_000_000.0, 10000.0)


def _layer_type_rope(c: dict[str, Any], family: str, legacy_local: dict[str, Any], full_theta: float,
                     local_theta: float) -> tuple[float, RopeScaling | None, float]:
    """(full layers' theta, their scaling, sliding layers' theta) of a family whose sliding layers
    rotate plainly at a base of their own: rope_parameters["full_attention" / "sliding_attention"]
    (transformers >= 5), or one dict (legacy rope_theta + rope_scaling) for the full layers and
    `legacy_local` for the sliding ones; full_theta / local_theta: the defaults of their bases."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = _rope_params(c), legacy_local
    theta, scaling = _rope(full, c, default_theta=full_theta)
    local_base, local_scaling = _rope(local, {}, default_theta=local_theta)
    if local_scaling is not None:
        raise ConfigError(f"{family} sliding layers with RoPE scaling ({local_scaling.kind}) are not supported; "
                          "only their base may differ from the full layers'")
    return theta, scaling, local_base


def _gemma(c: dict[str, Any], arch: str) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text): GeGLU, embeddings times sqrt(d_model), RMSNorm with (1 + w) before
    and after attention and MLP, sliding and global layers (layer_types), query_pre_attn_scalar;
    Gemma 2 soft-caps attention scores, both may soft-cap the logits; Gemma 3 adds q/k norms and a
    RoPE base of its own for the sliding layers; VaultGemma: Gemma 2 without the norms after attention
    and MLP. Gemma (1), CodeGemma: _gemma1."""
    if c.get("use_bidirectional_attention"):
        raise ConfigError(f"{arch} with use_bidirectional_attention (an embedding model) is not supported: "
                          "jaxinfer runs causal decoders")
    d, h, n = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or d // h
    if arch == "GemmaForCausalLM":
        return _gemma1(c, arch, head_dim)
    pattern = 2 if arch in _GEMMA2_LIKE else c.get("sliding_window_pattern", 6)
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                     for i in range(n)]
    theta, scaling, local_theta = _gemma_rope(c, arch)
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=n, n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=head_dim, ffn_dim=c["intermediate_size"],
        activation=_activation(c, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        gated_mlp=True, norm="gemma_rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)), position="rope",
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        max_position_embeddings=c.get("max_position_embeddings", 8192),
        sliding_window=c.get("sliding_window"), sliding_layers=tuple(t == "sliding_attention" for t in types),
        qkv_bias=bias, out_bias=bias, qk_norm=arch == "Gemma3ForCausalLM", post_norms=arch != "VaultGemmaForCausalLM",
        attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        # HF's Gemma3Attention does not apply attn_logit_softcapping (Gemma 3 configs leave it null)
        attn_softcap=c.get("attn_logit_softcapping") if arch in _GEMMA2_LIKE else None,
        final_softcap=c.get("final_logit_softcapping"), embed_scale=math.sqrt(d),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gemma1(c: dict[str, Any], arch: str, head_dim: int) -> ModelConfig:
    """Gemma (1, 1.1) and CodeGemma: Llama's pre-norm block with Gemma's (1 + w) RMSNorms, GeGLU,
    embeddings times sqrt(d_model), tied head, every layer global, scores scaled by head_dim^-1/2;
    the published configs' hidden_act "gelu" is the tanh GELU (GemmaConfig.__post_init__; transformers
    5 reads hidden_act alone, not the older hidden_activation)."""
    d, act = c["hidden_size"], c.get("hidden_act") or "gelu_pytorch_tanh"
    theta, scaling = _rope(_rope_params(c), c)
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=head_dim,
        ffn_dim=c["intermediate_size"],
        activation=_activation({"hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act}, "hidden_act"),
        gated_mlp=True, norm="gemma_rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)), position="rope",
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 8192),
        qkv_bias=bias, out_bias=bias, embed_scale=math.sqrt(d), tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _phi3(c: dict[str, Any], arch: str) -> ModelConfig:
    """Phi-3 and Phi-4-mini: Llama's block with fused qkv_proj / gate_up_proj tensors (split by
    hf_maps), LongRoPE, partial rotary (partial_rotary_factor), a window on every layer when set."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or d // h
    params = _rope_params(c)
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):   # Phi3Config's older names of longrope
        params = {**params, "rope_type": "longrope", "type": "longrope"}
    theta, scaling = _rope(params, c)
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=head_dim, ffn_dim=c["intermediate_size"],
        activation=_activation(c, "hidden_act"), gated_mlp=True, norm="rmsnorm",
        norm_eps=float(c.get("rms_norm_eps", 1e-5)), position="rope", rope_theta=theta, rope_scaling=scaling,
        rotary_dim=_rotary_dim(params, c, head_dim, 1.0),
        max_position_embeddings=c.get("max_position_embeddings", 4096), sliding_window=c.get("sliding_window"),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gpt2(c: dict[str, Any], arch: str) -> ModelConfig:
    if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
        raise ConfigError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not c.get("scale_attn_weights", True):
        raise ConfigError("GPT-2 with scale_attn_weights=false is not supported")
    d, h = c["n_embd"], c["n_head"]
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["n_layer"], n_heads=h, n_kv_heads=h,
        head_dim=d // h, ffn_dim=c.get("n_inner") or 4 * d,
        activation=_activation(c, "activation_function", default="gelu_new"), gated_mlp=False,
        norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="learned",
        max_position_embeddings=c.get("n_positions", 1024), qkv_bias=True, out_bias=True, mlp_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gpt_bigcode(c: dict[str, Any], arch: str) -> ModelConfig:
    """GPTBigCode (StarCoder 1, StarCoderBase, SantaCoder, WizardCoder, OctoCoder): GPT-2's block with
    nn.Linear tensors, one KV head where multi_query (GPTBigCodeConfig's default), scores unscaled
    where scale_attn_weights is false."""
    if c.get("add_cross_attention"):
        raise ConfigError("GPTBigCode with add_cross_attention (an encoder-decoder's decoder) is not supported")
    d, h = c.get("n_embd", c.get("hidden_size")), c.get("n_head", c.get("num_attention_heads"))
    n = c.get("n_layer", c.get("num_hidden_layers"))
    if d is None or h is None or n is None:
        raise ConfigError("GPTBigCode config.json needs n_embd, n_head and n_layer (or hidden_size, "
                          "num_attention_heads and num_hidden_layers)")
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=n, n_heads=h,
        n_kv_heads=1 if c.get("multi_query", True) else h, head_dim=d // h, ffn_dim=c.get("n_inner") or 4 * d,
        activation=_activation(c, "activation_function", default="gelu_pytorch_tanh"), gated_mlp=False,
        norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="learned",
        max_position_embeddings=c.get("n_positions", c.get("max_position_embeddings", 1024)), qkv_bias=True,
        out_bias=True, mlp_bias=True, attn_scale=None if c.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id", 50256), eos_token_ids=_eos_ids({"eos_token_id": 50256, **c}),
        architecture=arch)


def _bloom(c: dict[str, Any], arch: str) -> ModelConfig:
    d = c.get("hidden_size", c.get("n_embed"))
    h = c.get("n_head", c.get("num_attention_heads"))
    if d is None or h is None:
        raise ConfigError("BLOOM config.json needs hidden_size (or n_embed) and n_head")
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c.get("n_layer", c.get("num_hidden_layers")),
        n_heads=h, n_kv_heads=h, head_dim=d // h, ffn_dim=4 * d, activation="gelu_tanh", gated_mlp=False,
        norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="alibi",
        max_position_embeddings=c.get("seq_length", 2048), qkv_bias=True, out_bias=True, mlp_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), embed_norm=True,
        residual_post_norm=bool(c.get("apply_residual_connection_post_layernorm", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _phi(c: dict[str, Any], arch: str) -> ModelConfig:
    """Phi-1 / 1.5 / 2 (transformers' Phi): one LayerNorm with biases per block feeding attention and
    an ungated MLP side by side, biases on every projection and on the LM head, partial rotary
    (partial_rotary_factor, default 0.5), per-head q / k LayerNorms where qk_layernorm. The remote-code
    format (model_type phi-msft: n_embd, mixer.Wqkv) is refused by name."""
    if c.get("model_type") == "phi-msft" or "hidden_size" not in c and "n_embd" in c:
        raise ConfigError("a Phi checkpoint in the remote-code format (model_type 'phi-msft', n_embd, mixer.Wqkv) "
                          "is not supported; use the transformers-format upload (PhiForCausalLM, model_type 'phi')")
    d, h = c["hidden_size"], c["num_attention_heads"]
    if d % h:
        raise ConfigError(f"hidden_size {d} is not a multiple of num_attention_heads {h}")
    if c.get("head_dim") not in (None, d // h):
        raise ConfigError(f"Phi with head_dim={c['head_dim']!r} other than hidden_size / num_attention_heads = "
                          f"{d // h} is not supported")
    params = _rope_params(c)
    theta, scaling = _rope(params, c)
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=d // h, ffn_dim=c["intermediate_size"],
        activation=_activation(c, "hidden_act", default="gelu_new"), gated_mlp=False, norm="layernorm",
        norm_eps=float(c.get("layer_norm_eps", 1e-5)), position="rope", rope_theta=theta, rope_scaling=scaling,
        rotary_dim=_rotary_dim(params, c, d // h, 0.5), max_position_embeddings=c.get("max_position_embeddings", 2048),
        qkv_bias=True, out_bias=True, mlp_bias=True, qk_norm=bool(c.get("qk_layernorm", False)),
        parallel_block=True, parallel_sum_first=True, lm_head_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gptj(c: dict[str, Any], arch: str) -> ModelConfig:
    """GPT-J (transformers' GPTJ; EleutherAI's GPT-J-6B and its fine-tunes): one LayerNorm per block
    feeding attention and an ungated MLP side by side, (attn + mlp) + x; unbiased q / k / v / o, biased
    fc_in / fc_out and LM head; the first rotary_dim features of each head rotated in pairs
    (hf_maps._PAIRED_ROPE; all of them where rotary_dim is null), at base 10 000."""
    d, h = c["n_embd"], c["n_head"]
    if d % h:
        raise ConfigError(f"n_embd {d} is not a multiple of n_head {h}")
    rotary = c.get("rotary_dim")
    if not rotary:   # transformers' GPTJ then builds its sinusoids at n_embd and fails on the heads
        raise ConfigError(f"field 'rotary_dim' = {rotary!r}: GPT-J with every feature rotated is not supported")
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["n_layer"], n_heads=h, n_kv_heads=h, head_dim=d // h,
        ffn_dim=c.get("n_inner") or 4 * d, activation=_activation(c, "activation_function", default="gelu_new"),
        gated_mlp=False, norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="rope",
        rotary_dim=None if rotary == d // h else rotary, max_position_embeddings=c.get("n_positions", 2048),
        mlp_bias=True, parallel_block=True, parallel_sum_first=True, lm_head_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _opt(c: dict[str, Any], arch: str) -> ModelConfig:
    """OPT (transformers' OPT: facebook/opt-125m ... 66b): GPT-2's pre-LayerNorm block over nn.Linear
    q / k / v / out_proj and fc1 / fc2, biases where enable_bias, ReLU, learned positions (their table's
    first two rows unused: OPT offsets positions by 2, hf_maps._opt_map), the embedding as the head
    unless tie_word_embeddings is false. OPT-350m's post-LayerNorm blocks with projections of the
    embedding (do_layer_norm_before false, word_embed_proj_dim) are refused by field."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    for field, ok in (("do_layer_norm_before", True), ("_remove_final_layer_norm", False),
                      ("layer_norm_elementwise_affine", True)):
        if c.get(field, ok) != ok:
            raise ConfigError(f"OPT with {field}={c[field]!r} is not supported (OPT-350m's post-LayerNorm blocks)")
    if c.get("word_embed_proj_dim") not in (None, d):
        raise ConfigError(f"OPT with word_embed_proj_dim={c['word_embed_proj_dim']!r} other than hidden_size {d} "
                          "(OPT-350m's projected embeddings) is not supported")
    if d % h:
        raise ConfigError(f"hidden_size {d} is not a multiple of num_attention_heads {h}")
    bias = bool(c.get("enable_bias", True))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h, n_kv_heads=h,
        head_dim=d // h, ffn_dim=c["ffn_dim"], activation=_activation(c, "activation_function", default="relu"),
        gated_mlp=False, norm="layernorm", norm_eps=1e-5, position="learned",
        max_position_embeddings=c["max_position_embeddings"], qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gpt_neo(c: dict[str, Any], arch: str) -> ModelConfig:
    """GPT-Neo (transformers' GPTNeo: 125M, 1.3B, 2.7B): GPT-2's pre-LayerNorm block over nn.Linear
    q / k / v (unbiased) / out_proj and c_fc / c_proj, learned positions, unscaled scores (q.k, no
    1/sqrt(head_dim)), and a window of window_size on the layers attention_layers names "local"
    (else attention_types expanded: [[["global", "local"], 12]] by default)."""
    d, h, n = c["hidden_size"], c["num_heads"], c["num_layers"]
    if d % h:
        raise ConfigError(f"hidden_size {d} is not a multiple of num_heads {h}")
    kinds = c.get("attention_layers") or [k for kinds, times in (c.get("attention_types") or [[["global", "local"], 12]])
                                          for _ in range(times) for k in kinds]
    if len(kinds) != n or set(kinds) - {"global", "local"}:
        raise ConfigError(f"field 'attention_layers' must name 'global' or 'local' for each of the {n} layers, "
                          f"got {kinds!r}")
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=n, n_heads=h, n_kv_heads=h, head_dim=d // h,
        ffn_dim=c.get("intermediate_size") or 4 * d,
        activation=_activation(c, "activation_function", default="gelu_new"), gated_mlp=False, norm="layernorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), position="learned",
        max_position_embeddings=c["max_position_embeddings"], out_bias=True, mlp_bias=True, attn_scale=1.0,
        **_windows(c["window_size"], tuple(k == "local" for k in kinds)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _stablelm(c: dict[str, Any], arch: str) -> ModelConfig:
    """StableLM (3B-4E1T, Zephyr 3B, StableLM 2 1.6B / 12B): Llama's names and gated SiLU MLP with
    LayerNorms (biases), partial rotary (partial_rotary_factor, default 0.25), q / k / v biases where
    use_qkv_bias, a bias-free LayerNorm per head of q and k where qk_layernorm, attention and MLP side
    by side on the one input norm where use_parallel_residual (StableLM 2 12B)."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    if d % h:
        raise ConfigError(f"hidden_size {d} is not a multiple of num_attention_heads {h}")
    params = _rope_params(c)
    theta, scaling = _rope(params, c)
    qk_norm = bool(c.get("qk_layernorm", False))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h,
        n_kv_heads=c.get("num_key_value_heads") or h, head_dim=d // h, ffn_dim=c["intermediate_size"],
        activation=_activation(c, "hidden_act"), norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)),
        position="rope", rope_theta=theta, rope_scaling=scaling, rotary_dim=_rotary_dim(params, c, d // h, 0.25),
        max_position_embeddings=c.get("max_position_embeddings", 4096), qkv_bias=bool(c.get("use_qkv_bias", False)),
        qk_norm=qk_norm, qk_norm_heads=qk_norm, parallel_block=bool(c.get("use_parallel_residual", False)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _gpt_neox(c: dict[str, Any], arch: str) -> ModelConfig:
    """GPT-NeoX (Pythia, GPT-NeoX-20B and their fine-tunes): LayerNorms with biases, multi-head
    attention with partial rotary (rotary_pct of each head, default 0.25; RoPE base rotary_emb_base),
    biases on q/k/v and the output where attention_bias (default true), an ungated MLP with biases,
    attention and MLP side by side on their own norms where use_parallel_residual (default true),
    an untied LM head by default."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    if d % h:
        raise ConfigError(f"hidden_size {d} is not a multiple of num_attention_heads {h}")
    params = {"rope_theta": c.get("rotary_emb_base", 10000.0), **_rope_params(c)}
    theta, scaling = _rope(params, c)
    bias, parallel = bool(c.get("attention_bias", True)), bool(c.get("use_parallel_residual", True))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c["num_hidden_layers"], n_heads=h, n_kv_heads=h,
        head_dim=d // h, ffn_dim=c["intermediate_size"], activation=_activation(c, "hidden_act", default="gelu"),
        gated_mlp=False, norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)), position="rope",
        rope_theta=theta, rope_scaling=scaling, rotary_dim=_rotary_dim({"partial_rotary_factor": c.get(
            "rotary_pct", 0.25), **params}, c, d // h, 0.25),
        max_position_embeddings=c.get("max_position_embeddings", 2048), qkv_bias=bias, out_bias=bias,
        mlp_bias=True, parallel_block=parallel, parallel_mlp_norm=parallel, parallel_sum_first=parallel,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos_ids(c), architecture=arch)


def _falcon(c: dict[str, Any], arch: str) -> ModelConfig:
    """Falcon (7B / 40B / 180B, Falcon2-11B; FalconConfig): LayerNorms, RoPE over whole heads, an
    ungated GELU MLP, biases where `bias`. The original blocks (new_decoder_architecture false): one
    KV head where multi_query, attention and MLP side by side on one norm where parallel_attn, else
    one after the other; the new ones (40B, 180B): num_kv_heads KV heads, always side by side, on
    ln_attn and ln_mlp (num_ln_in_parallel_attn 2, the default) or on one norm."""
    for key in ("alibi", "apply_residual_connection_post_layernorm"):
        if c.get(key):
            raise ConfigError(f"Falcon with {key}=true (Falcon-RW) is not supported")
    d = c.get("hidden_size", c.get("n_embed"))
    h = c.get("num_attention_heads", c.get("n_head"))
    if d is None or h is None or d % h:
        raise ConfigError(f"Falcon needs hidden_size a multiple of num_attention_heads, got {d!r} and {h!r}")
    new = bool(c.get("new_decoder_architecture", False))
    kv = c.get("num_kv_heads") or h
    if not new and c.get("multi_query", True):
        kv = 1
    elif not new and kv != h:   # FalconAttention's per-head q, k, v whatever num_kv_heads says
        raise ConfigError(f"Falcon without new_decoder_architecture or multi_query has one KV head per head; "
                          f"num_kv_heads = {kv} with {h} heads is not a checkpoint transformers builds")
    norms = c.get("num_ln_in_parallel_attn") or 2
    if new and norms == 1 and not c.get("parallel_attn", True):
        raise ConfigError("Falcon's new_decoder_architecture with one norm needs parallel_attn")
    parallel = new or bool(c.get("parallel_attn", True))
    theta, scaling = _rope(_rope_params(c), c)
    bias = bool(c.get("bias", False))
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=d, n_layers=c.get("num_hidden_layers", c.get("n_layer")), n_heads=h,
        n_kv_heads=kv, head_dim=d // h, ffn_dim=c.get("ffn_hidden_size") or 4 * d,
        activation=_activation(c, "activation", default="gelu"), gated_mlp=False, norm="layernorm",
        norm_eps=float(c.get("layer_norm_epsilon") or 1e-5), position="rope", rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 2048), qkv_bias=bias,
        out_bias=bias, mlp_bias=bias, parallel_block=parallel, parallel_mlp_norm=new and norms == 2,
        parallel_sum_first=parallel, tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id", 11), eos_token_ids=_eos_ids({"eos_token_id": 11, **c}),
        architecture=arch)


_HF_BUILDERS = {
    "LlamaForCausalLM": _llama_like, "MistralForCausalLM": _llama_like, "Qwen2ForCausalLM": _llama_like,
    "Qwen3ForCausalLM": _llama_like, "ArceeForCausalLM": _llama_like, "HeliumForCausalLM": _llama_like,
    "GemmaForCausalLM": _gemma, "Gemma2ForCausalLM": _gemma, "VaultGemmaForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "Phi3ForCausalLM": _phi3, "GPT2LMHeadModel": _gpt2, "GPTBigCodeForCausalLM": _gpt_bigcode,
    "BloomForCausalLM": _bloom,
    "MixtralForCausalLM": _moe, "Qwen3MoeForCausalLM": _moe, "GptOssForCausalLM": _gpt_oss,
    "SmolLM3ForCausalLM": _smollm3, "GraniteForCausalLM": _granite, "Olmo2ForCausalLM": _olmo,
    "Olmo3ForCausalLM": _olmo, "Exaone4ForCausalLM": _exaone4, "SeedOssForCausalLM": _seed_oss,
    "Qwen2MoeForCausalLM": _qwen2_moe, "Glm4MoeForCausalLM": _glm4_moe, "DeepseekV3ForCausalLM": _deepseek_v3,
    "DeepseekV2ForCausalLM": _deepseek_v2, "Glm4MoeLiteForCausalLM": _glm4_moe_lite, "GlmForCausalLM": _glm,
    "Glm4ForCausalLM": _glm,
    "Starcoder2ForCausalLM": _starcoder2, "CohereForCausalLM": _cohere, "Cohere2ForCausalLM": _cohere,
    "Ernie4_5ForCausalLM": _ernie4_5, "Ernie4_5_MoeForCausalLM": _ernie4_5_moe,
    "GPTNeoXForCausalLM": _gpt_neox, "PhiForCausalLM": _phi, "FalconForCausalLM": _falcon,
    "StableLmForCausalLM": _stablelm, "GraniteMoeForCausalLM": _granitemoe, "GraniteMoeSharedForCausalLM": _granitemoe,
    "GraniteMoeHybridForCausalLM": _granitemoehybrid,
    "BambaForCausalLM": _bamba,
    "NemotronHForCausalLM": _nemotron_h,
    "OlmoeForCausalLM": _olmoe, "MiniMaxM2ForCausalLM": _minimax_m2, "Dots1ForCausalLM": _dots1,
    "SolarOpenForCausalLM": _solar_open, "ExaoneMoeForCausalLM": _exaone_moe,
    "GraniteSWAForCausalLM": _granite_swa, "Jais2ForCausalLM": _jais2, "NemotronForCausalLM": _nemotron,
    "MinistralForCausalLM": _ministral,
    "CwmForCausalLM": _ministral, "Ministral3ForCausalLM": _ministral3,
    "HunYuanDenseV1ForCausalLM": _hunyuan, "HunYuanMoEV1ForCausalLM": _hunyuan_moe,
    "ExaoneForCausalLM": _exaone, "InternLM3ForCausalLM": _internlm3, "AfmoeForCausalLM": _afmoe,
    "PhimoeForCausalLM": _phimoe, "ApertusForCausalLM": _apertus, "GPTJForCausalLM": _gptj,
    "OlmoForCausalLM": _olmo1, "InternLM2ForCausalLM": _internlm2, "MiniCPMForCausalLM": _minicpm,
    "OPTForCausalLM": _opt, "GPTNeoForCausalLM": _gpt_neo, "Llama4ForCausalLM": _llama4, "Lfm2ForCausalLM": _lfm2,
    "Lfm2MoeForCausalLM": _lfm2_moe, "Qwen3NextForCausalLM": _qwen3_next, "Qwen3_5ForCausalLM": _qwen3_next,
    "Qwen3_5MoeForCausalLM": _qwen3_next,
}
# model types transformers reads with LlamaForCausalLM (renaming EXAONE's tensors as it loads and
# back as it saves), whose config.json names that class once re-saved
_AS_LLAMA = {"exaone": "ExaoneForCausalLM", "internlm3": "InternLM3ForCausalLM"}
# the names uploads' modeling code gives a class transformers spells otherwise (Phi-3.5-MoE's)
_ALIASES = {"PhiMoEForCausalLM": "PhimoeForCausalLM"}
_BARE_MODELS = {a.replace("ForCausalLM", head): a for a in _HF_BUILDERS if a.endswith("ForCausalLM")
                for head in ("Model", "ForSequenceClassification")}
_ARCH_BY_MODEL_TYPE = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                       "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM", "llama4_text": "Llama4ForCausalLM",
                       "llama4": "Llama4ForConditionalGeneration",
                       "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "arcee": "ArceeForCausalLM", "helium": "HeliumForCausalLM",
                       "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                       "vaultgemma": "VaultGemmaForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                       "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                       "gpt_bigcode": "GPTBigCodeForCausalLM", "falcon": "FalconForCausalLM",
                       "bloom": "BloomForCausalLM",
                       "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                       "gpt_oss": "GptOssForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                       "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
                       "exaone4": "Exaone4ForCausalLM", "seed_oss": "SeedOssForCausalLM",
                       "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                       "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                       "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                       "minimax_m2": "MiniMaxM2ForCausalLM", "ministral": "MinistralForCausalLM",
                       "cwm": "CwmForCausalLM", "granite_swa": "GraniteSWAForCausalLM", "jais2": "Jais2ForCausalLM",
                       "nemotron": "NemotronForCausalLM",
                       "dots1": "Dots1ForCausalLM", "solar_open": "SolarOpenForCausalLM",
                       "exaone_moe": "ExaoneMoeForCausalLM",
                       "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                       "cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
                       "ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                       "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM",
                       "stablelm": "StableLmForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                       "granitemoeshared": "GraniteMoeSharedForCausalLM", "olmoe": "OlmoeForCausalLM",
                       "granitemoehybrid": "GraniteMoeHybridForCausalLM", "bamba": "BambaForCausalLM",
                       "nemotron_h": "NemotronHForCausalLM",
                       "ministral3": "Ministral3ForCausalLM", "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
                       "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM", "afmoe": "AfmoeForCausalLM",
                       "phimoe": "PhimoeForCausalLM", "apertus": "ApertusForCausalLM", "gptj": "GPTJForCausalLM",
                       "olmo": "OlmoForCausalLM", "internlm2": "InternLM2ForCausalLM",
                       "minicpm": "MiniCPMForCausalLM", "opt": "OPTForCausalLM",
                       "gpt_neo": "GPTNeoForCausalLM",
                       **_AS_LLAMA,
                       "gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration",
                       "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                       "llava_onevision": "LlavaOnevisionForConditionalGeneration",
                       "qwen2_vl": "Qwen2VLForConditionalGeneration",
                       "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                       "qwen3_vl": "Qwen3VLForConditionalGeneration",
                       "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
# gpt-oss's RoPE when config.json names none (GptOssConfig.__post_init__)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# transformers' class defaults of the fields a config.json may leave out, where they differ from what
# the builders assume (Qwen3Config, Gemma2Config, Gemma3TextConfig, MixtralConfig, Qwen3MoeConfig, GptOssConfig)
_GEMMA_DEFAULTS = {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256, "tie_word_embeddings": True}
_GLM_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1.5625e-07, "max_position_embeddings": 131072,
                 "num_key_value_heads": 2, "eos_token_id": [151329, 151336, 151338]}
_COHERE_DEFAULTS = {"max_position_embeddings": 8192, "bos_token_id": 5, "eos_token_id": 255001}
# what Qwen3NextConfig, Qwen3_5TextConfig and Qwen3_5MoeTextConfig share
_QWEN3_NEXT = {"num_attention_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 256,
               "hidden_act": "silu", "tie_word_embeddings": False, "linear_conv_kernel_dim": 4,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
               "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
_HF_DEFAULTS = {
    # Qwen3NextConfig's, Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's
    "Qwen3NextForCausalLM": {**_QWEN3_NEXT, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_hidden_layers": 48, "num_key_value_heads": 2, "num_experts_per_tok": 10,
                             "norm_topk_prob": True},
    "Qwen3_5ForCausalLM": {**_QWEN3_NEXT, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                           "num_hidden_layers": 32, "num_key_value_heads": 4},
    "Qwen3_5MoeForCausalLM": {**_QWEN3_NEXT, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                              "num_key_value_heads": 2, "num_experts_per_tok": 8},
    # Lfm2MoeConfig's
    "Lfm2MoeForCausalLM": {"vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168,
                           "moe_intermediate_size": 1792, "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
                           "num_experts_per_tok": 4, "bos_token_id": 1, "eos_token_id": 2},
    # Lfm2Config's
    "Lfm2ForCausalLM": {"vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
                        "rope_theta": 1000000.0, "bos_token_id": 1, "eos_token_id": 2},
    # Llama4TextConfig's (a Llama 4 upload's text_config names only some)
    "Llama4ForCausalLM": {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
                          "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                          "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                          "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                          "num_experts_per_tok": 1, "attention_chunk_size": 8192, "floor_scale": 8192,
                          "attn_scale": 0.1, "bos_token_id": 1, "eos_token_id": 2},
    "Qwen3ForCausalLM": {"head_dim": 128},
    "Ernie4_5ForCausalLM": {"head_dim": 128, "num_key_value_heads": 2, "max_position_embeddings": 131072,
                            "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2},
    "Ernie4_5_MoeForCausalLM": {"num_key_value_heads": 4, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                                "bos_token_id": 1, "eos_token_id": 2},
    "GlmForCausalLM": _GLM_DEFAULTS, "Glm4ForCausalLM": _GLM_DEFAULTS,
    "Starcoder2ForCausalLM": {"num_key_value_heads": 2, "bos_token_id": 50256, "eos_token_id": 50256},
    "GPTNeoXForCausalLM": {"bos_token_id": 0, "eos_token_id": 2},
    "PhiForCausalLM": {"bos_token_id": 1, "eos_token_id": 2},
    "StableLmForCausalLM": {"num_key_value_heads": 32, "bos_token_id": 0, "eos_token_id": 0},
    "GraniteMoeForCausalLM": {"num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 2},
    "GraniteMoeSharedForCausalLM": {"num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 2},
    # GraniteMoeHybridConfig's
    "GraniteMoeHybridForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                                    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
                                    "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                                    "intermediate_size": 11008, "shared_intermediate_size": 1024,
                                    "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                                    "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
                                    "mamba_conv_bias": True, "mamba_proj_bias": False},
    # NemotronHConfig's
    "NemotronHForCausalLM": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
                             "num_attention_heads": 32, "num_key_value_heads": 8,
                             "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "mlp_hidden_act": "relu2",
                             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "mamba_num_heads": 128,
                             "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
                             "use_conv_bias": True, "mamba_hidden_act": "silu", "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
                             "moe_shared_expert_intermediate_size": 7688, "routed_scaling_factor": 1.0, "n_group": 1,
                             "topk_group": 1, "norm_topk_prob": True},
    # BambaConfig's
    "BambaForCausalLM": {"vocab_size": 128000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 262144,
                         "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
                         "eos_token_id": 2, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                         "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
                         "mamba_proj_bias": False},
    "HunYuanDenseV1ForCausalLM": {"bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5},
    "HunYuanMoEV1ForCausalLM": {"bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5},
    "ExaoneForCausalLM": {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 14336,
                          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                          "bos_token_id": 1, "eos_token_id": 361},
    "OlmoForCausalLM": {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "max_position_embeddings": 2048, "eos_token_id": 50279},
    "GPTJForCausalLM": {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                        "rotary_dim": 64, "bos_token_id": 50256, "eos_token_id": 50256},
    "GPTNeoForCausalLM": {"vocab_size": 50257, "max_position_embeddings": 2048, "hidden_size": 2048,
                          "num_layers": 24, "num_heads": 16, "window_size": 256, "bos_token_id": 50256,
                          "eos_token_id": 50256},
    "OPTForCausalLM": {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
                       "max_position_embeddings": 2048, "num_attention_heads": 12, "bos_token_id": 2,
                       "eos_token_id": 2},
    # the remote MiniCPMConfig's (openbmb's modeling code)
    "MiniCPMForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                           "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "scale_emb": 1, "dim_model_base": 1,
                           "scale_depth": 1, "bos_token_id": 1, "eos_token_id": 2},
    "ApertusForCausalLM": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 65536,
                           "rms_norm_eps": 1e-5, "hidden_act": "xielu", "bos_token_id": 1, "eos_token_id": 2},
    "PhimoeForCausalLM": {"vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                          "rms_norm_eps": 1e-5, "num_experts_per_tok": 2, "router_jitter_noise": 0.01, "rope_theta": 1e6,
                          "bos_token_id": 1, "eos_token_id": 2},
    "AfmoeForCausalLM": {"vocab_size": 200192, "hidden_size": 2048, "intermediate_size": 6144,
                         "moe_intermediate_size": 1408, "num_hidden_layers": 32, "num_dense_layers": 1,
                         "num_attention_heads": 16, "head_dim": 128, "max_position_embeddings": 16384,
                         "rms_norm_eps": 1e-5, "num_experts_per_tok": 6, "num_shared_experts": 2, "route_scale": 1.0,
                         "global_attn_every_n_layers": 4, "sliding_window": 1024},
    "InternLM3ForCausalLM": {"vocab_size": 128512, "hidden_size": 4096, "intermediate_size": 10240,
                             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2,
                             "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                             "bos_token_id": 1, "eos_token_id": 2},
    "Ministral3ForCausalLM": {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
                              "num_hidden_layers": 34, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
                              "bos_token_id": 1, "eos_token_id": 2},
    "OlmoeForCausalLM": {"num_experts_per_tok": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                         "eos_token_id": 50279},
    "CohereForCausalLM": {**_COHERE_DEFAULTS, "rope_theta": 500000.0},
    "Cohere2ForCausalLM": {**_COHERE_DEFAULTS, "sliding_window": 4096},
    "Exaone4ForCausalLM": {"sliding_window": 4096, "num_key_value_heads": 32},
    "SeedOssForCausalLM": {"head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 524288},
    "SmolLM3ForCausalLM": {"max_position_embeddings": 32768, "tie_word_embeddings": True, "num_key_value_heads": 4,
                           "rope_theta": 2000000.0},
    "ArceeForCausalLM": {"hidden_act": "relu2", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                         "bos_token_id": 128000, "eos_token_id": 128001},
    "HeliumForCausalLM": {"head_dim": 128, "rms_norm_eps": 1e-8, "rope_theta": 100000.0,
                          "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "GemmaForCausalLM": {"head_dim": 256, "num_key_value_heads": 16, "max_position_embeddings": 8192,
                         "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "VaultGemmaForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
                              "final_logit_softcapping": 30.0, "num_key_value_heads": 4, "bos_token_id": 2,
                              "eos_token_id": 1},
    # Gemma3TextConfig's: the text_config of a Gemma 3 vision-language checkpoint names only the sizes
    # that differ from them (gemma-3-4b-it: hidden, intermediate and layer counts)
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "vocab_size": 262208,
                          "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "bos_token_id": 2, "eos_token_id": 1},
    "MixtralForCausalLM": {"rope_theta": 1e6, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                           "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "norm_topk_prob": False},
    "GptOssForCausalLM": {"head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072,
                          "rope_theta": 150000.0, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "num_experts_per_tok": 4,
                          "rms_norm_eps": 1e-5},
    # transformers' class defaults of fields a hand-written config.json may leave out
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_experts_per_tok": 4,
                            "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                            "norm_topk_prob": False, "rms_norm_eps": 1e-6},
    "Glm4MoeForCausalLM": {"max_position_embeddings": 131072, "num_experts_per_tok": 8,
                           "moe_intermediate_size": 1408, "n_shared_experts": 1, "first_k_dense_replace": 1,
                           "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                           "rms_norm_eps": 1e-5},
    "DeepseekV3ForCausalLM": {"max_position_embeddings": 4096, "num_experts_per_tok": 8,
                              "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
                              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                              "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                              "qk_nope_head_dim": 128, "rms_norm_eps": 1e-6, "rope_interleave": True},
    "ExaoneMoeForCausalLM": {"sliding_window": 4096, "sliding_window_pattern": 4, "num_key_value_heads": 32,
                             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "first_k_dense_replace": 1,
                             "moe_intermediate_size": 1024, "num_experts_per_tok": 8, "num_shared_experts": 1,
                             "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
                             "bos_token_id": 1, "eos_token_id": 53},
    "SolarOpenForCausalLM": {"head_dim": 128, "num_key_value_heads": 8, "rope_theta": 1000000.0,
                             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "moe_intermediate_size": 1280,
                             "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                             "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
    "Dots1ForCausalLM": {"num_key_value_heads": 32, "moe_intermediate_size": 1408, "n_shared_experts": 0,
                         "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                         "max_window_layers": 62},
    "NemotronForCausalLM": {"hidden_act": "relu2", "max_position_embeddings": 4096, "bos_token_id": 2,
                            "eos_token_id": 3},
    "Jais2ForCausalLM": {"hidden_act": "relu2", "max_position_embeddings": 8192, "attention_bias": True,
                         "mlp_bias": True, "bos_token_id": 0, "eos_token_id": 150024},
    "GraniteSWAForCausalLM": {"num_key_value_heads": 4, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                              "tie_word_embeddings": True, "sliding_window": 128, "bos_token_id": 100257,
                              "eos_token_id": 100257},
    "CwmForCausalLM": {"head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                       "rms_norm_eps": 1e-5, "sliding_window": 8192, "bos_token_id": 128000,
                       "eos_token_id": [128001, 128008, 128009]},
    "MinistralForCausalLM": {"sliding_window": 4096, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                             "bos_token_id": 1, "eos_token_id": 2},
    "MiniMaxM2ForCausalLM": {"head_dim": 128, "num_key_value_heads": 8, "rope_theta": 5000000.0,
                             "max_position_embeddings": 196608, "num_experts_per_tok": 8, "rms_norm_eps": 1e-6,
                             "bos_token_id": 200034, "eos_token_id": 200020},
    "Glm4MoeLiteForCausalLM": {"max_position_embeddings": 202752, "num_experts_per_tok": 4, "moe_intermediate_size": 1536,
                               "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1,
                               "topk_group": 1, "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64,
                               "v_head_dim": 256, "qk_nope_head_dim": 192, "rms_norm_eps": 1e-5, "rope_interleave": True,
                               "bos_token_id": 0, "eos_token_id": 1},
    "DeepseekV2ForCausalLM": {"max_position_embeddings": 2048, "moe_intermediate_size": 1407, "n_shared_experts": 2,
                              "first_k_dense_replace": 0, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                              "topk_method": "greedy", "kv_lora_rank": 512, "q_lora_rank": 1536,
                              "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "rms_norm_eps": 1e-6},
}
_DEFAULT_EXPERTS = {"Qwen3NextForCausalLM": 512, "Qwen3_5MoeForCausalLM": 256,
                    "MixtralForCausalLM": 8, "Qwen3MoeForCausalLM": 128, "GptOssForCausalLM": 128,
                    "Qwen2MoeForCausalLM": 60, "Glm4MoeForCausalLM": 128, "DeepseekV3ForCausalLM": 256,
                    "DeepseekV2ForCausalLM": 64, "Glm4MoeLiteForCausalLM": 64, "MiniMaxM2ForCausalLM": 256,
                    "SolarOpenForCausalLM": 128, "ExaoneMoeForCausalLM": 64, "AfmoeForCausalLM": 64, "PhimoeForCausalLM": 16,
                    "GraniteMoeForCausalLM": 8, "GraniteMoeSharedForCausalLM": 8,
                    "OlmoeForCausalLM": 64,
                    "HunYuanMoEV1ForCausalLM": 1, "Llama4ForCausalLM": 16,
                    "Lfm2MoeForCausalLM": 32}
# architectures close to a supported one, refused with a pointer to what is supported
_NOT_SUPPORTED = {
    "Phi3SmallForCausalLM": " (Phi-3-small: block-sparse attention and its own MLP, not Phi3ForCausalLM's)",
    "OLMoForCausalLM": " (OLMo 1's hf_olmo remote-code format: load its -hf upload, OlmoForCausalLM)",
}
