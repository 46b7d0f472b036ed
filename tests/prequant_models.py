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
    """A tiny Llama quantized with `scheme` (a compressed_tensors QuantizationScheme, or a dict of
    config groups: name -> scheme) -> (folder, the float model it came from)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed)
    base = copy.deepcopy(model)
    groups = scheme if isinstance(scheme, dict) else {"group_0": scheme}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)))
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


def _float_state(model) -> dict:
    """The model's tensors as save_pretrained writes them (a tied lm_head is not stored)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# ------------------------------------------------------------------------------------------- GPTQ
# GPTQModel and AutoAWQ are not installed (no CPU wheels here that leave transformers alone); their
# packing is written below line by line after the published functions, each named.

def _gptq_find_params(x, bits: int, sym: bool):
    """GPTQModel gptqmodel/quantization/quantizer.py Quantizer.find_params (perchannel, no mse):
    x [out, cols] -> (scale [out], zero [out])."""
    import torch
    maxq = 2 ** bits - 1
    tmp = torch.zeros(x.shape[0])
    xmin = torch.minimum(x.min(1)[0], tmp)
    xmax = torch.maximum(x.max(1)[0], tmp)
    if sym:
        xmax = torch.maximum(torch.abs(xmin), xmax)
        neg = xmin < 0
        xmin[neg] = -xmax[neg]
    both = (xmin == 0) & (xmax == 0)
    xmin[both], xmax[both] = -1, +1
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def gptq_pack(W, bits: int, group_size: int, sym: bool, desc_act: bool, v1: bool = True, seed: int = 0):
    """A torch Linear weight W [out, in] -> GPTQ tensors {qweight, qzeros, scales, g_idx} as GPTQModel
    writes them: codes and scales per group from find_params (RTN: GPTQ's error feedback chooses other
    codes, in the same layout), g_idx from the activation order (desc_act: a random permutation stands
    for argsort(diag(H)); group i // g of the permuted order), packed by
    gptqmodel/nn_modules/qlinear/__init__.py PackableQuantLinear.pack_original, and v1's zeros
    converted by gptqmodel/utils/model.py convert_gptq_v2_to_v1_format_module (qzeros -= 0x11111111)."""
    import torch
    out_f, in_f = W.shape
    g = in_f if group_size == -1 else group_size
    maxq = 2 ** bits - 1
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // g
    scales, zeros = torch.zeros(out_f, in_f // g), torch.zeros(out_f, in_f // g)
    for grp in range(in_f // g):
        s, z = _gptq_find_params(W[:, g_idx == grp], bits, sym)
        scales[:, grp], zeros[:, grp] = s, z
    scales = scales.half().float()          # as stored (fp16), so that the codes below round on them
    # --- pack_original, line by line (pack_dtype int32, bits in [2, 4, 8]) ---
    scales_t = scales.T.contiguous()
    zeros_t = zeros.T.contiguous()
    scale_zeros = zeros_t * scales_t
    gi = g_idx.long()
    int_weight = torch.round((W + scale_zeros[gi].T) / scales_t[gi].T)
    int_weight.clamp_(0, maxq)
    int_weight = int_weight.to(torch.int32).T.contiguous()
    int_weight = int_weight.numpy().astype(np.uint32)
    pack_factor = 32 // bits
    qweight = np.zeros((int(np.ceil(int_weight.shape[0] * bits / 32)), int_weight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(pack_factor):
            qweight[row] |= int_weight[row * pack_factor + j] << (bits * j)
    zeros_np = zeros_t.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros_np.shape[0], int(np.ceil(zeros_np.shape[1] * bits / 32))), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(pack_factor):
            qzeros[:, col] |= zeros_np[:, col * pack_factor + j] << (bits * j)
    if v1:   # convert_gptq_v2_to_v1_format_module: the whole word, modulo 2^32
        qzeros = (qzeros.astype(np.int64) - {4: 0x11111111, 8: 0x01010101}[bits]) & 0xFFFFFFFF
    return {"qweight": torch.from_numpy(qweight.astype(np.uint32).view(np.int32)),
            "qzeros": torch.from_numpy(qzeros.astype(np.uint32).view(np.int32)),
            "scales": scales_t.half(), "g_idx": g_idx}


def gptq_dequantize(t: dict, bits: int, v1: bool = True):
    """GPTQModel's PackableQuantLinear.dequantize_weight (bits 2/4/8) after its v1 -> v2 zero
    conversion (convert_gptq_v1_to_v2_format_module: qzeros += 0x11111111) -> float W [out, in]."""
    import torch
    maxq, pf = 2 ** bits - 1, 32 // bits
    qzeros = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    if v1:
        qzeros = (qzeros + {4: 0x11111111, 8: 0x01010101}[bits]) & 0xFFFFFFFF
    wf = torch.arange(0, 32, bits, dtype=torch.int64)
    scales = t["scales"].float()
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, pf), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros, maxq).reshape(scales.shape)
    qweight = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    weight = torch.bitwise_and(torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, pf, -1),
                                                         wf.unsqueeze(-1)), maxq)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    gi = t["g_idx"].long()
    return (scales[gi] * (weight - zeros[gi]).float()).T.contiguous()


_GPTQ_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def save_gptq(folder: Path, bits: int, group_size: int, sym: bool, desc_act: bool = False, v1: bool = True,
              seed: int = 0, model=None):
    """A tiny Llama (or `model`) whose linear layers are GPTQ-packed (gptq_pack) -> (folder, reference
    model: the same Llama with GPTQModel's dequantization of the packed tensors as its weights)."""
    import torch
    from safetensors.torch import save_file

    model = tiny_llama(seed) if model is None else model
    if not sym:   # a few all-positive groups: zero point 0, which v1 stores as -1 (a borrow from the next code)
        with torch.no_grad():
            for i in range(model.config.num_hidden_layers):
                w = model.get_submodule(f"model.layers.{i}.mlp.up_proj").weight
                w[:5, :] = w[:5, :].abs()
    ref = copy.deepcopy(model)
    model.save_pretrained(folder)
    state = _float_state(model)
    for i in range(model.config.num_hidden_layers):
        for j, m in enumerate(_GPTQ_MODULES):
            name = f"model.layers.{i}.{m}"
            # desc_act: one activation order per input (q/k/v share one, gate/up one), as GPTQ's
            # argsort of the shared Hessian's diagonal gives them
            shared = {"self_attn.k_proj": 0, "self_attn.v_proj": 0, "mlp.up_proj": 4}.get(m, j)
            t = gptq_pack(state.pop(f"{name}.weight").float(), bits, group_size, sym, desc_act, v1,
                          seed=7 * i + shared)
            state.update({f"{name}.{k}": v for k, v in t.items()})
            with torch.no_grad():
                ref.get_submodule(name).weight.copy_(gptq_dequantize(t, bits, v1))
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                                  "desc_act": desc_act, "checkpoint_format": "gptq" if v1 else "gptq_v2",
                                  "damp_percent": 0.05, "true_sequential": True, "static_groups": False,
                                  "pack_dtype": "int32", "lm_head": False,
                                  "meta": {"quantizer": ["jaxinfer tests"]}}
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    return Path(folder), ref


# -------------------------------------------------------------------------------------------- AWQ

def awq_pack(W, group_size: int):
    """W [out, in] -> AWQ gemm tensors: AutoAWQ awq/quantize/quantizer.py pseudo_quantize_tensor
    (zero_point=True: per group max / min, scales = (max - min).clamp(min=1e-5) / 15, zeros =
    (-round(min / scales)).clamp(0, 15)), scales rounded to fp16 first so the codes stay in range,
    then awq/modules/linear/gemm.py WQLinear_GEMM.from_linear, line by line."""
    import torch
    out_f, in_f = W.shape
    g = in_f if group_size == -1 else group_size
    w = W.reshape(-1, g)
    max_val, min_val = w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True)
    scales = ((max_val - min_val).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    scales = scales.view(out_f, -1).T.contiguous()          # [in / g, out], as from_linear takes them
    zeros = zeros.view(out_f, -1).T.contiguous()
    # --- WQLinear_GEMM.from_linear ---
    scale_zeros = zeros * scales
    awq_scales = scales.clone().half()
    pack_num = 8
    intweight = []
    for idx in range(in_f):
        intweight.append(torch.round((W[:, idx] + scale_zeros[idx // g]) / awq_scales[idx // g]).to(torch.int)[:, None])
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.to(dtype=torch.int32)
    intweight = intweight.clamp(0, 15)       # pseudo_quantize_tensor's clamp, which the packed codes came through
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * 4), dtype=torch.int32)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * 4)
    zeros = zeros.to(dtype=torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": awq_scales}


def awq_dequantize(t: dict, group_size: int):
    """AutoAWQ awq/utils/packing_utils.py dequantize_gemm (unpack_awq, reverse_awq_order), line by
    line -> float W [out, in]."""
    import torch
    bits = 4
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(t["qweight"][:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(t["qzeros"][:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse = torch.arange(izeros.shape[-1], dtype=torch.int32).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    izeros, iweights = izeros[:, reverse], iweights[:, reverse]
    iweights = torch.bitwise_and(iweights, 15)
    izeros = torch.bitwise_and(izeros, 15)
    g = iweights.shape[0] if group_size == -1 else group_size
    scales = t["scales"].float().repeat_interleave(g, dim=0)
    izeros = izeros.repeat_interleave(g, dim=0)
    return ((iweights - izeros).float() * scales).T.contiguous()


def save_awq(folder: Path, group_size: int, seed: int = 0, version: str = "gemm"):
    import torch
    from safetensors.torch import save_file

    model = tiny_llama(seed)
    ref = copy.deepcopy(model)
    model.save_pretrained(folder)
    state = _float_state(model)
    for i in range(model.config.num_hidden_layers):
        for m in _GPTQ_MODULES:
            name = f"model.layers.{i}.{m}"
            t = awq_pack(state.pop(f"{name}.weight").float(), group_size)
            state.update({f"{name}.{k}": v for k, v in t.items()})
            with torch.no_grad():
                ref.get_submodule(name).weight.copy_(awq_dequantize(t, group_size))
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                  "version": version, "modules_to_not_convert": None}
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    return Path(folder), ref


# ------------------------------------------------------------------------------- fine-grained FP8

def save_fp8_block(folder: Path, block=(32, 32), seed: int = 0):
    """A tiny Llama whose linear layers are quantized by transformers' own FineGrainedFP8 quantizer
    (integrations/finegrained_fp8.py Fp8Quantize._quantize_one: per [bn, bk] block max|w| / 448,
    e4m3 codes, weight_scale_inv) with a quantization_config as transformers writes it -> (folder,
    float model). Blocks of 32: the tiny dims are not multiples of 128, which Fp8Quantize skips."""
    model = tiny_llama(seed)
    model.save_pretrained(folder)
    names = [f"model.layers.{i}.{m}.weight" for i in range(model.config.num_hidden_layers) for m in _GPTQ_MODULES]
    _write_fp8_block(Path(folder), _float_state(model), names, block)
    return Path(folder), model


def save_fp8_per_tensor(folder: Path, seed: int = 0):
    """A tiny Llama in per-tensor FP8 with static activation scales, as Ministral 3's / Devstral 2's
    uploads store it (transformers' FP8Linear with no block size: `weight_scale_inv` one multiplier,
    `activation_scale` one scale; quant_method fp8, activation_scheme static, weight_block_size null),
    the weights quantized by transformers' Fp8Quantize -> (folder, float model)."""
    import torch
    model = tiny_llama(seed)
    model.save_pretrained(folder)
    names = [f"model.layers.{i}.{m}.weight" for i in range(model.config.num_hidden_layers) for m in _GPTQ_MODULES]
    state = _float_state(model)
    acts = {n.replace(".weight", ".activation_scale"): torch.tensor(0.05 + 0.01 * i) for i, n in enumerate(names)}
    _write_fp8_block(Path(folder), {**state, **acts}, names, None, activation_scheme="static")
    return Path(folder), model


def _write_fp8_block(folder: Path, state: dict, names: list[str], block, activation_scheme: str = "dynamic") -> None:
    """`state` with the tensors `names` quantized by transformers' Fp8Quantize in blocks `block`
    (None: per tensor), written as the folder's model.safetensors, and the quantization_config
    transformers writes."""
    import types

    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=None if block is None else list(block),
                                  activation_scheme=activation_scheme, modules_to_not_convert=["lm_head"])
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    for name in names:
        state.update(quantize._quantize_one(name, state.pop(name)))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {k: v for k, v in config.to_dict().items() if v is not None or k == "weight_block_size"}
    (folder / "config.json").write_text(json.dumps(cfg))


def save_fp8_block_deepseek(folder: Path, block=(8, 8)):
    """tests/hf_models.py "deepseekv3-mla" (latent attention with a q bottleneck, interleaved RoPE,
    sigmoid-routed experts, a shared expert) in fine-grained FP8 as DeepSeek publishes V3: every
    linear layer of the attention and the MLPs (each routed expert's too, one tensor per expert as
    the published checkpoints store them) quantized by transformers' Fp8Quantize; blocks of 8: the
    tiny dims (24, 32, 64, 16) are multiples of 8 -> (folder, float model)."""
    from safetensors.torch import load_file

    from tests.hf_models import build_hf_model
    model = build_hf_model("deepseekv3-mla")
    model.save_pretrained(folder)
    state = load_file(str(Path(folder) / "model.safetensors"))    # the per-expert names save_pretrained writes
    linear = [n for n in state if n.endswith(("proj.weight", "proj_with_mqa.weight"))]
    _write_fp8_block(Path(folder), state, linear, block)
    return Path(folder), model


def fp8_block_reference(folder: Path):
    """transformers loading the folder on CPU: FineGrainedFP8 dequantizes every weight at load
    (Fp8Dequantize), float32."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------- MXFP4

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, rows, K] float -> (blocks uint8 [E, rows, K/32, 16], scales uint8 [E, rows, K/32]) in the
    OCP MX layout gpt-oss ships (transformers' convert_moe_packed_tensors reads it): per block of 32
    the shared exponent e = ceil(log2(max|w| / 6)) (the largest e2m1 magnitude is 6), stored e + 127,
    each value the nearest e2m1 of w / 2^e (sign bit 3), value 2j in byte j's low nibble."""
    e_, rows, k = w.shape
    blk = w.reshape(e_, rows, k // 32, 32).astype(np.float64)
    amax = np.abs(blk).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    y = blk / np.exp2(exp)[..., None]
    mag = np.abs(np.abs(y)[..., None] - E2M1).argmin(-1)
    code = (mag | np.where(y < 0, 8, 0)).astype(np.uint8)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)


def save_gpt_oss_mxfp4(folder: Path, seed: int = 0, overrides: dict | None = None):
    """A tiny gpt-oss (tests/hf_models.py "gpt-oss", ffn 64 so that both expert matmuls' K is a
    multiple of 32; overrides: more config fields) with its experts in MXFP4 as published -> (folder,
    reference: transformers loading the folder with Mxfp4Config(dequantize=True), its own MXFP4
    dequantization, float32)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tests.hf_models import build_hf_model
    model = build_hf_model("gpt-oss", seed=seed, overrides={"intermediate_size": 64, **(overrides or {})})
    model.save_pretrained(folder)
    state = _float_state(model)
    for i in range(model.config.num_hidden_layers):
        x = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            w = state.pop(f"{x}.{proj}").float().numpy()              # [E, in, out]
            blocks, scales = mxfp4_pack(w.transpose(0, 2, 1))        # rows = out
            state[f"{x}.{proj}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            state[f"{x}.{proj}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    for layer in ref.model.layers:   # as build_hf_model does: the config's clamp, not the class default
        layer.mlp.experts.alpha = getattr(ref.config, "swiglu_alpha", 1.702)
        layer.mlp.experts.limit = ref.config.swiglu_limit
    return Path(folder), ref
