"""The model's architecture: ModelConfig (every supported family's fields) and RopeScaling.

A Hugging Face config.json becomes a ModelConfig in jaxinfer/models/hf_configs.py
(model_config_from_hf), the only place that knows how each supported family spells things; the
model code reads ModelConfig only. Never imports jax.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

# The longest context a config may declare (Llama 4 Scout declares 10M): beyond it a config is a typo.
MAX_POSITIONS = 1 << 24


class ConfigError(ValueError):
    """A config.json (or a user-supplied setting) that we cannot honour; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "linear" (positions / factor), "llama3" (Llama 3.1 wavelength
    bands), "longrope" (Phi-3: one divisor per frequency, long_factor where use_long_factor, else
    short_factor; cos and sin scaled by attention_factor) or "yarn" (YaRN: frequencies blended
    between interpolated (/ factor) and original over the band beta_fast .. beta_slow rotations in
    original_max_position_embeddings, the band's edges rounded outwards when truncate; cos and sin
    scaled by attention_factor)."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    use_long_factor: bool = False
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


# ModelConfig's fields that must be numbers
_FLOATS = ("norm_eps", "rope_theta", "embed_scale", "swiglu_alpha", "residual_scale", "logits_scaling",
           "moe_routed_scale", "moe_router_jitter", "moe_norm_eps")
# the norm kinds (layers.NORM_KINDS, which this jax-free module cannot import)
NORMS = ("rmsnorm", "gemma_rmsnorm", "olmo_rmsnorm", "layernorm", "layernorm_nobias", "layernorm1p",
         "layernorm_noparam")


def _differs(value: Any, default: Any) -> bool:
    """Whether a field's value is not its default, for a message: an array (a programmatic caller's
    sliding_layers, say) compares elementwise, so anything but a plain bool counts as different."""
    try:
        d = value != default
    except Exception:   # noqa: BLE001   (a value that cannot be compared is shown)
        return True
    return d if isinstance(d, bool) else True


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One decoder-only transformer. Every supported HF family maps onto these fields
    (jaxinfer/models/hf_configs.py says how each family's config.json spells them, and
    model_config_from_hf reads one)."""
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    activation: str = "silu"            # silu | gelu (erf) | gelu_tanh | relu | relu2 (squared ReLU) | xielu
                                        # (Apertus: xIELU, four scalars per layer, ungated MLPs only)
    gated_mlp: bool = True              # act(x W_gate) * (x W_up) -> W_down; else act(x W_fc) -> W_proj
    norm: str = "rmsnorm"               # rmsnorm | gemma_rmsnorm (scale 1 + w) | olmo_rmsnorm (w times the
                                        # normed float32 value, cast after) | layernorm | layernorm_nobias (Cohere)
                                        # | layernorm1p (Nemotron: scale 1 + w, with bias)
                                        # | layernorm_noparam (OLMo 1: no weight, no bias)
    norm_eps: float = 1e-6
    position: str = "rope"              # rope | alibi | learned | sinusoidal
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # RoPE of the sliding layers (Gemma 3: rope_local_base_freq, no scaling); None: rope_theta and
    # rope_scaling on every layer
    rope_local_theta: float | None = None
    rotary_dim: int | None = None       # features of each head that rotate (partial rotary); None: head_dim
    max_position_embeddings: int = 2048
    sliding_window: int | None = None   # a query at q sees keys k with q - window < k <= q
    # Per layer: True where the sliding window applies (Qwen2 mixes full and windowed layers,
    # Gemma alternates them). None means every layer uses `sliding_window` when it is set.
    sliding_layers: tuple[bool, ...] | None = None
    # Per layer: False where the layer applies no position encoding (SmolLM3's NoPE layers, every
    # no_rope_layer_interval-th); None: every layer rotates
    rope_layers: tuple[bool, ...] | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False               # a `norm` over head_dim of each q and k head before RoPE (Qwen3, Gemma 3)
    qk_norm_after_rope: bool = False    # HunYuan: the q / k norms after RoPE
    post_norms: bool = False            # Gemma: norms of the attention and MLP outputs before each residual add
    pre_norms: bool = True              # False: no norm of a block's input (OLMo 2: post_norms only)
    qk_norm_full: bool = False          # the q / k norms over each token's whole projection (H hd, Hkv hd:
                                        # OLMo 2) instead of over each head
    qk_norm_heads: bool = False         # the q / k norms over each head with weights per head [heads, head_dim]
                                        # (Cohere's use_qk_norm: Command R+)
    attn_scale: float | None = None     # softmax scale of q.k; None: head_dim ** -0.5
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the LM head's logits (Gemma 2 and 3)
    embed_scale: float = 1.0            # token embeddings multiplied by it (Gemma: sqrt(d_model))
    residual_scale: float = 1.0         # each block's attention and MLP outputs multiplied by it before their
                                        # residual add (Granite's residual_multiplier)
    logits_scaling: float = 1.0         # the LM head's logits divided by it (Granite's logits_scaling)
    attn_sinks: bool = False            # gpt-oss: one learned logit per head in every softmax's denominator
    clip_qkv: float | None = None       # OLMo 1: q, k and v clamped to [-clip_qkv, clip_qkv] after their
                                        # projections (and q / k norms)
    attn_out_gate: bool = False         # AFMoE: the heads' outputs times sigmoid(x W_gate), W_gate [d, heads,
                                        # head_dim], before the output projection
    query_log_scale: tuple[float, int] | None = None   # Ministral 3 (transformers' llama_4_scaling_beta):
                                        # (beta, period): each query after RoPE times
                                        # 1 + beta log(1 + floor(position / period))
    qk_rms_after_rope: bool = False     # Llama 4 (use_qk_norm): each q and k head divided by its root mean
                                        # square over head_dim (eps norm_eps, in float32, no weight) after
                                        # RoPE, on the RoPE layers only
    nope_query_scale: tuple[float, int] | None = None   # Llama 4 (attn_temperature_tuning): (attn_scale,
                                        # floor_scale): the queries of the layers without RoPE times
                                        # 1 + attn_scale log(1 + floor((position + 1) / floor_scale)) in float32
    attention_chunk: int | None = None  # Llama 4's attention_chunk_size: its RoPE layers attend within aligned
                                        # chunks of this many positions, which jaxinfer serves up to one chunk
                                        # long (config/resolve.py), where it is plain causal attention
    # LFM2's short-convolution layers: "conv" in layer_kinds (None: every layer attends) replaces the
    # layer's attention by a gated depthwise causal convolution of conv_kernel taps (models/decoder.py
    # ShortConv, with biases where conv_bias), whose last conv_kernel - 1 inputs of each sequence are
    # its state across steps (kv_cache.ConvState, in the sequence's state slot)
    # Qwen3-Next's and Qwen3.5's Gated DeltaNet layers: "linear" in layer_kinds (models/deltanet.py
    # GatedDeltaNet): linear_k_heads query / key heads of linear_k_dim and linear_v_heads value heads of
    # linear_v_dim, after a causal depthwise convolution of conv_kernel taps; each sequence's state is
    # the convolution's last conv_kernel - 1 inputs and one [linear_k_dim, linear_v_dim] matrix per value
    # head (kv_cache.DeltaState)
    # Mamba-2 layers (Granite 4.0-H): "mamba" in layer_kinds (models/mamba2.py Mamba2) on the same
    # fields: linear_v_heads heads of linear_v_dim, linear_k_heads groups of state size linear_k_dim
    # (their B and C), the convolution (biased where conv_bias) over x, B and C, each head's step
    # clamped to ssm_dt_limit (None: unclamped); the state: one [linear_k_dim, linear_v_dim] matrix
    # per head, as a Gated DeltaNet's
    layer_kinds: tuple[str, ...] | None = None
    conv_kernel: int = 0
    conv_bias: bool = False
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    ssm_dt_limit: tuple[float, float] | None = None
    # Nemotron-H's layers are a mixer or an MLP each: a block per mixer, with the MLP that follows it
    # where one does; mlp_layers marks the blocks that have an MLP (None: every block); an MLP layer
    # after another is a block of its own, "mlp" in layer_kinds (no mixer, no KV, no state)
    mlp_layers: tuple[bool, ...] | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): num_experts > 0 replaces the MLP of the layers
    # moe_layers marks (None: every layer) by a router picking num_experts_per_tok experts per token,
    # each a gated MLP of moe_ffn_dim (None: ffn_dim; the dense layers keep ffn_dim), with biases where
    # mlp_bias (ungated, act(x W_up) W_down, where gated_mlp is False: Nemotron 3's squared-ReLU experts). moe_routing: "topk_softmax" (Mixtral, gpt-oss: top-k of the router logits, softmax over
    # the k) or "softmax_topk" (Qwen3-MoE: softmax over all experts, top-k, renormalized over the k when
    # moe_norm_topk). swiglu_limit (gpt-oss): the experts' clamped SwiGLU,
    # (clip(up, -L, L) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, L), instead of act(gate) * up.
    # "sigmoid_topk" (DeepSeek-V3, GLM-4.5): sigmoid of the logits, a learned per-expert correction
    # added for the choice only, the choice limited to the moe_topk_groups best of moe_groups expert
    # groups (a group scored by its two best), the chosen sigmoids renormalized when moe_norm_topk,
    # times moe_routed_scale; "softmax_group_topk" (DeepSeek-V2): softmax over all experts, the choice
    # limited to the moe_topk_groups best groups (a group scored by its best), never renormalized,
    # times moe_routed_scale; "softmax_corrected_topk" (ERNIE 4.5): softmax over all experts, the
    # correction added for the choice only, the chosen probabilities divided by max(their sum, 1e-12);
    # "topk_sigmoid" (Llama 4): the k largest logits, each expert weighted by its logit's sigmoid (in
    # float32, then the model dtype); with moe_scale_inputs the weight multiplies the expert's input
    # rows instead of its output. "sparsemixer" (PhiMoE, top-2): the best logit's expert weighted by its softmax probability among the
    # logits within 2 moe_router_jitter of it (relative), then the same among the others for the second.
    # Shared experts (Qwen2-MoE, DeepSeek, GLM-4.5, ERNIE 4.5): a dense (gated_mlp: gated) MLP of moe_shared_ffn_dim
    # beside the routed experts of every MoE layer, its output added (Qwen2-MoE: times sigmoid(x . w) of
    # a learned [d_model] gate when moe_shared_gate).
    # Multi-head latent attention (DeepSeek-V3, Kimi K2; mla_kv_rank > 0): each token caches one latent
    # vector of mla_kv_rank features (normed) and mla_rope_dim RoPE'd key features shared by every head:
    # the KV pages hold it as one KV head of head_dim = mla_kv_rank + mla_rope_dim, in the K pages only
    # (the values are its first mla_kv_rank features: kv_value_dim 0, no V pages). Queries come from
    # x (or a mla_q_rank-wide normed bottleneck when mla_q_rank > 0): mla_nope_dim + mla_rope_dim per
    # head; the up-projection to each head's keys is folded into the query, the one to its values
    # (mla_v_dim) applied after attention (models/mla.py).
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_nope_dim: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0
    mla_rope_interleave: bool = False   # the checkpoint's RoPE features in pairs (hf_maps de-interleaves them)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_ffn_dim: int | None = None
    moe_layers: tuple[bool, ...] | None = None
    moe_routing: str = "topk_softmax"
    moe_norm_topk: bool = True
    router_bias: bool = False
    moe_router_fp32: bool = False       # HunYuan MoE: the router float32 whatever the dtype, as transformers
                                        # keeps it (sigmoid_topk and the group routings always are: moe.py),
    moe_router_in_dtype: bool = False   # except AFMoE's: its sigmoid_topk router's logits in the model dtype
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0
    moe_router_jitter: float = 0.0      # "sparsemixer"'s (PhiMoE) relative margin (router_jitter_noise)
    moe_shared_ffn_dim: int = 0
    moe_shared_gate: bool = False
    moe_scale_inputs: bool = False
    moe_norm_eps: float = 1e-20         # sigmoid_topk's renormalization: the chosen scores over their sum + this
    moe_scores_in_dtype: bool = False   # LFM2-MoE: sigmoid_topk's scores, renormalization and scale rounded to
                                        # the router's dtype (with moe_router_in_dtype: the model's)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    tie_embeddings: bool = False
    lm_head_bias: bool = False          # Phi-1 / 1.5 / 2: a bias [vocab] added to the LM head's logits
    embed_norm: bool = False            # BLOOM: LayerNorm right after the token embedding
    residual_post_norm: bool = False    # BLOOM's apply_residual_connection_post_layernorm
    parallel_block: bool = False        # Cohere: x + attn(norm(x)) + mlp(norm(x)), one norm per block
    parallel_mlp_norm: bool = False     # GPT-NeoX: the parallel block's MLP reads its own norm,
                                        # mlp(mlp_norm(x)) + attn(attn_norm(x)) + x
    parallel_sum_first: bool = False    # GPT-NeoX, Phi: the parallel block adds its branches, then x:
                                        # (attn + mlp) + x, not (x + attn) + mlp (Cohere, StableLM)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        ints = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_groups", "moe_topk_groups",
                "moe_shared_ffn_dim", "mla_kv_rank", "mla_q_rank", "mla_nope_dim", "mla_rope_dim", "mla_v_dim",
                "conv_kernel", "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim")
        optional = {"sliding_window": _is_int, "rotary_dim": _is_int, "rope_local_theta": _is_number,
                    "attn_scale": _is_number, "attn_softcap": _is_number, "final_softcap": _is_number,
                    "moe_ffn_dim": _is_int, "swiglu_limit": _is_number, "clip_qkv": _is_number,
                    "attention_chunk": _is_int}
        wrong = [f"{k}={getattr(self, k)!r} must be an integer" for k in ints if not _is_int(getattr(self, k))]
        wrong += [f"{k}={getattr(self, k)!r} must be a number" for k in _FLOATS if not _is_number(getattr(self, k))]
        wrong += [f"{k}={getattr(self, k)!r} must be {'an integer' if ok is _is_int else 'a number'} or null"
                  for k, ok in optional.items() if getattr(self, k) is not None and not ok(getattr(self, k))]
        if wrong:
            raise ConfigError(f"invalid ModelConfig: {'; '.join(wrong)}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ConfigError(f"invalid ModelConfig: max_position_embeddings={self.max_position_embeddings} is "
                              f"beyond the {MAX_POSITIONS} positions jaxinfer supports")
        positive = ("sliding_window", "rope_local_theta", "attn_scale", "attn_softcap", "final_softcap",
                    "moe_ffn_dim", "swiglu_limit", "clip_qkv", "attention_chunk")
        checks = {
            "vocab_size": self.vocab_size > 0, "d_model": self.d_model > 0,
            "n_layers": self.n_layers > 0, "n_heads": self.n_heads > 0,
            "n_kv_heads": self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0,
            "head_dim": self.head_dim > 0, "ffn_dim": self.ffn_dim > 0,
            "activation": self.activation in ("silu", "gelu", "gelu_tanh", "relu", "relu2", "xielu") and not (
                self.activation == "xielu" and (self.gated_mlp or self.num_experts)),   # Apertus: plain MLPs
            "norm": self.norm in NORMS,
            "parallel_block": not self.parallel_block or (self.pre_norms and not self.post_norms
                                                          and not self.residual_post_norm and not self.num_experts),
            "parallel_mlp_norm": self.parallel_block or not (self.parallel_mlp_norm or self.parallel_sum_first),
            "pre_norms": self.pre_norms or self.post_norms,
            "qk_norm_full": self.qk_norm or not self.qk_norm_full,
            "qk_norm_after_rope, query_log_scale (RoPE only)": not (self.qk_norm_after_rope or self.query_log_scale) or (
                self.qk_norm_after_rope <= self.qk_norm and self.position == "rope" and not self.mla_kv_rank),
            "qk_norm_heads": not self.qk_norm_heads or (self.qk_norm and not self.qk_norm_full),
            "position": self.position in ("rope", "alibi", "learned", "sinusoidal"),
            "sliding_layers": self.sliding_layers is None or len(self.sliding_layers) == self.n_layers,
            "rope_layers": self.rope_layers is None or (len(self.rope_layers) == self.n_layers
                                                        and self.position == "rope"),
            "rotary_dim": self.rotary_dim is None or 0 < self.rotary_dim <= self.head_dim,
            "query_log_scale": self.query_log_scale is None or (   # (models/mla.py has no such scale)
                len(self.query_log_scale) == 2 and _is_number(self.query_log_scale[0]) and _is_int(
                    self.query_log_scale[1]) and self.query_log_scale[1] > 0 and self.position == "rope"),
            **{k: getattr(self, k) is None or getattr(self, k) > 0 for k in positive},
            "logits_scaling": self.logits_scaling != 0,
            "num_experts": self.num_experts >= 0,
            "num_experts_per_tok": (0 < self.num_experts_per_tok <= self.num_experts if self.num_experts
                                    else self.num_experts_per_tok == 0),
            "moe_layers": self.moe_layers is None or (len(self.moe_layers) == self.n_layers and self.num_experts > 0),
            "moe_routing": self.moe_routing in ("topk_softmax", "softmax_topk", "sigmoid_topk", "softmax_group_topk",
                                                "softmax_corrected_topk", "sparsemixer", "topk_sigmoid") and (
                self.moe_routing != "sparsemixer" or self.num_experts_per_tok == 2),   # sparsemixer picks two
            "moe_groups": self.moe_groups > 0 and (not self.num_experts or self.num_experts % self.moe_groups == 0) and (
                self.moe_groups == 1 or self.num_experts // self.moe_groups
                >= (2 if self.moe_routing == "sigmoid_topk" else 1)),   # sigmoid: a group scored by its best two
            "moe_topk_groups": 0 < self.moe_topk_groups <= self.moe_groups and (
                self.moe_groups == 1 or self.moe_routing in ("sigmoid_topk", "softmax_group_topk")),
            "moe_shared_ffn_dim": self.moe_shared_ffn_dim >= 0 and (self.num_experts > 0 or not self.moe_shared_ffn_dim),
            "moe_shared_gate": self.moe_shared_ffn_dim > 0 or not self.moe_shared_gate,
            "mla_kv_rank": self.mla_kv_rank >= 0 and (not self.mla_kv_rank or (
                self.n_kv_heads == 1 and not self.attn_out_gate and self.head_dim == self.mla_kv_rank + self.mla_rope_dim
                and self.rotary_dim == self.mla_rope_dim and self.mla_nope_dim > 0 and self.mla_v_dim > 0
                and self.position == "rope")),
            "mla_q_rank": self.mla_q_rank >= 0,
            **self._llama4_checks(),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid ModelConfig field(s) {bad}, in ModelConfig({self._set_fields()})")
        self._check_combinations()

    def _set_fields(self) -> str:
        """The fields that differ from their defaults, as the repr writes them: the context of a
        refusal without the ~90 fields' whole repr."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                         if f.default is dataclasses.MISSING or _differs(getattr(self, f.name), f.default))

    def _llama4_checks(self) -> dict[str, bool]:
        s = self.nope_query_scale
        return {"qk_rms_after_rope": not self.qk_rms_after_rope or (self.position == "rope" and not self.mla_kv_rank),
                "nope_query_scale": s is None or (len(s) == 2 and _is_number(s[0]) and _is_int(s[1]) and s[1] > 0
                                                  and self.position == "rope" and not self.mla_kv_rank),
                "moe_scale_inputs": not self.moe_scale_inputs or self.num_experts > 0,
                "mlp_layers": self.mlp_layers is None or (len(self.mlp_layers) == self.n_layers
                                                          and all(isinstance(b, bool) for b in self.mlp_layers)
                                                          and not self.parallel_block and not self.post_norms),
                "layer_kinds": self.layer_kinds is None or (
                    len(self.layer_kinds) == self.n_layers
                    and set(self.layer_kinds) <= {"attention", "conv", "linear", "mamba", "mlp"}
                    and "attention" in self.layer_kinds and not self.mla_kv_rank
                    and ("mlp" not in self.layer_kinds or self.has_state and not self.parallel_block)
                    and all(self.has_mlp(i) for i, k in enumerate(self.layer_kinds) if k == "mlp")),
                "conv_kernel": self.conv_kernel >= 2 if self.has_state else self.conv_kernel == 0,
                "linear_k_heads, linear_v_heads, linear_k_dim, linear_v_dim": (
                    min(self.linear_k_heads, self.linear_v_heads, self.linear_k_dim, self.linear_v_dim) > 0
                    and self.linear_v_heads % self.linear_k_heads == 0
                    if self._has_kind("linear") or self._has_kind("mamba") else
                    self.linear_k_heads == self.linear_v_heads == self.linear_k_dim == self.linear_v_dim == 0),
                "ssm_dt_limit": self.ssm_dt_limit is None or (
                    self._has_kind("mamba") and len(self.ssm_dt_limit) == 2
                    and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in self.ssm_dt_limit)
                    and 0 <= self.ssm_dt_limit[0] <= self.ssm_dt_limit[1])}

    def _check_combinations(self) -> None:
        if self.swiglu_limit is not None and not (self.num_experts and self.gated_mlp):
            raise ConfigError("swiglu_limit (gpt-oss's clamped SwiGLU) applies to gated experts; it needs "
                              "num_experts > 0 and gated_mlp")
        if self.position == "rope" and self.rope_dim % 2:
            raise ConfigError(f"rope needs an even number of rotated features, got {self.rope_dim}")
        s = self.rope_scaling
        if s is not None and s.kind == "longrope" and not (
                len(s.short_factor or ()) == len(s.long_factor or ()) == self.rope_dim // 2):
            got = f"{len(s.short_factor or ())} and {len(s.long_factor or ())}"
            raise ConfigError(f"longrope needs short_factor and long_factor of {self.rope_dim // 2} values each "
                              f"(rotated features / 2), got {got}")

    @property
    def exact_positions(self) -> int:
        """The longest sequence computed as the model does: max_position_embeddings, or Llama 4's
        attention_chunk where shorter (past one chunk its RoPE layers' attention is chunked, which
        jaxinfer does not implement)."""
        return min(self.max_position_embeddings, self.attention_chunk or self.max_position_embeddings)

    @property
    def qk_norm_kind(self) -> str:
        """The q / k norms' kind: `norm`, but without a bias where they have weights per head
        (qk_norm_heads: Cohere's, StableLM 2 12B's bias-free LayerNorm per head)."""
        return "layernorm_nobias" if self.qk_norm_heads and self.norm == "layernorm" else self.norm

    @property
    def rope_dim(self) -> int:
        """How many features of each head RoPE rotates (the first ones; the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether the layer is one of the family's sliding (local) layers, window or not: those use
        `sliding_window` and, where rope_local_theta is set (Gemma 3), that RoPE base without scaling."""
        if self.sliding_layers is not None:
            return self.sliding_layers[layer]
        return self.sliding_window is not None

    def uses_rope(self, layer: int) -> bool:
        """Whether the layer rotates q and k (position "rope", and not one of SmolLM3's NoPE layers)."""
        return self.position == "rope" and (self.rope_layers is None or self.rope_layers[layer])

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for full causal attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (the mla_* fields)."""
        return self.mla_kv_rank > 0

    @property
    def kv_value_dim(self) -> int:
        """The width of a token's cached value per KV head: head_dim, or 0 where the values are read
        from the key pages (latent attention: the cached vector is the key and, its first
        mla_kv_rank features, the value; kv_cache's shared-value pages)."""
        return 0 if self.mla else self.head_dim

    def is_conv_layer(self, layer: int) -> bool:
        """Whether the layer mixes tokens by LFM2's short convolution instead of attention."""
        return self.layer_kinds is not None and self.layer_kinds[layer] == "conv"

    def is_linear_layer(self, layer: int) -> bool:
        """Whether the layer mixes tokens by a Gated DeltaNet (Qwen3-Next, Qwen3.5) instead of attention."""
        return self.layer_kinds is not None and self.layer_kinds[layer] == "linear"

    def is_mamba_layer(self, layer: int) -> bool:
        """Whether the layer mixes tokens by Mamba-2's selective state space (Granite 4.0-H)."""
        return self.layer_kinds is not None and self.layer_kinds[layer] == "mamba"

    def has_state_matrix(self, layer: int) -> bool:
        """Whether the layer's state holds a recurrent matrix per head besides its convolution's inputs
        (Gated DeltaNet, Mamba-2: kv_cache.DeltaState)."""
        return self.is_linear_layer(layer) or self.is_mamba_layer(layer)

    def is_state_layer(self, layer: int) -> bool:
        """Whether the layer keeps a state per sequence instead of KV pages (conv, Gated DeltaNet or
        Mamba-2)."""
        return self.is_conv_layer(layer) or self.has_state_matrix(layer)

    def has_mlp(self, layer: int) -> bool:
        """Whether the block has an MLP (or mixture of experts) after its mixer (mlp_layers)."""
        return self.mlp_layers is None or self.mlp_layers[layer]

    def has_mixer(self, layer: int) -> bool:
        """Whether the block has attention or a state layer's mixer before its MLP (not an "mlp" block)."""
        return self.layer_kinds is None or self.layer_kinds[layer] != "mlp"

    def has_kv(self, layer: int) -> bool:
        """Whether the block attends, and so has KV pages."""
        return self.has_mixer(layer) and not self.is_state_layer(layer)

    def _has_kind(self, kind: str) -> bool:
        return self.layer_kinds is not None and kind in self.layer_kinds

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a per-sequence state across steps besides its KV (conv layers,
        Gated DeltaNet or Mamba-2 layers)."""
        return self._has_kind("conv") or self._has_kind("linear") or self._has_kind("mamba")

    @property
    def n_attn_layers(self) -> int:
        """The layers that attend, and so have KV pages."""
        return sum(self.has_kv(i) for i in range(self.n_layers))

    @property
    def linear_conv_dim(self) -> int:
        """A Gated DeltaNet layer's convolved channels: its queries', keys' and values' features (Mamba-2's:
        x, B and C)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def linear_matrix_bytes(self) -> int:
        """A Gated DeltaNet's or Mamba-2 layer's recurrent state of one sequence: a float32 [linear_k_dim,
        linear_v_dim] per value head (0 without such layers)."""
        return 4 * self.linear_v_heads * self.linear_k_dim * self.linear_v_dim

    def state_bytes_per_slot(self, itemsize: int) -> int:
        """The bytes of one sequence's state over every state layer: a conv layer's last conv_kernel - 1
        inputs (d_model wide, LFM2; linear_conv_dim wide, Gated DeltaNet and Mamba-2) in the model dtype
        of itemsize bytes, and such a layer's float32 [linear_k_dim, linear_v_dim] per value head."""
        per = 0
        for i in range(self.n_layers):
            if self.is_conv_layer(i):
                per += (self.conv_kernel - 1) * self.d_model * itemsize
            elif self.has_state_matrix(i):
                per += (self.conv_kernel - 1) * self.linear_conv_dim * itemsize + self.linear_matrix_bytes
        return per

    def is_moe_layer(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts (the others keep the dense MLP of ffn_dim)."""
        if not self.num_experts or not self.has_mlp(layer):
            return False
        return True if self.moe_layers is None else self.moe_layers[layer]

    @property
    def expert_ffn_dim(self) -> int:
        """The hidden size of each expert's MLP."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def num_params(self) -> int:
        """Exact parameter count of this architecture (embeddings included, tied counted once; every
        expert of a mixture counted)."""
        return self.param_counts()["total"]

    def num_active_params(self) -> int:
        """Parameters one token runs through: num_params with num_experts_per_tok experts per MoE
        layer instead of all of them (the router counted whole). Equal to num_params for a dense model."""
        c = self.param_counts()
        return c["total"] - c["experts"] + c["moe_layers"] * self.num_experts_per_tok * c["expert"]

    def param_counts(self) -> dict[str, int]:
        """The one parameter count, split by how a step uses each part (jaxinfer.perf's cost model and
        jaxinfer.plan read the parts): "embedding" (the token table, V d; a tied one is also the LM
        head), "lm_head" (V d when untied, else 0), "positions" (a learned position table), "expert"
        (one expert of one MoE layer), "experts" (every expert of every MoE layer), "moe_layers",
        "total". Checked against transformers' models in the tests."""
        d, f, h, kv, hd = self.d_model, self.ffn_dim, self.n_heads, self.n_kv_heads, self.head_dim
        per_norm = {"layernorm": 2, "layernorm1p": 2, "layernorm_noparam": 0}.get(self.norm, 1)
        norm_p = per_norm * d
        attn = d * hd * (h + 2 * kv) + h * hd * d
        attn += (hd * (h + 2 * kv) if self.qkv_bias else 0) + (d if self.out_bias else 0)
        if self.mla:
            r, qk, qr = self.mla_kv_rank, self.mla_nope_dim + self.mla_rope_dim, self.mla_q_rank
            attn = ((d * qr + qr + qr * h * qk) if qr else d * h * qk) + d * (r + self.mla_rope_dim) + r
            attn += r * h * (self.mla_nope_dim + self.mla_v_dim) + h * self.mla_v_dim * d
            attn += ((qr if qr else 0) + r + self.mla_rope_dim + d) if self.out_bias else 0
        if self.qk_norm:   # one weight per feature of a head, or per feature of every head (OLMo 2, Cohere);
            # weights per head never come with a bias (qk_norm_kind)
            per_qk = 1 if self.qk_norm_heads else per_norm
            attn += per_qk * hd * ((h + kv) if self.qk_norm_full or self.qk_norm_heads else 2)
        attn += (h if self.attn_sinks else 0) + (d * h * hd if self.attn_out_gate else 0)
        # xIELU: its two alphas (its beta and eps are buffers in transformers' count, parameters here)
        mlp = (3 if self.gated_mlp else 2) * d * f + (2 if self.activation == "xielu" else 0)
        mlp += ((2 * f if self.gated_mlp else f) + d) if self.mlp_bias else 0
        fe, mats = self.expert_ffn_dim, 3 if self.gated_mlp else 2
        expert = mats * d * fe + (((mats - 1) * fe + d) if self.mlp_bias else 0)
        # the shared experts run for every token: with the router, per MoE layer (sigmoid_topk's correction
        # is a buffer, not a parameter, in transformers' count)
        router = (d * self.num_experts + (self.num_experts if self.router_bias else 0)
                  + mats * d * self.moe_shared_ffn_dim + (d if self.moe_shared_gate else 0)
                  + (self.num_experts if self.moe_routing == "softmax_corrected_topk" else 0))   # ERNIE's: a parameter
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        n_mlp = sum(self.has_mlp(i) for i in range(self.n_layers))
        n_mixer = sum(self.has_mixer(i) for i in range(self.n_layers))
        # a norm before each branch (or after it: OLMo 2), two with both (Gemma): a block without an MLP
        # or without a mixer (Nemotron-H) lacks that branch's; one for a parallel block (Cohere; two with
        # its own MLP norm: GPT-NeoX)
        norms = norm_p * ((1 + self.parallel_mlp_norm) * self.n_layers if self.parallel_block
                          else (self.pre_norms + self.post_norms) * (n_mixer + n_mlp))
        out = {"embedding": self.vocab_size * d, "lm_head": 0 if self.tie_embeddings else self.vocab_size * d,
               "positions": self.max_position_embeddings * d if self.position == "learned" else 0,
               "expert": expert if n_moe else 0, "experts": n_moe * self.num_experts * expert, "moe_layers": n_moe}
        n_conv = sum(self.is_conv_layer(i) for i in range(self.n_layers))   # LFM2: in_proj [d, 3d], the taps [L, d],
        conv = 4 * d * d + self.conv_kernel * d + (5 * d if self.conv_bias else 0)   # out_proj [d, d]
        # Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b / a, the taps, A_log, dt_bias, the gated norm, out_proj
        hv, vd, cd = self.linear_v_heads, self.linear_v_heads * self.linear_v_dim, self.linear_conv_dim
        linear = d * cd + d * vd + 2 * d * hv + self.conv_kernel * cd + 2 * hv + self.linear_v_dim + vd * d
        n_linear = sum(self.is_linear_layer(i) for i in range(self.n_layers))
        # Mamba-2: in_proj (xBC, z, dt), the taps (+ bias), A_log, dt_bias, D, the gated norm, out_proj
        mamba = (d * cd + d * vd + d * hv + self.conv_kernel * cd + (cd if self.conv_bias else 0) + 3 * hv + vd
                 + vd * d)
        n_mamba = sum(self.is_mamba_layer(i) for i in range(self.n_layers))
        blocks = (self.n_attn_layers * attn + n_conv * conv + n_linear * linear + n_mamba * mamba
                  + norms
                  + (n_mlp - n_moe) * mlp
                  + n_moe * router + out["experts"])
        out["total"] = (blocks + norm_p + (norm_p if self.embed_norm else 0) + out["embedding"] + out["lm_head"]
                        + (self.vocab_size if self.lm_head_bias else 0) + out["positions"])
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {sorted(unknown)}")
        if d.get("rope_scaling") is not None:   # lists from JSON back to tuples: the config stays hashable
            d["rope_scaling"] = RopeScaling(**{k: tuple(v) if isinstance(v, list) else v
                                               for k, v in d["rope_scaling"].items()})
        for k in ("sliding_layers", "rope_layers", "moe_layers", "eos_token_ids", "query_log_scale",
                  "nope_query_scale", "layer_kinds", "ssm_dt_limit", "mlp_layers"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

