"""Tiny pre-quantized checkpoints made by the producers' own code, and their references.

compressed-tensors: the scheme is applied with compressed_tensors.apply_quantization_config, each
weight's scale / zero point computed by compressed_tensors' calculate_qparams from the min and max
llm-compressor's MinMax observer would see (per group, channel or tensor), then compressed and saved by
compressed_tensors' ModelCompressor (compress_model, save_pretrained, update_config): llm-compressor's
RTN path without llm-compressor itself (it is not installed here: it downgrades transformers and
huggingface_hub). The reference is transformers on the weights compressed_tensors' own compressor
decompresses from the saved tensors, with the activations fake-quantized by compressed_tensors'
own dynamic per-token quantizer for activation-quantized schemes.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128)


def tiny_llama(seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**LLAMA, **overrides}, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ct_scheme(preset: str, group_size: int | None = 32):
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    return scheme


def save_compressed_tensors(folder: Path, scheme, seed: int = 0, ignore=("lm_head",)):
    """A tiny Llama quantized with `scheme` (a compressed_tensors QuantizationScheme) -> (folder,
    the float model it came from)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed)
    base = copy.deepcopy(model)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for _, mod in model.named_modules():
            if not hasattr(mod, "weight_scale"):
                continue
            a, w = mod.quantization_scheme.weights, mod.weight
            if a.strategy == "group":
                wg = w.reshape(w.shape[0], -1, a.group_size)
                lo, hi = wg.amin(-1), wg.amax(-1)
            elif a.strategy == "channel":
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, a)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data.copy_(zero.reshape(mod.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return Path(folder), base


def ct_reference(folder: Path, base, activations="ct"):
    """transformers (the float model `base`) with every quantized Linear's weight replaced by what
    compressed_tensors' compressor decompresses from the saved tensors. Dynamically activation-quantized
    schemes: activations="ct" fake-quantizes the inputs per token with compressed_tensors' own
    quantizer (scale max|x| / 127.5 for int8), "vllm" with vLLM's dynamic_scaled_int8_quant arithmetic
    (scale max|x_t| / 127, round half to even, clamp to [-128, 127]; written here in torch), False not at all."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    ref = copy.deepcopy(base)
    for name, mod in ref.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name in qc["ignore"]:
            continue
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        with torch.no_grad():
            mod.weight.copy_(compressor.decompress(local, scheme)["weight"].to(torch.float32))
        act = scheme.input_activations
        if act is not None and act.dynamic and activations == "ct":
            def hook(m, args, act=act):
                x = args[0]
                s, z = compute_dynamic_scales_and_zp(x, act, m)
                return (fake_quantize(x, s, z, act),)
            mod.register_forward_pre_hook(hook)
        elif act is not None and act.dynamic and activations == "vllm":
            assert act.type == "int" and act.num_bits == 8 and act.strategy == "token"

            def hook(m, args):
                x = args[0]
                s = x.abs().amax(-1, keepdim=True) / 127.0
                s = torch.where(s > 0, s, torch.ones_like(s))
                return (torch.clamp(torch.round(x / s), -128, 127) * s,)
            mod.register_forward_pre_hook(hook)
    return ref


def logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
