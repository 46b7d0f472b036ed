"""`jaxinfer export-hf`: write a Llama-family model (Llama / Mistral / Qwen2 layouts) as an HF folder
(config.json + model.safetensors + tokenizer files) that transformers loads as-is.

The inverse of models/hf_maps.py for the Llama family; other families are refused with a clear
error rather than written wrongly. The tokenizer_config.json written beside the tokenizer makes
transformers' AutoTokenizer and llama.cpp's convert_hf_to_gguf.py tokenize as jaxinfer does.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import Decoder, unfuse_decoder
from jaxinfer.quant import QuantizedWeight

_LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.architecture not in _LLAMA_LIKE or cfg.position != "rope" or not cfg.gated_mlp or cfg.norm != "rmsnorm":
        raise ValueError(f"export-hf supports the Llama family (Llama, Mistral, Qwen2); got {cfg.architecture}")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta, "factor": s.factor}
        if s.kind == "llama3":
            rope |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                     "original_max_position_embeddings": s.original_max_position_embeddings}
        elif s.kind == "yarn":
            rope |= {"original_max_position_embeddings": s.original_max_position_embeddings,
                     "attention_factor": s.attention_factor, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                     "truncate": s.truncate}
        elif s.kind == "longrope":   # which factors apply follows max_position_embeddings, written below
            rope |= {"original_max_position_embeddings": s.original_max_position_embeddings,
                     "attention_factor": s.attention_factor, "short_factor": list(s.short_factor),
                     "long_factor": list(s.long_factor)}
    out = {
        "architectures": [cfg.architecture], "model_type": _LLAMA_LIKE[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.activation,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
        (cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
        "torch_dtype": "float32",
    }
    if cfg.architecture == "LlamaForCausalLM":
        out |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    elif cfg.architecture == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window
    else:
        out |= {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
                "layer_types": ["sliding_attention" if cfg.layer_window(i) else "full_attention"
                                for i in range(cfg.n_layers)]}
    return out


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    model = unfuse_decoder(model)   # a fused model (fuse_decoder) is written with HF's separate names
    cfg = model.cfg
    values = {"/".join(map(str, k)): v.get_value() for k, v in nnx.state(model, nnx.Param).flat_state()}
    quantized = [k for k, v in values.items() if isinstance(v, QuantizedWeight)]
    if quantized:
        raise ValueError(f"export-hf writes float weights, and this model holds quantized ones ({quantized[0]}"
                         f"{f' and {len(quantized) - 1} more' if len(quantized) > 1 else ''}): export the float "
                         "model, or serve the quantized checkpoint as it is")
    p = {k: np.asarray(v, np.float32) for k, v in values.items()}
    d = cfg.d_model
    t = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm/scale"]}
    for i in range(cfg.n_layers):
        o, h = f"layers/{i}", f"model.layers.{i}"
        t[f"{h}.input_layernorm.weight"] = p[f"{o}/attn_norm/scale"]
        t[f"{h}.post_attention_layernorm.weight"] = p[f"{o}/mlp_norm/scale"]
        for name in "qkv":
            t[f"{h}.self_attn.{name}_proj.weight"] = p[f"{o}/attn/{name}"].reshape(d, -1).T
            if f"{o}/attn/{name}_bias" in p:
                t[f"{h}.self_attn.{name}_proj.bias"] = p[f"{o}/attn/{name}_bias"].reshape(-1)
        t[f"{h}.self_attn.o_proj.weight"] = p[f"{o}/attn/o"].reshape(-1, d).T
        if f"{o}/attn/o_bias" in p:
            t[f"{h}.self_attn.o_proj.bias"] = p[f"{o}/attn/o_bias"]
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            t[f"{h}.mlp.{theirs}.weight"] = p[f"{o}/mlp/{ours}"].T
            if f"{o}/mlp/{ours}_bias" in p:
                t[f"{h}.mlp.{theirs}.bias"] = p[f"{o}/mlp/{ours}_bias"]
    if "lm_head" in p:
        t["lm_head.weight"] = p["lm_head"].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def tokenizer_config(tokenizer, cfg: ModelConfig, existing: dict | None = None) -> dict:
    """tokenizer_config.json for `tokenizer` as jaxinfer.tokenizer uses it, over `existing` (the
    source folder's, if any). What a reader would otherwise guess differently:
    - add_prefix_space: transformers' Llama tokenizer and llama.cpp both prepend a word marker
      ("And" -> "_And") unless told not to; we encode with the SentencePiece model's own
      normalizer, so follow its add_dummy_prefix (probed: does "a" come out with the marker?);
    - split_special_tokens: we read "<s>" in a prompt as text, never as the BOS id;
    - add_bos_token / add_eos_token: what our encode() adds."""
    out = dict(existing or {})
    piece = tokenizer.id_to_piece
    special = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_ids[0] if tokenizer.eos_ids else None,
               "pad_token": tokenizer.pad_id}
    if tokenizer.kind == "sentencepiece":
        sp = tokenizer._backend
        special["unk_token"] = sp.unk_id() if sp.unk_id() >= 0 else None
        out |= {"tokenizer_class": "LlamaTokenizer", "legacy": False, "sp_model_kwargs": {},
                "add_prefix_space": sp.encode("a", out_type=str)[0].startswith("\u2581"),
                "split_special_tokens": True}
    else:
        out.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name, i in special.items():
        if i is not None and name not in out:
            out[name] = piece(i)
    out |= {"add_bos_token": bool(tokenizer.add_bos), "add_eos_token": False,
            "clean_up_tokenization_spaces": False}
    out.setdefault("model_max_length", cfg.max_position_embeddings)
    if tokenizer.chat_template and "chat_template" not in out:
        out["chat_template"] = tokenizer.chat_template
    return out


def export_hf(model: Decoder, out_dir: str | Path, tokenizer=None) -> Path:
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(model.cfg)
    save_file(hf_tensors(model), out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save(out_dir)
        existing = next((f for f in tokenizer.files if f.name == "tokenizer_config.json"), None)
        config = tokenizer_config(tokenizer, model.cfg, json.loads(existing.read_text()) if existing else None)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return out_dir
