"""`jaxinfer plan`: a capacity planner. Pure arithmetic on a ModelConfig and a device table;
it never imports jax (nor anything that does), so it answers instantly on any machine.

Given a model (an HF config.json or a preset), a device, weight and KV dtypes, a context
length and a TP x PP layout, it reports how the memory splits and what the roofline allows.

Notation: P parameters, L layers, d = d_model, H / H_kv query / KV heads, h = head_dim,
T = context (tokens per sequence), M = memory per device, f = memory fraction,
BW = peak HBM bandwidth per device (bytes/s), F = peak dense FLOP/s per device.

Parameters
    P exact = ModelConfig.num_params(). Shown beside the textbook approximation
    P ~ 12 L d^2 + embeddings (4 d^2 attention + 8 d^2 MLP per layer when H_kv = H and
    ffn = 4d; embeddings = vocab * d, twice when untied). GQA and SwiGLU's ffn ~ 8/3 * 4d
    make the approximation drift by a few percent; the exact count is what everything uses.

Weight bytes (weight-only quantization, the layout of jaxinfer.quant)
    Quantized: every matmul weight of every layer (q, k, v, o; gate, up, down or fc, proj; in a
    mixture-of-experts layer gate, up and down of each of the E experts), as 2-D [K, N] matrices
    (K contracted). Kept at 16 bits (bf16): token embedding, lm_head, norms, biases, learned
    positions, MoE routers.
      bfloat16: 2 B/param everywhere.        float32: 4 B/param everywhere.
      int8:  1 B per matmul param + per-output-channel scale, f32 (4 B) per column N
             (jaxinfer.quant's int8 format).
      int4:  0.5 B per matmul param + one 2-byte scale per group of 128 along K
             (ceil(K/128) * N scales per matrix; GPTQ/AWQ-style fp16/bf16 scales,
             symmetric, so no zero points). Note jaxinfer.quant stores int4 scales as f32;
             set INT4_SCALE_BYTES = 4 to plan for that (+1.6% matmul bytes).

KV cache
    kv_bytes_per_token = 2 (K and V) * bytes(kv_dtype) * L * H_kv * h
      int8 KV adds per-token, per-head f32 scales for K and V: + 2 * 4 * L * H_kv.
    kv_bytes_per_sequence = kv_bytes_per_token * T.
    Latent attention (DeepSeek) stores its one vector per token and layer once (K pages only: the
    attention reads the values from them): bytes(kv_dtype) * L * h (+ one f32 scale), h its width.
    Sliding windows do not shrink it: jaxinfer's paged cache keeps every token's block.

Per-device layout (TP shards heads, PP shards layers)
    per_device_weight_bytes = weight_bytes / (tp * pp)   (an even split; replicated
      embeddings or uneven stages make the real figure a little larger).
    KV heads per device = ceil(H_kv / tp): sharded when H_kv >= tp (H_kv / tp each), else
      each device holds one KV head, replicated tp / H_kv times (as vLLM does).
    Layers per device = ceil(L / pp).
    per_device_kv_bytes_per_token = 2 * bytes(kv) * ceil(L/pp) * ceil(H_kv/tp) * h (+ scales)
    per_device_kv_budget_bytes = M * f - per_device_weight_bytes
    max_sequences = floor(per_device_kv_budget_bytes / (per_device_kv_bytes_per_token * T
                                                        + per_device_state_bytes_per_sequence))
      (the state: ModelConfig.state_bytes_per_slot over pp, bfloat16 inputs; 0 without state layers)
      which, when tp divides H_kv and pp divides L, is the aggregate
      floor((M * f * tp * pp - weight_bytes) / kv_bytes_per_sequence).

Roofline
    B* = F / BW, FLOPs per byte: the arithmetic intensity at the ridge point. F is the bf16
    tensor-core peak for bf16 / int8 / int4 weights (weight-only quantization dequantizes
    into bf16 matmuls, so the int8 tensor-core peak does not apply) and the TF32 peak for
    float32 weights (XLA's default precision for f32 dots on A100/H100).

    Decode at batch 1 is bandwidth-bound: each token reads what jaxinfer.perf's cost model counts
    for a one-token step (model_cost: the engine's live MBU and the benchmarks count the same), W_1 =
    every weight but an untied token-embedding table, plus the one row of it the token gathers (a
    mixture of experts: only its k routed experts of E per MoE layer, the rest of the model whole),
    and the sequence's KV up to each layer's sliding window. With tp devices reading their shards in
    parallel and pp stages in turn:
      decode_tokens_per_s_bs1 = BW / (W_1 / tp + pp * per_device_kv_bytes_per_seq)
                              = BW * tp / (W_1 + kv_bytes_per_sequence)  (even split, no window)
    (T tokens of KV: the end of a full-context sequence, the slowest step; no communication
    cost is counted, so TP > 1 is an upper bound.)

    Batch where decode turns compute-bound. One decode step over B sequences reads the
    weights once, W = P * b bytes (b = weight_bytes / P, bytes per parameter), and does
    2 FLOPs (a multiply and an add) per parameter per token: 2 * P * B FLOPs. Its arithmetic
    intensity is 2 P B / (P b) = 2 B / b FLOPs/byte, which reaches B* when
      B = B* * b / 2   (= compute_bound_batch; B* itself for bf16, B*/4 for int4).
    Ignored: KV reads, which grow with B and have intensity ~1, so the real crossover is
    later (and at long contexts attention stays bandwidth-bound at any batch). TP and PP
    scale F and BW together and leave it unchanged. A mixture of experts routes B k rows over
    E experts, B k / E per expert under balanced routing, so its experts reach B* only at
    B = B* b / 2 * E / k (the figure given for MoE models; attention and dense layers get there
    first).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from jaxinfer import perf
from jaxinfer.config import KV_DTYPE_CHOICES, ModelConfig, RopeScaling
from jaxinfer.models.hf_configs import model_config_from_hf
from jaxinfer.perf import CPU_BANDWIDTH, CPU_FLOPS, DEVICES, DTYPE_BYTES, GiB, KV_INT8_SCALE_BYTES, Device  # noqa: F401

INT4_GROUP_SIZE = 128
INT4_SCALE_BYTES = 4        # one float32 scale per group, as jaxinfer/quant/format.py stores them
INT8_SCALE_BYTES = 4        # one f32 scale per output channel (jaxinfer.quant)

WEIGHT_DTYPES = ("bfloat16", "float32", "int8", "int4")
KV_DTYPES = KV_DTYPE_CHOICES    # the engine's kv_dtype choices, listed once in config.py
_BYTES = DTYPE_BYTES


DEVICE_NAMES = (*DEVICES, "cpu")


def _rope31() -> RopeScaling:
    return RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


def _llama(**kw: Any) -> ModelConfig:
    base = dict(activation="silu", gated_mlp=True, norm="rmsnorm", norm_eps=1e-5, position="rope",
                architecture="LlamaForCausalLM")
    return ModelConfig(**{**base, **kw})


# Published shapes (each model's config.json on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                         ffn_dim=11008, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-2-13b": _llama(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128,
                          ffn_dim=13824, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-2-70b": _llama(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                          ffn_dim=28672, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.1-8b": _llama(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn_dim=14336, max_position_embeddings=131072, rope_theta=500000.0,
                           rope_scaling=_rope31(), bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3.1-70b": _llama(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                            ffn_dim=28672, max_position_embeddings=131072, rope_theta=500000.0,
                            rope_scaling=_rope31(), bos_token_id=128000, eos_token_ids=(128001,)),
    "mistral-7b": _llama(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         ffn_dim=14336, max_position_embeddings=32768, sliding_window=4096,
                         bos_token_id=1, eos_token_ids=(2,), architecture="MistralForCausalLM"),
    "qwen2-7b": _llama(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                       ffn_dim=18944, max_position_embeddings=131072, rope_theta=1000000.0, norm_eps=1e-6,
                       qkv_bias=True, bos_token_id=151643, eos_token_ids=(151643,),
                       architecture="Qwen2ForCausalLM"),
    # mixtures of experts
    "mixtral-8x7b": _llama(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn_dim=14336, max_position_embeddings=32768, rope_theta=1e6, num_experts=8,
                           num_experts_per_tok=2, bos_token_id=1, eos_token_ids=(2,),
                           architecture="MixtralForCausalLM"),
    "qwen3-30b-a3b": _llama(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                            ffn_dim=6144, moe_ffn_dim=768, max_position_embeddings=40960, rope_theta=1e6, norm_eps=1e-6,
                            qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_routing="softmax_topk",
                            moe_norm_topk=True, bos_token_id=151643, eos_token_ids=(151645,),
                            architecture="Qwen3MoeForCausalLM"),
    "gpt-oss-20b": _llama(vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
                          ffn_dim=2880, max_position_embeddings=131072, rope_theta=150000.0,
                          rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096,
                                                   attention_factor=0.1 * math.log(32.0) + 1.0, truncate=False),
                          sliding_window=128, sliding_layers=tuple(i % 2 == 0 for i in range(24)),
                          qkv_bias=True, out_bias=True, mlp_bias=True, attn_sinks=True, num_experts=32,
                          num_experts_per_tok=4, router_bias=True, swiglu_limit=7.0, eos_token_ids=(200002,),
                          architecture="GptOssForCausalLM"),
    # latent attention (its KV: one 576-feature vector a token and layer)
    "deepseek-v3": model_config_from_hf({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "rope_theta": 10000}),
    "deepseek-v2-lite": model_config_from_hf({
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "topk_method": "greedy", "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "bos_token_id": 100000, "eos_token_id": 100001,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}, "rope_theta": 10000}),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    return PRESETS[name]


def _os_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise ValueError("cannot read this host's memory size; pass --memory-gib") from None


def get_device(name: str, memory_gib: float | None = None) -> Device:
    """The device table entry; memory_gib (GiB per device) overrides the capacity."""
    if name not in DEVICE_NAMES:
        raise ValueError(f"unknown device {name!r}; choose from: {', '.join(DEVICE_NAMES)}")
    if memory_gib is not None and not memory_gib > 0:
        raise ValueError(f"--memory-gib must be > 0, got {memory_gib}")
    mem = None if memory_gib is None else int(memory_gib * GiB)
    given = (f"memory {memory_gib:g} GiB per device is from --memory-gib",) if mem else ()
    if name == "cpu":
        cpu = perf.host_cpu_device(mem or _os_memory_bytes())
        return dataclasses.replace(cpu, assumed=cpu.assumed + given,
                                   source="memory: os.sysconf (or --memory-gib); bandwidth, FLOP/s: assumed")
    dev = DEVICES[name]
    return dev if mem is None else dataclasses.replace(dev, memory_bytes=mem, assumed=given)


def approx_params(cfg: ModelConfig) -> int:
    """12 L d^2 + embeddings (token embedding, lm_head when untied, learned positions)."""
    emb = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    emb += cfg.max_position_embeddings * cfg.d_model if cfg.position == "learned" else 0
    return 12 * cfg.n_layers * cfg.d_model**2 + emb


def layer_matmul_shapes(cfg: ModelConfig, layer: int = 0) -> list[tuple[int, int]]:
    """[K, N] (contracted, output) of each quantizable matmul weight in one layer (an MoE layer:
    its shared experts' gate, up and down, then each expert's, num_experts times over; latent
    attention: o alone, its latent projections stay float as quantize_decoder leaves them)."""
    d, hd = cfg.d_model, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    attn = [(cfg.n_heads * cfg.mla_v_dim, d)] if cfg.mla else [(d, q), (d, kv), (d, kv), (q, d)]
    attn += [(d, q)] if cfg.attn_out_gate else []   # AFMoE's gate: q's shape
    if cfg.is_conv_layer(layer):   # LFM2's in_proj and out_proj (its taps stay float)
        attn = [(d, 3 * d), (d, d)]
    if cfg.has_state_matrix(layer):   # a Gated DeltaNet's (or Mamba-2's) in_proj_qkv, in_proj_z and out_proj
        vd = cfg.linear_v_heads * cfg.linear_v_dim
        attn = [(d, cfg.linear_conv_dim), (d, vd), (vd, d)]
    if not cfg.has_mixer(layer):   # (Nemotron-H's MLP layers after another)
        attn = []
    if not cfg.has_mlp(layer):   # (Nemotron-H's mixers without an MLP after them)
        return attn
    if cfg.is_moe_layer(layer):
        s = cfg.moe_shared_ffn_dim
        return attn + (_mlp_shapes(cfg, s) if s else []) + _mlp_shapes(cfg, cfg.expert_ffn_dim) * cfg.num_experts
    return attn + _mlp_shapes(cfg, cfg.ffn_dim)


def _mlp_shapes(cfg: ModelConfig, f: int) -> list[tuple[int, int]]:
    """One MLP of hidden size f (a dense MLP, shared experts or one expert): gate, up, down, or up, down."""
    d = cfg.d_model
    return [(d, f), (d, f), (f, d)] if cfg.gated_mlp else [(d, f), (f, d)]


def _matmul_bytes(shapes: list[tuple[int, int]], dtype: str) -> tuple[int, int]:
    """(codes or float bytes, scale bytes) of these [K, N] matrices stored as `dtype`."""
    if dtype in ("bfloat16", "float32"):
        return sum(k * n for k, n in shapes) * _BYTES[dtype], 0
    if dtype == "int8":
        return sum(k * n for k, n in shapes), sum(n for _, n in shapes) * INT8_SCALE_BYTES
    packed = sum(math.ceil(k / 2) * n for k, n in shapes)       # two 4-bit values per byte along K
    return packed, sum(math.ceil(k / INT4_GROUP_SIZE) * n for k, n in shapes) * INT4_SCALE_BYTES


def weight_bytes(cfg: ModelConfig, dtype: str) -> dict[str, int]:
    """{"matmul", "scales", "other", "total"} bytes of all weights stored as `dtype`, and "active":
    what one token reads (an MoE layer's k routed experts of E; the total for a dense model)."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {dtype!r}; choose from: {', '.join(WEIGHT_DTYPES)}")
    shapes = [s for i in range(cfg.n_layers) for s in layer_matmul_shapes(cfg, i)]
    n_other = cfg.num_params() - sum(k * n for k, n in shapes)
    matmul, scales = _matmul_bytes(shapes, dtype)
    out = {"matmul": matmul, "scales": scales, "other": n_other * _other_bytes(dtype)}
    out["total"] = out["matmul"] + out["scales"] + out["other"]
    c = cfg.param_counts()
    unrouted = c["moe_layers"] * (cfg.num_experts - cfg.num_experts_per_tok)
    out["active"] = out["total"] - unrouted * _expert_bytes(cfg, dtype)
    return out


def _other_bytes(dtype: str) -> float:
    """Bytes per parameter of what stays unquantized (embeddings, norms, biases: 16 bits under int8 / int4)."""
    return _BYTES[dtype] if dtype in ("bfloat16", "float32") else 2


def _expert_bytes(cfg: ModelConfig, dtype: str) -> int:
    """One expert of one MoE layer: gate (where gated), up and down as `dtype` (+ their biases, unquantized)."""
    f, d = cfg.expert_ffn_dim, cfg.d_model
    biases = ((2 if cfg.gated_mlp else 1) * f + d) * _other_bytes(dtype) if cfg.mlp_bias else 0
    return sum(_matmul_bytes(_mlp_shapes(cfg, f), dtype)) + biases


def model_cost(cfg: ModelConfig, dtype: str = "bfloat16", kv_dtype: str | None = None) -> perf.ModelCost:
    """The cost model (jaxinfer.perf) of this model with weights stored as `dtype` and KV pages as
    kv_dtype (None: dtype for float weights, else bfloat16): what the engine and the benchmarks count
    for the same model loaded that way."""
    kv_dtype = kv_dtype or (dtype if dtype in ("bfloat16", "float32") else "bfloat16")
    c, other = cfg.param_counts(), _other_bytes(dtype)
    untied = 1 if c["lm_head"] else 0
    weights = perf.WeightBytes(
        weight_bytes(cfg, dtype)["total"], round((untied * c["embedding"] + c["positions"]) * other),
        round((untied + (1 if c["positions"] else 0)) * cfg.d_model * other),
        c["moe_layers"] * cfg.num_experts * _expert_bytes(cfg, dtype))
    return perf.ModelCost.build(cfg, weights, kv_bytes_per_token(cfg, kv_dtype),
                                cfg.state_bytes_per_slot(4 if dtype == "float32" else 2))


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, *, layers: int | None = None,
                       kv_heads: int | None = None) -> int:
    """2 * bytes(kv_dtype) * layers * kv_heads * head_dim (+ int8 scales), latent attention's K pages
    alone (kv_value_dim 0); default: the whole model."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose from: {', '.join(KV_DTYPES)}")
    return perf.kv_bytes_per_token(cfg.n_attn_layers if layers is None else layers,
                                   cfg.n_kv_heads if kv_heads is None else kv_heads, cfg.head_dim, kv_dtype,
                                   cfg.kv_value_dim)


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    architecture: str
    device: str
    device_label: str
    device_source: str
    dtype: str
    kv_dtype: str
    context: int
    tp: int
    pp: int
    memory_fraction: float
    params: int
    params_approx: int
    weight_bytes: int
    weight_bytes_breakdown: dict[str, int]
    bytes_per_param: float
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_sharding: str                    # "sharded" | "replicated" (over tp)
    per_device_memory_bytes: int
    per_device_usable_bytes: int
    per_device_weight_bytes: int
    per_device_kv_bytes_per_token: int
    per_device_kv_bytes_per_sequence: int
    per_device_state_bytes_per_sequence: int   # conv / Gated DeltaNet / Mamba-2 layers' per-sequence state (else 0)
    per_device_kv_budget_bytes: int
    max_sequences: int
    max_kv_tokens: int
    peak_flops: float
    peak_flops_kind: str
    bandwidth: float
    b_star: float
    compute_bound_batch: float
    decode_tokens_per_s_bs1: float
    decode_ms_per_token_bs1: float
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["assumptions"], d["warnings"] = list(self.assumptions), list(self.warnings)
        return d


def _check_layout(cfg: ModelConfig, context: int, tp: int, pp: int, memory_fraction: float) -> list[str]:
    """Raise ValueError naming every impossible setting; return warnings for layouts engines refuse."""
    problems = []
    if not (isinstance(tp, int) and tp >= 1):
        problems.append(f"tp must be an integer >= 1, got {tp!r}")
    if not (isinstance(pp, int) and 1 <= pp <= cfg.n_layers):
        problems.append(f"pp must be an integer in [1, n_layers={cfg.n_layers}], got {pp!r}")
    if not (isinstance(context, int) and context >= 1):
        problems.append(f"context must be an integer >= 1, got {context!r}")
    if not 0 < memory_fraction <= 1:
        problems.append(f"memory fraction must be in (0, 1], got {memory_fraction!r}")
    if problems:
        raise ValueError("; ".join(problems))
    warnings = []
    if context > cfg.max_position_embeddings:
        warnings.append(f"context {context} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    if cfg.attention_chunk is not None and context > cfg.attention_chunk:
        warnings.append(f"context {context} exceeds one attention chunk ({cfg.attention_chunk}, Llama 4's "
                        "attention_chunk_size); engines refuse a longer max_model_len")
    if cfg.n_heads % tp:
        warnings.append(f"tp={tp} does not divide n_heads={cfg.n_heads}; engines reject this layout")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        warnings.append(f"tp={tp} and n_kv_heads={cfg.n_kv_heads} do not divide one another")
    if cfg.n_layers % pp:
        warnings.append(f"pp={pp} does not divide n_layers={cfg.n_layers}; the largest stage sets the KV figures")
    return warnings


def _memory(cfg: ModelConfig, device: Device, total_weight_bytes: int, kv_dtype: str, context: int, tp: int, pp: int,
            memory_fraction: float, warnings: list[str]) -> dict[str, Any]:
    """Per-device weights, KV per token and budget, and how many sequences fit (appends warnings)."""
    dev_kv_tok = kv_bytes_per_token(cfg, kv_dtype, layers=math.ceil(cfg.n_attn_layers / pp),   # (conv layers: none)
                                    kv_heads=math.ceil(cfg.n_kv_heads / tp))
    dev_weights = math.ceil(total_weight_bytes / (tp * pp))
    usable = int(device.memory_bytes * memory_fraction)
    budget = usable - dev_weights
    if budget <= 0:
        warnings.append(f"weights ({dev_weights / GiB:.2f} GiB per device) do not fit in "
                        f"{usable / GiB:.2f} GiB usable; raise tp/pp or quantize")
    # the state layers' state of a sequence (LFM2's conv inputs, Qwen3.5's float32 matrices; bfloat16 inputs)
    state = math.ceil(cfg.state_bytes_per_slot(2) / pp)
    max_seqs = max(0, budget // (dev_kv_tok * context + state))
    if 0 < budget and max_seqs == 0:
        warnings.append(f"not one sequence of {context} tokens fits in the KV budget; lower --context")
    return dict(per_device_memory_bytes=device.memory_bytes, per_device_usable_bytes=usable,
                per_device_weight_bytes=dev_weights, per_device_kv_bytes_per_token=dev_kv_tok,
                per_device_kv_bytes_per_sequence=dev_kv_tok * context, per_device_state_bytes_per_sequence=state,
                per_device_kv_budget_bytes=budget,
                max_sequences=max_seqs, max_kv_tokens=max(0, budget // dev_kv_tok))


def _roofline(cfg: ModelConfig, device: Device, cost: perf.ModelCost, dtype: str, bytes_per_param: float,
              dev_kv_tok: int, context: int, tp: int, pp: int) -> dict[str, Any]:
    """Ridge point, compute-bound batch and batch-1 decode speed. Batch 1: the weights one token reads
    (perf.ModelCost: every weight but the token table, one row of it, k experts per MoE layer) split
    over tp, and the sequence's KV up to each layer's window, stage after stage over pp."""
    flops = device.peak_flops(dtype)
    b_star = flops / device.bandwidth
    per_layer_kv = dev_kv_tok / math.ceil(cfg.n_attn_layers / pp)
    step_bytes_bs1 = perf.bytes_read(cost.iteration_weight_bytes(1) / tp, per_layer_kv, cost.layer_context([context]))
    tok_s = device.bandwidth / step_bytes_bs1
    return dict(peak_flops=flops, peak_flops_kind="tf32" if dtype == "float32" else "bf16",
                bandwidth=device.bandwidth, b_star=b_star,
                compute_bound_batch=perf.compute_bound_tokens(device, dtype, bytes_per_param, cfg),
                decode_tokens_per_s_bs1=tok_s, decode_ms_per_token_bs1=1e3 / tok_s)


def _assumptions(cfg: ModelConfig, device: Device, wb: dict[str, int], dtype: str, kv_dtype: str) -> tuple[str, ...]:
    assumptions = [
        "weights split evenly over tp*pp devices; no activation, workspace or communication memory "
        "beyond what --memory-fraction leaves",
        "decode at batch 1 streams every weight but the token-embedding table (one row of it) and one "
        "full-context sequence's KV per token at peak bandwidth",
    ]
    if dtype in ("int8", "int4"):
        assumptions.append("token embedding, lm_head, norms and biases stay bfloat16; " + (
            "int8: per-output-channel f32 scales" if dtype == "int8" else
            f"int4: one {INT4_SCALE_BYTES}-byte scale per group of {INT4_GROUP_SIZE} (symmetric, no zero points)"))
    if kv_dtype in ("int8", "fp8"):
        assumptions.append(f"{kv_dtype} KV: one f32 scale per token per KV head, for K and for V")
    if cfg.sliding_window is not None:
        assumptions.append(f"sliding window {cfg.sliding_window}: the paged cache keeps every token (memory), "
                           "attention reads the window (decode speed)")
    if cfg.num_experts:
        assumptions.append(f"mixture of experts: a batch-1 token reads {cfg.num_experts_per_tok} of {cfg.num_experts} "
                           f"experts per MoE layer ({wb['active'] / GiB:.2f} GiB of {wb['total'] / GiB:.2f} GiB); "
                           "compute-bound batch scaled by E / k (balanced routing)")
    return tuple(assumptions) + device.assumed


def plan(cfg: ModelConfig, device: Device, *, dtype: str = "bfloat16", kv_dtype: str | None = None,
         context: int | None = None, tp: int = 1, pp: int = 1, memory_fraction: float = 0.9,
         model_name: str | None = None) -> CapacityPlan:
    """The capacity plan; formulas in the module docstring. kv_dtype None: dtype if it is a
    float type, else bfloat16. context None: the model's max_position_embeddings."""
    kv_dtype = kv_dtype or (dtype if dtype in ("bfloat16", "float32") else "bfloat16")
    context = cfg.max_position_embeddings if context is None else context
    warnings = _check_layout(cfg, context, tp, pp, memory_fraction)
    wb = weight_bytes(cfg, dtype)
    params = cfg.num_params()
    kv_tok = kv_bytes_per_token(cfg, kv_dtype)
    memory = _memory(cfg, device, wb["total"], kv_dtype, context, tp, pp, memory_fraction, warnings)
    roofline = _roofline(cfg, device, model_cost(cfg, dtype, kv_dtype), dtype, wb["total"] / params,
                         memory["per_device_kv_bytes_per_token"], context, tp, pp)
    return CapacityPlan(
        model=model_name or cfg.architecture, architecture=cfg.architecture, device=device.name,
        device_label=device.label, device_source=device.source, dtype=dtype, kv_dtype=kv_dtype,
        context=context, tp=tp, pp=pp, memory_fraction=memory_fraction, params=params,
        params_approx=approx_params(cfg), weight_bytes=wb["total"], weight_bytes_breakdown=wb,
        bytes_per_param=wb["total"] / params, kv_bytes_per_token=kv_tok, kv_bytes_per_sequence=kv_tok * context,
        kv_sharding="sharded" if cfg.n_kv_heads >= tp else "replicated", **memory, **roofline,
        assumptions=_assumptions(cfg, device, wb, dtype, kv_dtype), warnings=tuple(warnings))


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_plan(p: CapacityPlan) -> str:
    """The human-readable report."""
    n_dev = p.tp * p.pp
    wb = p.weight_bytes_breakdown
    approx_err = (p.params_approx - p.params) / p.params * 100
    lines = [
        f"{p.model} on {n_dev} x {p.device_label} (tp={p.tp}, pp={p.pp}); weights {p.dtype}, "
        f"KV {p.kv_dtype}, context {p.context:,} tokens",
        "",
        f"parameters        {p.params:,} exact   (12*L*d^2 + embeddings ~ {p.params_approx:,}, {approx_err:+.1f}%)",
        f"weights           {_gib(p.weight_bytes)} = matmul {_gib(wb['matmul'])} + scales {_gib(wb['scales'])}"
        f" + other {_gib(wb['other'])}   ({p.bytes_per_param:.3f} B/param)",
        f"KV cache          {p.kv_bytes_per_token:,} B/token, {_gib(p.kv_bytes_per_sequence)} per sequence "
        f"of {p.context:,} tokens",
        "",
        f"per device        memory {_gib(p.per_device_memory_bytes)} x {p.memory_fraction} = "
        f"{_gib(p.per_device_usable_bytes)} usable",
        f"                  weights {_gib(p.per_device_weight_bytes)} (/ tp*pp = {n_dev})",
        f"                  KV budget {_gib(p.per_device_kv_budget_bytes)}; KV {p.kv_sharding} over tp: "
        f"{p.per_device_kv_bytes_per_token:,} B/token, {_gib(p.per_device_kv_bytes_per_sequence)} per sequence",
        *([f"                  + state {_gib(p.per_device_state_bytes_per_sequence)} per sequence (conv / Gated "
            "DeltaNet / Mamba-2 layers)"] if p.per_device_state_bytes_per_sequence else []),
        f"capacity          {p.max_sequences:,} sequences of {p.context:,} tokens "
        f"({p.max_kv_tokens:,} KV tokens in all)",
        "",
        f"B* (ridge point)  {p.peak_flops / 1e12:,.1f} TFLOP/s {p.peak_flops_kind} / {p.bandwidth / 1e12:.3f} TB/s "
        f"= {p.b_star:.1f} FLOP/byte",
        f"compute-bound at  batch ~ {p.compute_bound_batch:.0f}   "
        f"(B* x {p.bytes_per_param:.3f} B/param / 2 FLOP/param)",
        f"decode, batch 1   ~ {p.decode_tokens_per_s_bs1:,.1f} tok/s ({p.decode_ms_per_token_bs1:.2f} ms/token), "
        "bandwidth-bound",
    ]
    lines += ["", f"device figures: {p.device_source}", "assumptions:"] + [f"  - {a}" for a in p.assumptions]
    if p.warnings:
        lines += ["warnings:"] + [f"  ! {w}" for w in p.warnings]
    return "\n".join(lines)


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `jaxinfer plan` on an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="capacity planner: memory, max sequences, roofline (no jax)",
                              description="Estimate weight and KV memory, how many sequences fit and the "
                                          "bandwidth/compute roofline for a model on a device.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", default=None, help="an HF config.json (or its folder)")
    src.add_argument("--preset", default=None, choices=list(PRESETS), help="a built-in model shape")
    p.add_argument("--device", default="h100", choices=list(DEVICE_NAMES))
    p.add_argument("--memory-gib", type=float, default=None, help="memory per device in GiB (overrides the table)")
    p.add_argument("--dtype", default="bfloat16", choices=list(WEIGHT_DTYPES), help="weight storage")
    p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                   help="default: --dtype for float weights, else bfloat16")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's max)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    if args.preset is not None:
        cfg, name = get_preset(args.preset), args.preset
    else:
        from jaxinfer.models.hf_configs import model_config_from_hf
        cfg, name = model_config_from_hf(args.config), str(args.config)
    result = plan(cfg, get_device(args.device, args.memory_gib), dtype=args.dtype, kv_dtype=args.kv_dtype,
                  context=args.context, tp=args.tp, pp=args.pp, memory_fraction=args.memory_fraction,
                  model_name=name)
    print(json.dumps(result.to_dict()) if args.json else format_plan(result))
    return 0
