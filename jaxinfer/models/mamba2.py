"""Mamba-2's mixer (Dao and Gu, "Transformers are SSMs", arXiv 2405.21060: the selective state space
of state space duality), as IBM's Granite 4.0-H hybrids hold it (transformers'
GraniteMoeHybridMambaLayer, Mamba2Mixer's computation). Per head, with A = -exp(A_log) and the step
dt = softplus(x W_dt + dt_bias) (clamped to cfg.ssm_dt_limit): the state H [N, P] becomes
exp(dt A) H + B (dt x)^T and the output is H^T C + D x, B and C shared by the heads of a group. That
is the gated delta rule of models/deltanet.py without its delta correction (q = C, k = B, v = x,
beta = dt, g = dt A), so it runs on the same step machinery: decode rows at once, prefill chunks by
token or in closed form, each sequence's state (its convolution's last inputs, one [N, P] matrix
per head) in its state slot as a kv_cache.DeltaState."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import AttentionMetadata, DeltaState
from jaxinfer.layers import dense, param
from jaxinfer.models.deltanet import causal_conv, recurrent_step, store_conv_inputs


class Mamba2(nnx.Module):
    """A Mamba-2 layer of linear_v_heads heads of linear_v_dim (P) features, linear_k_heads groups
    (G) of state size linear_k_dim (N), conv_kernel taps. From x [T, D]: xBC = x W_xbc (in_proj_qkv,
    the x, B and C channels) through the causal depthwise convolution (+ its bias where conv_bias)
    and SiLU; z = x W_z; dt from x W_dt (in_proj_a); the rule (module docstring); y = (o + D x) SiLU(z),
    RMS-normed over each group's H / G heads (weight `norm`), then W_out. Rounding as transformers'
    chunked scan: the projections, the convolution, SiLU and dt in the model dtype; the rule, the
    gate and the norm in float32, rounded once before W_out. The upload's one in_proj (rows z, xBC,
    dt) is split into these at load (hf_maps)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, h, c = cfg.d_model, cfg.linear_v_heads, cfg.linear_conv_dim
        inner = h * cfg.linear_v_dim
        self.cfg = cfg
        self.in_proj_qkv = param((d, c), ("embed", None), dtype, rngs)
        self.in_proj_z = param((d, inner), ("embed", None), dtype, rngs)
        self.in_proj_a = param((d, h), ("embed", None), dtype, rngs)
        self.conv = param((cfg.conv_kernel, c), (None, None), dtype, rngs)
        self.conv_bias = param((c,), (None,), dtype, rngs, init="zeros") if cfg.conv_bias else None
        self.dt_bias = param((h,), (None,), dtype, rngs, init="ones")
        self.A_log = param((h,), (None,), dtype, rngs, init="zeros")
        self.D = param((h,), (None,), dtype, rngs, init="ones")
        self.norm = param((inner,), (None,), dtype, rngs, init="ones")
        self.out_proj = param((inner, d), (None, "embed"), dtype, rngs)
        self.matmul = "auto"
        self.closed_form: bool | None = None   # as GatedDeltaNet's (deltanet.recurrent_step)

    def __call__(self, x: jax.Array, positions: jax.Array, state: DeltaState | None,
                 meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
                 ) -> tuple[jax.Array, DeltaState | None]:
        assert lora is None, "LoRA adapts no Mamba-2 layer (lora/adapter.py refuses the family)"
        cfg, dtype, t = self.cfg, x.dtype, x.shape[0]
        g, h, n, p = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        f32 = jnp.float32
        xbc = dense(x, self.in_proj_qkv.get_value(), None, impl=self.matmul)                      # (T, C)
        z = dense(x, self.in_proj_z.get_value(), None, impl=self.matmul)                          # (T, H P)
        a = dense(x, self.in_proj_a.get_value(), None, impl=self.matmul)                          # (T, H)
        row = jnp.zeros(t, jnp.int32) if meta is None else meta.seq_ids
        slot = None if state is None else meta.state_slots[row]
        conv = causal_conv(xbc, self.conv.get_value().astype(f32), positions, row,
                           None if state is None else state.u, slot)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias.get_value().astype(f32)
        conv = jax.nn.silu(conv.astype(dtype).astype(f32)).astype(dtype).astype(f32)
        xs = conv[:, :h * p].reshape(t, h, p)
        bc = conv[:, h * p:].reshape(t, 2, g, n)
        k, q = jnp.repeat(bc[:, 0], h // g, axis=1), jnp.repeat(bc[:, 1], h // g, axis=1)      # (T, H, N)
        dt = jax.nn.softplus((a.astype(f32) + self.dt_bias.get_value().astype(f32)).astype(dtype).astype(f32))
        dt = dt.astype(dtype).astype(f32)
        if cfg.ssm_dt_limit is not None:   # (as torch clamps a tensor of the model's dtype: each bound rounded to it)
            dt = jnp.clip(dt, *cfg.ssm_dt_limit).astype(dtype).astype(f32)
        decay = -jnp.exp(self.A_log.get_value().astype(f32)) * dt                                 # (T, H)
        o, hs = recurrent_step(q, k, xs, decay, dt, row, positions, state, meta, self.closed_form, delta=False)
        y = (o + self.D.get_value().astype(f32)[:, None] * xs).reshape(t, h * p) * jax.nn.silu(z.astype(f32))
        grouped = y.reshape(t, g, -1)
        y = (grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + cfg.norm_eps))
        y = (self.norm.get_value().astype(f32) * y.reshape(t, h * p)).astype(dtype)
        out = dense(y, self.out_proj.get_value(), None, impl=self.matmul)
        if state is None:
            return out, None
        return out, DeltaState(store_conv_inputs(xbc, state.u, positions, row, slot, meta), hs)
