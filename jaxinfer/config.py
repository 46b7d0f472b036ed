"""Configuration: the model's architecture (ModelConfig), the engine's knobs (EngineConfig), the
settings decided from them once (ResolvedConfig, resolve_config) and one request's decoding knobs
(SamplingParams).

All are frozen dataclasses. A Hugging Face config.json becomes a ModelConfig in
jaxinfer/models/hf_configs.py (model_config_from_hf), the only place that knows how each supported
family spells things; the model code reads ModelConfig only. The values each engine setting takes are
listed once here (the *_CHOICES constants below), for EngineConfig's checks and cli.py's flags.
This module never imports jax.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from jaxinfer import perf


# The values of EngineConfig's settings, listed once: EngineConfig checks them and cli.py offers them
# as its flags' choices (None, where a setting allows it, is the flag left out).
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")          # EngineConfig.dtype, --dtype
ATTENTION_CHOICES = ("pallas", "xla", "auto")                       # EngineConfig.attention, --attention
QUANTIZE_CHOICES = ("int8", "int4", "fp8")                          # EngineConfig.quantize, --quantize
KV_DTYPE_CHOICES = ("int8", "fp8", "float16", "bfloat16", "float32")  # EngineConfig.kv_dtype, --kv-dtype
BATCHING_CHOICES = ("continuous", "static", "dynamic")              # EngineConfig.batching, --batching
SPECULATIVE_METHODS = ("draft", "ngram", "medusa")                  # EngineConfig.speculative_method
# The smallest per-step token budget: the runner's first token bucket holds up to 8 tokens.
MIN_TOKEN_BUDGET = 8

# Stop strings: at most this many per request, each at most this many characters. The engine looks
# for them in each step's new text plus the last MAX_STOP_LENGTH - 1 characters, so a step's stop
# check costs O(MAX_STOP_STRINGS * (new text + MAX_STOP_LENGTH)), never the output length.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512
# logit_bias: at most this many token ids per request (OpenAI's limit), each biased within +-100.
MAX_LOGIT_BIAS = 300
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
    activation: str = "silu"            # silu | gelu (erf) | gelu_tanh | relu
    gated_mlp: bool = True              # act(x W_gate) * (x W_up) -> W_down; else act(x W_fc) -> W_proj
    norm: str = "rmsnorm"               # rmsnorm | gemma_rmsnorm (scale 1 + w) | layernorm
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
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False               # a `norm` over head_dim of each q and k head before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False            # Gemma: norms of the attention and MLP outputs before each residual add
    attn_scale: float | None = None     # softmax scale of q.k; None: head_dim ** -0.5
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the LM head's logits (Gemma 2 and 3)
    embed_scale: float = 1.0            # token embeddings multiplied by it (Gemma: sqrt(d_model))
    attn_sinks: bool = False            # gpt-oss: one learned logit per head in every softmax's denominator
    # Mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): num_experts > 0 replaces the MLP of the layers
    # moe_layers marks (None: every layer) by a router picking num_experts_per_tok experts per token,
    # each a gated MLP of moe_ffn_dim (None: ffn_dim; the dense layers keep ffn_dim), with biases where
    # mlp_bias. moe_routing: "topk_softmax" (Mixtral, gpt-oss: top-k of the router logits, softmax over
    # the k) or "softmax_topk" (Qwen3-MoE: softmax over all experts, top-k, renormalized over the k when
    # moe_norm_topk). swiglu_limit (gpt-oss): the experts' clamped SwiGLU,
    # (clip(up, -L, L) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, L), instead of act(gate) * up.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_ffn_dim: int | None = None
    moe_layers: tuple[bool, ...] | None = None
    moe_routing: str = "topk_softmax"
    moe_norm_topk: bool = True
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    tie_embeddings: bool = False
    embed_norm: bool = False            # BLOOM: LayerNorm right after the token embedding
    residual_post_norm: bool = False    # BLOOM's apply_residual_connection_post_layernorm
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        ints = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "max_position_embeddings", "num_experts", "num_experts_per_tok")
        floats = ("norm_eps", "rope_theta", "embed_scale", "swiglu_alpha")
        optional = {"sliding_window": _is_int, "rotary_dim": _is_int, "rope_local_theta": _is_number,
                    "attn_scale": _is_number, "attn_softcap": _is_number, "final_softcap": _is_number,
                    "moe_ffn_dim": _is_int, "swiglu_limit": _is_number}
        wrong = [f"{k}={getattr(self, k)!r} must be an integer" for k in ints if not _is_int(getattr(self, k))]
        wrong += [f"{k}={getattr(self, k)!r} must be a number" for k in floats if not _is_number(getattr(self, k))]
        wrong += [f"{k}={getattr(self, k)!r} must be {'an integer' if ok is _is_int else 'a number'} or null"
                  for k, ok in optional.items() if getattr(self, k) is not None and not ok(getattr(self, k))]
        if wrong:
            raise ConfigError(f"invalid ModelConfig: {'; '.join(wrong)}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ConfigError(f"invalid ModelConfig: max_position_embeddings={self.max_position_embeddings} is "
                              f"beyond the {MAX_POSITIONS} positions jaxinfer supports")
        positive = ("sliding_window", "rope_local_theta", "attn_scale", "attn_softcap", "final_softcap",
                    "moe_ffn_dim", "swiglu_limit")
        checks = {
            "vocab_size": self.vocab_size > 0, "d_model": self.d_model > 0,
            "n_layers": self.n_layers > 0, "n_heads": self.n_heads > 0,
            "n_kv_heads": self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0,
            "head_dim": self.head_dim > 0, "ffn_dim": self.ffn_dim > 0,
            "activation": self.activation in ("silu", "gelu", "gelu_tanh", "relu"),
            "norm": self.norm in ("rmsnorm", "gemma_rmsnorm", "layernorm"),
            "position": self.position in ("rope", "alibi", "learned", "sinusoidal"),
            "sliding_layers": self.sliding_layers is None or len(self.sliding_layers) == self.n_layers,
            "rotary_dim": self.rotary_dim is None or 0 < self.rotary_dim <= self.head_dim,
            **{k: getattr(self, k) is None or getattr(self, k) > 0 for k in positive},
            "num_experts": self.num_experts >= 0,
            "num_experts_per_tok": (0 < self.num_experts_per_tok <= self.num_experts if self.num_experts
                                    else self.num_experts_per_tok == 0),
            "moe_layers": self.moe_layers is None or (len(self.moe_layers) == self.n_layers and self.num_experts > 0),
            "moe_routing": self.moe_routing in ("topk_softmax", "softmax_topk"),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid ModelConfig field(s) {bad}: {self}")
        if self.num_experts and not self.gated_mlp:
            raise ConfigError("mixture-of-experts layers are gated MLPs; gated_mlp=False with num_experts > 0 "
                              "is not supported")
        if self.swiglu_limit is not None and not self.num_experts:
            raise ConfigError("swiglu_limit (gpt-oss's clamped SwiGLU) applies to experts; it needs num_experts > 0")
        if self.position == "rope" and self.rope_dim % 2:
            raise ConfigError(f"rope needs an even number of rotated features, got {self.rope_dim}")
        s = self.rope_scaling
        if s is not None and s.kind == "longrope" and not (
                len(s.short_factor or ()) == len(s.long_factor or ()) == self.rope_dim // 2):
            got = f"{len(s.short_factor or ())} and {len(s.long_factor or ())}"
            raise ConfigError(f"longrope needs short_factor and long_factor of {self.rope_dim // 2} values each "
                              f"(rotated features / 2), got {got}")

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

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for full causal attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts (the others keep the dense MLP of ffn_dim)."""
        if not self.num_experts:
            return False
        return True if self.moe_layers is None else self.moe_layers[layer]

    @property
    def expert_ffn_dim(self) -> int:
        """The hidden size of each expert's gated MLP."""
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
        per_norm = 2 if self.norm == "layernorm" else 1
        norm_p = per_norm * d
        attn = d * hd * (h + 2 * kv) + h * hd * d
        attn += (hd * (h + 2 * kv) if self.qkv_bias else 0) + (d if self.out_bias else 0)
        attn += 2 * per_norm * hd if self.qk_norm else 0
        attn += h if self.attn_sinks else 0
        mlp = (3 if self.gated_mlp else 2) * d * f
        mlp += ((2 * f if self.gated_mlp else f) + d) if self.mlp_bias else 0
        fe = self.expert_ffn_dim
        expert = 3 * d * fe + ((2 * fe + d) if self.mlp_bias else 0)
        router = d * self.num_experts + (self.num_experts if self.router_bias else 0)
        norms = (4 if self.post_norms else 2) * norm_p
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        out = {"embedding": self.vocab_size * d, "lm_head": 0 if self.tie_embeddings else self.vocab_size * d,
               "positions": self.max_position_embeddings * d if self.position == "learned" else 0,
               "expert": expert if n_moe else 0, "experts": n_moe * self.num_experts * expert, "moe_layers": n_moe}
        blocks = self.n_layers * (attn + norms) + (self.n_layers - n_moe) * mlp + n_moe * router + out["experts"]
        out["total"] = (blocks + norm_p + (norm_p if self.embed_norm else 0)
                        + out["embedding"] + out["lm_head"] + out["positions"])
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
        for k in ("sliding_layers", "moe_layers", "eos_token_ids"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


class SamplingParamsError(ValueError):
    """Invalid SamplingParams; `fields` names the offending fields in order, so every front door
    can name its own field (the server's 400 `param`)."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(msg for _, msg in problems))
        self.fields = tuple(f for f, _ in problems)


@dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """Constrain a request's output to a language (vLLM's StructuredOutputsParams; exactly one of):
      json: a JSON schema (dict or its JSON text); json_object: any JSON object;
      regex: a regular expression the whole output matches; choice: one of these strings;
      grammar: a context-free grammar, Lark syntax (llguidance's) or GBNF (llama.cpp's, with `::=`).
    Compiled and checked against the tokenizer when the request is added (host/structured.py, with
    llguidance); a grammar that does not compile is refused naming the problem.
    whitespace_flexible (JSON only): allow any whitespace between tokens; off by default, so JSON comes
    out compact (`,` and `:` separators, no spaces) and a model cannot stall in endless whitespace."""
    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):   # stored as text: the params stay hashable
            object.__setattr__(self, "json", json.dumps(self.json))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError([("structured_outputs", "structured outputs take exactly one of json, "
                                        f"json_object, regex, choice or grammar, got {given or 'none'}")])
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SamplingParamsError([("structured_outputs", "choice must be a non-empty list of non-empty strings")])
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError([("structured_outputs", f"{k} must be a non-empty string")])
        if self.json is not None and not isinstance(self.json, str):
            raise SamplingParamsError([("structured_outputs", "json must be a JSON schema object")])

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request decodes. temperature 0 means greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                      # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None         # top-N logprobs per generated token
    n: int = 1
    # token id -> bias added to its logit on device, before everything else but the structured-output
    # mask (OpenAI's logit_bias: -100 bans a token, +100 all but forces it); stored as sorted pairs
    logit_bias: Any = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems: list[tuple[str, str]] = []   # (field, message)
        if self.logit_bias is not None:
            bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:
                pairs = tuple(sorted((int(k), float(v)) for k, v in bias))
            except (TypeError, ValueError):
                pairs = None
                problems.append(("logit_bias", "logit_bias must map token ids (integers) to numbers"))
            if pairs is not None:
                object.__setattr__(self, "logit_bias", pairs or None)
                if len(pairs) > MAX_LOGIT_BIAS:
                    problems.append(("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                                                   f"got {len(pairs)}"))
                elif any(not -100.0 <= v <= 100.0 for _, v in pairs):
                    problems.append(("logit_bias", "logit_bias values must be in [-100, 100], got "
                                                   f"{[v for _, v in pairs if not -100.0 <= v <= 100.0][:3]}"))
                elif any(k < 0 for k, _ in pairs):
                    problems.append(("logit_bias", f"logit_bias token ids must be >= 0, got "
                                                   f"{[k for k, _ in pairs if k < 0][:3]}"))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            problems.append(("structured_outputs", "structured_outputs must be a StructuredOutputs"))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(("temperature", f"temperature must be >= 0, got {self.temperature!r}"))
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(("top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"))
        if not 0.0 < self.top_p <= 1.0:
            problems.append(("top_p", f"top_p must be in (0, 1], got {self.top_p!r}"))
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(("min_p", f"min_p must be in [0, 1], got {self.min_p!r}"))
        if not 0.01 <= self.repetition_penalty <= 100:
            problems.append(("repetition_penalty",
                             f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}"))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                problems.append((name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}"))
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            problems.append(("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}"))
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            problems.append(("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"))
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            problems.append(("n", f"n must be an integer in [1, 128], got {self.n!r}"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(("stop", f"stop must be non-empty strings, got {self.stop!r}"))
        elif len(self.stop) > MAX_STOP_STRINGS:
            problems.append(("stop", f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"))
        elif any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            problems.append(("stop", f"stop strings must be at most {MAX_STOP_LENGTH} characters each, got one of "
                                     f"{max(map(len, self.stop))}"))
        if problems:
            raise SamplingParamsError(problems)

    @property
    def uses_history(self) -> bool:
        """The penalties read the request's token history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def constrained(self) -> bool:
        """A grammar masks each draw: the next mask needs the previous token on the host."""
        return self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


MAX_SPECULATIVE_TOKENS = 16
# The load policy's default per backend (resolve_config): speculate while at most this many sequences
# run or wait. CPU: 1. bench/speculative.py on the bundled model, speculation forced on against none
# (2026-11-25-cpu-speculative.json): at 2 sequences draft 0.72x, n-gram 0.66x, Medusa 0.46x; at 4
# 0.64x / 0.49x / 0.35x; at 16 and 64 0.25-0.48x (at 1: README's batch-1 table): XLA:CPU's matmuls
# are compute-bound once a step holds a few rows, so verifying 1 + k tokens a row costs nearly
# 1 + k tokens. Accelerators: 8, not yet measured on a GPU: a
# decode step stays bound by reading the weights until it holds about as many tokens as the chip
# does FLOPs per byte read (~300 on an H100 in bfloat16), so 8 rows x 5 verified tokens should cost
# little more than 8.
DEFAULT_SPECULATIVE_MAX_BATCH = {"cpu": 1}
DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR = 8


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The serving engine's knobs (see DESIGN.md), as the user gave them; resolve_config decides
    every "auto" and None once (ResolvedConfig), and the engine reads that."""
    dtype: str = "auto"                 # auto (float32 on CPU, else bfloat16) | bfloat16 | float32 | float16
    attention: str = "auto"             # pallas | xla | auto
    # None | int8 | int4 | fp8, at load time: weight-only (fp8 on GPU also scales activations to e4m3 per token)
    quantize: str | None = None
    kv_dtype: str | None = None         # None (= dtype) | int8 | fp8 (e4m3) | float16 | bfloat16 | float32
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_microbatches: int | None = None   # micro-batches per step with pipeline_parallel > 1 (None: = pp)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512   # tokens one step computes at most (at least MIN_TOKEN_BUDGET are allowed)
    block_size: int = 16
    num_blocks: int | None = None       # None: sized from free memory (memory_fraction)
    # num_blocks=None on an accelerator: the engine holds at most this fraction of the device's memory,
    # weights, KV pool and activations together (vLLM's gpu_memory_utilization)
    memory_fraction: float = 0.9
    batching: str = "continuous"        # static | dynamic | continuous
    batch_window_s: float = 0.05        # dynamic batching: how long the oldest waiting request may wait
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    max_decode_steps: int = 8           # decode iterations per step on device when every row decodes
    async_scheduling: bool = True       # plan and dispatch step N+1 before step N's tokens reach the host
    enable_prefix_caching: bool = True  # reuse the KV blocks of cached prompt prefixes (host/block_manager.py)
    speculative_method: str | None = None   # None | draft | ngram | medusa (jaxinfer/speculative.py, medusa.py)
    num_speculative_tokens: int = 4     # K: proposals per decoding sequence and step (medusa: the tree's depth)
    speculative_max_batch: int | None = None   # speculate while at most this many sequences run or wait (None: default)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        choices = {"dtype": DTYPE_CHOICES, "attention": ATTENTION_CHOICES, "quantize": (None, *QUANTIZE_CHOICES),
                   "kv_dtype": (None, *KV_DTYPE_CHOICES), "batching": BATCHING_CHOICES,
                   "speculative_method": (None, *SPECULATIVE_METHODS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if not (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}")
        for name in ("tensor_parallel", "pipeline_parallel", "max_num_seqs", "block_size", "max_decode_steps",
                     "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 0:
            raise ValueError(f"speculative_max_batch must be >= 0, got {self.speculative_max_batch}")
        if self.speculative_method is not None and self.pipeline_parallel > 1:
            # (tensor_parallel works: the draft model and Medusa heads are replicated on the mesh)
            raise ValueError("speculative decoding is not available with pipeline_parallel > 1")


# ------------------------------------------------------------------------------ resolved settings
def resolve_dtype_name(dtype: str, backend: str, weight_dtype: str | None = None) -> str:
    """"auto" -> the dtype the weights are in when known, else float32 on CPU (XLA:CPU runs bfloat16
    matmuls about 2x slower than float32) and bfloat16 on accelerators; explicit names stay.
    The one rule for the model dtype: the loaders (weights.resolve_dtype) and resolve_config use it."""
    if dtype != "auto":
        return dtype
    return weight_dtype or ("float32" if backend == "cpu" else "bfloat16")


def resolve_impl_name(requested: str, backend: str) -> str:
    """"auto" -> the Pallas kernels on GPU, XLA elsewhere; "pallas" and "xla" stay."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"unknown implementation {requested!r}; use 'pallas', 'xla' or 'auto'")
    if requested == "auto":
        return "pallas" if backend == "gpu" else "xla"
    return requested


def pallas_unsupported(model_cfg: ModelConfig, block_size: int) -> str | None:
    """Why the Pallas (Triton) kernels cannot run this model on a GPU, or None: Triton needs every
    tile dimension a power of two and dot operands of >= 16 along the contracted head_dim
    (pallas_kernels/attention_common.check_triton_shapes; interpret mode on CPU has neither limit)."""
    d = model_cfg.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


@dataclass(frozen=True, kw_only=True)
class PoolInputs:
    """What the KV pool is sized from when num_blocks is None, gathered by the engine (which may
    import jax) before resolve_config: the allocator's memory stats of each process's first device
    (bytes_limit, bytes_in_use: the loaded weights are in use already, so they count once; None or
    no bytes_limit: a host CPU), and what of the model the pool's arithmetic needs besides its
    ModelConfig. resolve_config turns them into the block bytes, the step's activation reserve and
    the pool (perf.size_kv_pool); multi-host, every process takes the smallest pool any of them fits."""
    stats: tuple[dict | None, ...]      # this process's first, then the other processes'
    platform: str                       # the device's platform: cpu | gpu | tpu
    host_ram: int                       # bytes of host RAM (a host pool takes at most a share of it)
    env: dict[str, str] = field(default_factory=dict)   # the allocator's environment (XLA_CLIENT_MEM_FRACTION)
    kv_shards: int = 1                  # devices that split each block (tp when KV heads are sharded, x pp)
    draft: ModelConfig | None = None    # a draft model, whose pages use the same blocks
    activation_dtype_bytes: int = 4     # bytes of one activation element (the loaded weights' dtype)


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """Every setting the engine, its scheduler and runner configs, the step and the quantized
    matmuls read, with every "auto" and None decided, built once by resolve_config(). Nothing below
    the engine reads an EngineConfig."""
    backend: str                 # jax.default_backend() it was resolved for: cpu | gpu | tpu
    dtype: str                   # float32 | bfloat16 | float16
    kv_dtype: str                # int8 | fp8 | float16 | bfloat16 | float32: the one name the pages are known by
    attention: str               # pallas | xla
    matmul: str                  # pallas | xla: quantized matmuls follow the attention choice
    num_blocks: int              # KV blocks in the pool, the null block 0 included
    block_size: int
    max_model_len: int           # capped so one sequence of it fits in the pool
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget (at least MIN_TOKEN_BUDGET)
    max_decode_steps: int        # 1 where a step cannot loop on the device (pipeline stages)
    batching: str                # continuous | static | dynamic
    batch_window_s: float
    enable_prefix_caching: bool
    async_scheduling: bool       # False for pipeline stages (one step at a time)
    pipeline_microbatches: int | None   # None: one per pipeline stage
    memory_fraction: float
    speculative_method: str | None = None
    spec_tokens: int = 0         # proposals per decoding row (0: no speculative decoding)
    spec_rounds: int = 1         # draft / n-gram: speculation rounds one step may run on the device
    spec_max_batch: int = 0      # the load policy: speculate while at most this many sequences run or wait
    pool: Any = None             # perf.PoolSize: how num_blocks was sized (None: num_blocks was given)

    @property
    def pool_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


def resolve_config(cfg: EngineConfig, model_cfg: ModelConfig, *, backend: str, weight_dtype: str | None = None,
                   memory: PoolInputs | None = None, pipelined: bool = False) -> ResolvedConfig:
    """The one place settings are decided. backend: jax.default_backend(); weight_dtype: the dtype
    the loaded weights are in (what dtype="auto" means for an engine); memory: what sizes the KV
    pool when cfg.num_blocks is None (PoolInputs, gathered by the caller, which may import jax;
    this function never does). A pool that cannot hold one sequence of max_model_len is a
    ConfigError naming the numbers and the settings that fix it."""
    dtype = resolve_dtype_name(cfg.dtype, backend, weight_dtype)
    kv_dtype = cfg.kv_dtype or dtype
    attention = _resolve_attention(cfg, model_cfg, backend)
    max_model_len = cfg.max_model_len or model_cfg.max_position_embeddings
    pool = None
    if cfg.num_blocks is not None:
        num_blocks = cfg.num_blocks
    elif memory is not None:
        pool = size_pool(cfg, model_cfg, kv_dtype, max_model_len, memory)
        num_blocks = pool.num_blocks
    else:
        raise ValueError("num_blocks=None needs memory (PoolInputs) to size the KV pool from free memory")
    check_pool_fits(cfg, max_model_len, num_blocks, pool)
    spec_tokens, spec_rounds, spec_max_batch = _speculation(cfg, backend)
    return ResolvedConfig(
        backend=backend, dtype=dtype, kv_dtype=kv_dtype, attention=attention, matmul=attention,
        num_blocks=num_blocks, block_size=cfg.block_size, max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=max(cfg.max_num_batched_tokens, MIN_TOKEN_BUDGET),
        max_decode_steps=1 if pipelined else cfg.max_decode_steps, batching=cfg.batching,
        batch_window_s=cfg.batch_window_s, enable_prefix_caching=cfg.enable_prefix_caching,
        async_scheduling=cfg.async_scheduling and not pipelined, pipeline_microbatches=cfg.pipeline_microbatches,
        memory_fraction=cfg.memory_fraction, speculative_method=cfg.speculative_method, spec_tokens=spec_tokens,
        spec_rounds=spec_rounds, spec_max_batch=spec_max_batch, pool=pool)


def _resolve_attention(cfg: EngineConfig, model_cfg: ModelConfig, backend: str) -> str:
    """pallas | xla for this model on this backend: on a GPU "auto" falls back to XLA for shapes the
    Triton kernels cannot take (explicit "pallas": refused). Medusa's tree mask is in both."""
    attention = resolve_impl_name(cfg.attention, backend)
    if cfg.speculative_method == "medusa":
        # the tree mask (kv_cache.AttentionMetadata.tree, in both attentions) compares slot indexes,
        # which differ from a node's position, so ALiBi's distances and sliding windows would be off
        # by the node's place in the tree
        if model_cfg.position == "alibi" or model_cfg.sliding_window is not None:
            raise ValueError('speculative_method="medusa" is not available for models with ALiBi or a sliding window')
    unsupported = pallas_unsupported(model_cfg, cfg.block_size) if attention == "pallas" and backend == "gpu" else None
    if unsupported and cfg.attention == "pallas":
        raise ConfigError(f'attention="pallas" cannot run this model on a GPU: {unsupported}; use attention="xla" '
                          f'(or "auto", which picks it)')
    return "xla" if unsupported else attention


def _speculation(cfg: EngineConfig, backend: str) -> tuple[int, int, int]:
    """(proposals per decoding row, rounds one step may run, the load policy's batch limit); (0, 1, 0)
    without speculative decoding."""
    spec = cfg.num_speculative_tokens if cfg.speculative_method else 0
    max_batch = (cfg.speculative_max_batch if cfg.speculative_max_batch is not None else
                 DEFAULT_SPECULATIVE_MAX_BATCH.get(backend, DEFAULT_SPECULATIVE_MAX_BATCH_ACCELERATOR))
    # a speculative step verifies on the device once: multi-step decoding is for engines without it
    # while every row speculates with proposals made on the device, a step runs several rounds: as many
    # as multi-step decoding runs forwards for n-gram (one target forward a round), half as many for
    # the draft method (whose rounds also run k + 1 draft forwards); Medusa as n-gram (one tree-masked
    # target forward a round; the heads propose the next round's tree on the device).
    # bench/speculative.py, n-gram at batch 1: 4 rounds 1.51x, 8 rounds 1.81x, 16 rounds 1.90x (the
    # host's work between steps is not overlapped: a step's length depends on what it accepts)
    rounds = {"draft": -(-cfg.max_decode_steps // 2), "ngram": cfg.max_decode_steps,
              "medusa": cfg.max_decode_steps}.get(cfg.speculative_method, 1)
    return spec, rounds, max_batch if spec else 0


def size_pool(cfg: EngineConfig, model_cfg: ModelConfig, kv_dtype: str, max_model_len: int,
              memory: PoolInputs) -> perf.PoolSize:
    """The KV pool of num_blocks=None (perf.size_kv_pool) from the gathered memory: on an
    accelerator, memory_fraction of its memory less what is in use and the step's activations
    (perf.step_activation_bytes at the token budget and every row's logits); on a host CPU, what
    max_num_seqs sequences of max_model_len need, capped at a share of RAM. Multi-host: this
    process's pool with the fewest blocks any process fits (one global array)."""
    mc, bs = model_cfg, cfg.block_size
    block_bytes = bs * perf.kv_bytes_per_token(mc.n_layers, mc.n_kv_heads, mc.head_dim, kv_dtype) // memory.kv_shards
    if memory.draft is not None:   # a draft model's pages use the same blocks
        d = memory.draft
        block_bytes += bs * perf.kv_bytes_per_token(d.n_layers, d.n_kv_heads, d.head_dim, kv_dtype)
    spec_rows = 1 + (cfg.num_speculative_tokens if cfg.speculative_method else 0)
    reserve = perf.step_activation_bytes(
        tokens=max(cfg.max_num_batched_tokens, MIN_TOKEN_BUDGET), rows=cfg.max_num_seqs * spec_rows,
        d_model=mc.d_model,
        # a mixture of experts holds each token's k experts' hidden states at once
        ffn_dim=max(mc.ffn_dim, mc.num_experts_per_tok * (mc.moe_ffn_dim or mc.ffn_dim) if mc.num_experts else 0),
        n_heads=mc.n_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size, dtype_bytes=memory.activation_dtype_bytes)
    pools = [perf.size_kv_pool(block_bytes=block_bytes, memory_fraction=cfg.memory_fraction, stats=stats,
                               platform=memory.platform, env=memory.env, reserve=reserve, host_ram=memory.host_ram,
                               wanted_blocks=cfg.max_num_seqs * math.ceil(max_model_len / bs) + 1)
             for stats in memory.stats]
    return dataclasses.replace(pools[0], num_blocks=min(p.num_blocks for p in pools))


def check_pool_fits(cfg: EngineConfig, max_model_len: int, num_blocks: int, pool: perf.PoolSize | None) -> None:
    """One sequence of max_model_len must fit in the pool (block 0 is the null block): otherwise an
    error naming the numbers and the settings that fix it, as vLLM refuses to start, rather than a
    context silently shortened to what the pool holds. pool: how num_blocks was sized (None: given)."""
    pool_tokens = (num_blocks - 1) * cfg.block_size
    if max_model_len <= pool_tokens:
        return
    need = -(-max_model_len // cfg.block_size) + 1
    was = "max_model_len" if cfg.max_model_len else "max_model_len (the model's max_position_embeddings)"
    if pool is None:
        raise ConfigError(
            f"the KV cache cannot hold one sequence of {was} = {max_model_len} tokens: num_blocks={num_blocks} "
            f"holds {pool_tokens} tokens ({num_blocks - 1} blocks of {cfg.block_size}; block 0 is reserved). "
            f"Set num_blocks to at least {need}, or max_model_len to at most {pool_tokens}, or leave num_blocks "
            f"unset to size the pool from memory_fraction of the device's memory")
    fixes = [f"lower max_model_len to at most {pool_tokens}"]
    if pool.on_device:
        more = pool.in_use + pool.reserve + need * pool.block_bytes
        fixes.append(f"raise memory_fraction (--gpu-memory-utilization) to at least {more / pool.device_bytes:.3f}"
                     if more <= pool.device_bytes else "use a device with more memory (or quantize the weights)")
        if pool.allocator_bound:
            fixes[-1] += " and XLA_CLIENT_MEM_FRACTION with it (JAX's allocator cap)"
    fixes.append(f"set num_blocks to at least {need}")
    raise ConfigError(
        f"the KV cache cannot hold one sequence of {was} = {max_model_len} tokens: {pool.describe()}: "
        f"{num_blocks - 1} usable blocks of {cfg.block_size} tokens = {pool_tokens} tokens. To fix it, "
        + ", or ".join(fixes))
