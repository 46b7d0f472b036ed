"""Building blocks of the decoder: linear maps, norms, MLPs, embeddings and positions.

Every parameter is an `nnx.Param` with `logical_axes` metadata naming its dimensions in the
vocabulary of sharding.py (vocab, embed, heads, kv_heads, head_dim, mlp, position), so a mesh
can shard it without the model knowing about meshes. Norms, softmax and position maths run in
float32 whatever the parameter dtype; matmuls run in the parameter dtype with float32 results
where it matters (the LM head).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.quant import QuantizedWeight, dot_precision, qdot


def param(shape: tuple[int, ...], axes: tuple[str, ...], dtype, rngs: nnx.Rngs | None, std: float = 0.02,
          init: str = "normal") -> nnx.Param:
    """A parameter with logical axis names. Random init is only for tests and training from scratch."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),   # Nemotron's, Arcee's squared ReLU
}
def xielu(x: jax.Array, p: jax.Array) -> jax.Array:
    """xIELU (Apertus; arXiv 2411.13010) of p = [alpha_p, alpha_n, beta, eps] (the learned alphas before
    their softplus, and the checkpoint's beta / eps buffers): a_p x^2 + beta x for x > 0, else
    (expm1(min(x, eps)) - x) a_n + beta x, with a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n);
    in x's dtype as transformers' Python form, each softplus rounded once from float32 as torch's."""
    soft = jax.nn.softplus(p[:2].astype(jnp.float32)).astype(p.dtype)
    a_p, a_n, beta, eps = (v.astype(x.dtype) for v in (soft[0], p[2] + soft[1], p[2], p[3]))
    return jnp.where(x > 0, a_p * x * x + beta * x, (jnp.expm1(jnp.minimum(x, eps)) - x) * a_n + beta * x)


NORM_KINDS = ("rmsnorm", "gemma_rmsnorm", "olmo_rmsnorm", "layernorm", "layernorm_nobias", "layernorm1p",
              "layernorm_noparam")


class Norm(nnx.Module):
    """RMSNorm (Llama family), Gemma's RMSNorm (weight stored as w, applied as 1 + w), LayerNorm
    with bias (GPT-2, BLOOM) or without (Cohere: the weight times the float32 value, cast after),
    computed in float32. `axis`: the logical axis of the weight (embed for
    the residual stream, head_dim for the per-head q/k norms of Qwen3 and Gemma 3)."""

    def __init__(self, dim: int, kind: str, eps: float, dtype, rngs: nnx.Rngs | None, axis: str = "embed",
                 heads: tuple[int, str] | None = None):
        """heads: (count, logical axis): one weight per head (Cohere's q / k norms: [heads, dim]),
        the statistics still over the last axis."""
        assert kind in NORM_KINDS, kind
        self.kind, self.eps = kind, eps
        shape, axes = ((dim,), (axis,)) if heads is None else ((heads[0], dim), (heads[1], axis))
        one_plus = kind in ("gemma_rmsnorm", "layernorm1p")   # (the stored w of a 1 + w scale)
        self.scale = (None if kind == "layernorm_noparam" else   # OLMo 1's LayerNorm has no parameters
                      param(shape, axes, dtype, rngs, init="zeros" if one_plus else "ones"))
        self.bias = param(shape, axes, dtype, rngs, init="zeros") if kind in ("layernorm", "layernorm1p") else None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        if not self.kind.startswith("layernorm"):
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            if self.kind == "gemma_rmsnorm":
                # Gemma multiplies by (1 + w) in float32 and casts after (HF Gemma2RMSNorm); keeping w
                # as stored keeps its precision in bfloat16, where 1 + w would round
                return (y * (1.0 + self.scale.get_value().astype(jnp.float32))).astype(x.dtype)
            if self.kind == "olmo_rmsnorm":   # OLMo 2: w times the float32 value, cast after (HF Olmo2RMSNorm)
                return (self.scale.get_value().astype(jnp.float32) * y).astype(x.dtype)
            # HF casts back to the input dtype before multiplying by the weight.
            return self.scale.get_value() * y.astype(x.dtype)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        if self.scale is None:
            return y.astype(x.dtype)
        scale = self.scale.get_value().astype(jnp.float32)
        y = y * (1.0 + scale if self.kind == "layernorm1p" else scale)   # Nemotron's LayerNorm1P: 1 + w
        return (y if self.bias is None else y + self.bias.get_value().astype(jnp.float32)).astype(x.dtype)


def rms_unweighted(x: jax.Array, eps: float) -> jax.Array:
    """x divided by its root mean square over the last axis, in float32, cast back (Llama 4's weightless
    q / k norm, transformers' Llama4TextL2Norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


MATMUL_IMPLS = ("auto", "pallas", "xla")


def dense(x: jax.Array, kernel, bias: jax.Array | None, contract: int = 1, impl: str = "auto") -> jax.Array:
    """x [..., in...] @ kernel [in..., out...] (+ bias [out...]); `contract` = number of input dims.
    A QuantizedWeight kernel goes through quant.qdot with `impl` (the layer's `matmul` setting:
    "pallas" | "xla", or "auto" for the backend's default); a weight no kernel can run falls back
    to XLA, since the setting is one choice for the whole model."""
    if isinstance(kernel, QuantizedWeight):
        y = qdot(x, kernel, contract=contract, impl=impl, fallback=True).astype(x.dtype)
    else:
        x_axes = tuple(range(x.ndim - contract, x.ndim))
        y = jax.lax.dot_general(x, kernel, ((x_axes, tuple(range(contract))), ((), ())),
                                precision=dot_precision(x.dtype))
    return y + bias if bias is not None else y


def lora_delta(x: jax.Array, a: jax.Array, bs: tuple, slots: jax.Array, contract: int = 1) -> list[jax.Array]:
    """Multi-LoRA's low-rank update (jaxinfer/lora/execute.py). x [T, *in] (`contract` input dims),
    a [*in, P, L, R] (P parts' A, L slots, rank R), bs: P arrays [L, R, n_p], slots [T] -> P arrays
    [T, n_p]: row t of part p is x[t] @ a[..., p, slots[t], :] @ bs[p][slots[t]], exactly zero where
    slots[t] is outside 0..L-1 (no adapter), and skipped (lax.cond) when no row has one.
    Every slot's A is applied to every token in one matmul and a mask of the token's slot keeps
    its own rank columns (the dense form of Punica's SGMV: the L slots' weights are read once, which
    on CPU beats gathering a [T, in, R] copy per token, BGMV's form)."""
    t = x.shape[0]
    p_, num, r = a.shape[-3:]
    xf = x.reshape(t, -1)                                                            # (T, in)
    prec = dot_precision(x.dtype)

    def update(xf):
        h = jnp.dot(xf, a.reshape(xf.shape[1], p_ * num * r), precision=prec).reshape(t, p_, num * r)
        keep = (slots[:, None] == jnp.arange(num * r)[None, :] // r).astype(x.dtype)   # (T, L R)
        h = h * keep[:, None, :]                                                     # (T, P, L R)
        return [jnp.dot(h[:, j], b.reshape(num * r, -1), precision=prec) for j, b in enumerate(bs)]

    def nothing(xf):
        return [jnp.zeros((t, b.shape[-1]), x.dtype) for b in bs]
    return jax.lax.cond(jnp.any((slots >= 0) & (slots < num)), update, nothing, xf)


class MLP(nnx.Module):
    """Gated (SwiGLU-style: act(x W_gate) * x W_up) or plain (act(x W_fc)) feed-forward.

    shards None: separate gate and up. An int (gated only): one fused `gate_up` [d, 2F] whose columns
    are `shards` groups of [gate columns | up columns] (models/decoder.py, fuse_decoder).
    matmul: how its quantized weights are multiplied (dense; models.decoder.set_matmul_impl)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, shards: int | None = None):
        d, f = cfg.d_model, cfg.ffn_dim
        self.act, self.gated, self.matmul = cfg.activation, cfg.gated_mlp, "auto"
        self.shards = shards if cfg.gated_mlp else None
        bias, fused, gated = cfg.mlp_bias, self.shards is not None, cfg.gated_mlp
        assert not fused or f % self.shards == 0, (f, self.shards)
        self.up = None if fused else param((d, f), ("embed", "mlp"), dtype, rngs)
        self.gate = param((d, f), ("embed", "mlp"), dtype, rngs) if gated and not fused else None
        self.up_bias = param((f,), ("mlp",), dtype, rngs, init="zeros") if bias and not fused else None
        self.gate_bias = param((f,), ("mlp",), dtype, rngs, init="zeros") if bias and gated and not fused else None
        axis = "gate_up" if fused and self.shards > 1 else None
        self.gate_up = param((d, 2 * f), ("embed", axis), dtype, rngs) if fused else None
        self.gate_up_bias = param((2 * f,), (axis,), dtype, rngs, init="zeros") if fused and bias else None
        self.down = param((f, d), ("mlp", "embed"), dtype, rngs)
        self.down_bias = param((d,), ("embed",), dtype, rngs, init="zeros") if bias else None
        # xIELU's [alpha_p, alpha_n, beta, eps] (replicated under tensor parallelism)
        self.xielu = param((4,), (None,), dtype, rngs, init="zeros") if cfg.activation == "xielu" else None

    def __call__(self, x: jax.Array, lora: tuple | None = None) -> jax.Array:
        """lora: (token slots [T], this layer's LoRA stacks: group -> (A, B)) or None (lora_delta)."""
        h = self.hidden(x, lora)
        y = dense(h, self.down.get_value(), param_value(self.down_bias), impl=self.matmul)
        return y if lora is None else y + lora_delta(h, *lora[1]["down"], lora[0])[0]

    def hidden(self, x: jax.Array, lora: tuple | None = None) -> jax.Array:
        """x [T, D] -> the `down` projection's input [T, F] (what calibration sees)."""
        act = (ACTIVATIONS[self.act] if self.xielu is None else
               lambda y: xielu(y, self.xielu.get_value()))  # noqa: E731
        if self.gate_up is not None:
            y = dense(x, self.gate_up.get_value(), param_value(self.gate_up_bias), impl=self.matmul)
            gate, up = split_gate_up(y, self.shards)
            if lora is not None:   # the adapters' gate and up columns in the original order
                d_gate, d_up = lora_delta(x, *lora[1]["gate_up"], lora[0])
                gate, up = gate + d_gate, up + d_up
            h = act(gate) * up
        else:
            h = dense(x, self.up.get_value(), param_value(self.up_bias), impl=self.matmul)
            if lora is not None:   # an ungated MLP's up (a gated MLP is fused: gate_up above)
                h = h + lora_delta(x, *lora[1]["up"], lora[0])[0]
            if self.gated:
                h = act(dense(x, self.gate.get_value(), param_value(self.gate_bias), impl=self.matmul)) * h
            else:
                h = act(h)
        return h


def split_gate_up(y: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """A fused gate_up projection's output [..., 2F], `shards` groups of [gate | up] columns
    (models/decoder.py, fuse_decoder) -> gate [..., F], up [..., F] in the original column order."""
    lead = y.shape[:-1]
    y = y.reshape(*lead, shards, 2, -1)                                        # (.., s, gate | up, F / s)
    return y[..., 0, :].reshape(*lead, -1), y[..., 1, :].reshape(*lead, -1)


def swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation (HF GptOssExperts._apply_gate): the gate clipped above at `limit`,
    the up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def param_value(p: nnx.Param | None):
    return None if p is None else p.get_value()


# ----------------------------------------------------------------------------------- positions

def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [dim/2] (float32) of the `dim` rotated features, with linear, Llama-3.1,
    LongRoPE or YaRN scaling applied."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.kind == "longrope":
        # Phi-3: each frequency divided by its own factor, 1 / (factor_i * theta^(2i/d)) as HF computes
        # it; the long or the short set for every position (hf_configs._longrope says why)
        factors = np.asarray(scaling.long_factor if scaling.use_long_factor else scaling.short_factor, np.float32)
        return (1.0 / (factors * theta ** exponents)).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, (theta ** exponents).astype(np.float32))
    assert scaling.kind == "llama3", scaling
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling, pos_freqs: np.ndarray) -> np.ndarray:
    """YaRN (Peng et al. 2023, as HF's _compute_yarn_parameters): frequency i keeps its value where its
    wavelength turns more than beta_fast times in the original context, is divided by `factor` where
    it turns fewer than beta_slow times, and is blended linearly (by dimension index) in between."""
    def correction_dim(rotations: float) -> float:   # the dimension whose frequency turns `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high     # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)             # 1: the original frequency, 0: interpolated
    return ((1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep).astype(np.float32)


def rope_magnitude(scaling: RopeScaling | None) -> float:
    """The factor on cos and sin (LongRoPE's and YaRN's attention factor; 1 otherwise)."""
    return scaling.attention_factor if scaling is not None and scaling.kind in ("longrope", "yarn") else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, mscale: float = 1.0) -> jax.Array:
    """Rotate x [T, heads, head_dim] by positions [T]; HF's rotate_half layout (halves, not pairs).
    inv_freq [r/2]: the first r features rotate (partial rotary), the rest pass through.
    mscale multiplies cos and sin (LongRoPE's attention factor)."""
    rot = 2 * inv_freq.shape[-1]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq                 # (T, r/2)
    cos = (jnp.concatenate([jnp.cos(angles)] * 2, axis=-1) * mscale)[:, None, :]   # (T, 1, r)
    sin = (jnp.concatenate([jnp.sin(angles)] * 2, axis=-1) * mscale)[:, None, :]
    xr = x[..., :rot]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    # HF applies cos/sin in the activation dtype; doing it in f32 is at least as accurate.
    out = (xr.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
    return out if rot == x.shape[-1] else jnp.concatenate([out, x[..., rot:]], axis=-1)


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi slopes [n_heads] (Press et al.; BLOOM's handling of head counts that are not powers of 2)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** p for p in range(1, 1 + 2 * min(closest, n_heads - closest), 2)]
    return np.asarray(slopes, np.float32)


def sinusoidal_table(n_positions: int, dim: int) -> np.ndarray:
    """The Transformer's fixed sinusoidal positions (Vaswani et al. 2017, sec. 3.5):
    PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)).  Shape [n_positions, dim]."""
    pos = np.arange(n_positions, dtype=np.float64)[:, None]
    i = np.arange(0, dim, 2, dtype=np.float64)[None, :]
    angle = pos / np.power(10000.0, i / dim)
    table = np.zeros((n_positions, dim), np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : dim // 2])
    return table.astype(np.float32)


def sinusoidal_embedding(positions: jax.Array, dim: int) -> jax.Array:
    """The same formula evaluated on the fly for positions [T] -> [T, dim] (no table, no length limit)."""
    i = jnp.arange(0, dim, 2, dtype=jnp.float32)
    angle = positions.astype(jnp.float32)[:, None] / jnp.power(10000.0, i / dim)[None, :]
    out = jnp.zeros((positions.shape[0], dim), jnp.float32)
    out = out.at[:, 0::2].set(jnp.sin(angle))
    return out.at[:, 1::2].set(jnp.cos(angle[:, : dim // 2]))
