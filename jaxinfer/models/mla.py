"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; transformers' DeepseekV3Attention), in its
absorbed form over the one attention entry point.

Per token: a latent c = norm(x W_kv_down[:, :r]) of r = mla_kv_rank features and a key part
k_pe = rope(x W_kv_down[:, r:]) of mla_rope_dim features shared by every head. Head h's key is
[c W_k_up[h] | k_pe] and its value c W_v_up[h]; its query [q_nope | rope(q_pe)] comes from x through
W_q (or the normed bottleneck W_q_down, W_q_up). Since q_nope . (c W_k_up[h]) = (W_k_up[h] q_nope) . c,
each head's query is folded into the latent space, [W_k_up[h] q_nope | q_pe], and every head attends to
the same cached vector [c | k_pe]: multi-query attention with one KV head of head_dim = r +
mla_rope_dim (the K pages hold that vector; the values are read from them, since the attention's
value is the same vector: ModelConfig.kv_value_dim 0, no V pages). The first r features of
each head's output, the softmax-weighted sum of c, go through W_v_up[h], then W_o. The scores are the
expanded form's (the softmax scale is cfg.softmax_scale: 1/sqrt(nope + rope) times YaRN's mscale^2),
summed in another order.

DeepSeek stores the RoPE features interleaved in pairs (rope_interleave); hf_maps de-interleaves the
columns of W_q's and W_kv_down's RoPE features at load, after which the usual half-split RoPE gives
the same q . k.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.attention import attention
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import AttentionMetadata, LayerKV
from jaxinfer.layers import Norm, apply_rope, dense, param, param_value, rope_inv_freq, rope_magnitude
from jaxinfer.quant import dot_precision

LATENT_NORM_EPS = 1e-6   # transformers' DeepseekV3RMSNorm default: the latent norms take no config eps


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None):
        d, h, r, qr = cfg.d_model, cfg.n_heads, cfg.mla_kv_rank, cfg.mla_q_rank
        qk = cfg.mla_nope_dim + cfg.mla_rope_dim
        self.cfg, self.window, self.matmul = cfg, None, "auto"
        bias = cfg.out_bias   # DeepSeek's attention_bias: q_a, kv_a and o
        self.q_full = param((d, h, qk), ("embed", "heads", None), dtype, rngs) if not qr else None
        self.q_down = param((d, qr), ("embed", None), dtype, rngs) if qr else None
        self.q_down_bias = param((qr,), (None,), dtype, rngs, init="zeros") if qr and bias else None
        self.q_norm = Norm(qr, "rmsnorm", LATENT_NORM_EPS, dtype, rngs, axis=None) if qr else None
        self.q_up = param((qr, h, qk), (None, "heads", None), dtype, rngs) if qr else None
        self.kv_down = param((d, r + cfg.mla_rope_dim), ("embed", None), dtype, rngs)
        self.kv_down_bias = param((r + cfg.mla_rope_dim,), (None,), dtype, rngs, init="zeros") if bias else None
        self.kv_norm = Norm(r, "rmsnorm", LATENT_NORM_EPS, dtype, rngs, axis=None)
        self.k_up = param((r, h, cfg.mla_nope_dim), (None, "heads", None), dtype, rngs)
        self.v_up = param((r, h, cfg.mla_v_dim), (None, "heads", None), dtype, rngs)
        self.o = param((h, cfg.mla_v_dim, d), ("heads", None, "embed"), dtype, rngs)
        self.o_bias = param((d,), ("embed",), dtype, rngs, init="zeros") if bias else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv: LayerKV | None,
                 meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
                 ) -> tuple[jax.Array, LayerKV | None]:
        assert lora is None, "LoRA adapters are not available with latent attention"
        out, kv = self.attend(x, positions, kv, meta, impl)
        return dense(out, self.o.get_value(), param_value(self.o_bias), contract=2, impl=self.matmul), kv

    def attend(self, x: jax.Array, positions: jax.Array, kv: LayerKV | None,
               meta: AttentionMetadata | None, impl: str) -> tuple[jax.Array, LayerKV | None]:
        """x [T, D] -> each head's value-space output before `o` [T, H, mla_v_dim]."""
        cfg = self.cfg
        nope, r = cfg.mla_nope_dim, cfg.mla_kv_rank
        if self.q_full is not None:
            q = dense(x, self.q_full.get_value(), None, impl=self.matmul)                      # (T, H, qk)
        else:
            q = self.q_norm(dense(x, self.q_down.get_value(), param_value(self.q_down_bias), impl=self.matmul))
            q = dense(q, self.q_up.get_value(), None, impl=self.matmul)
        latent = dense(x, self.kv_down.get_value(), param_value(self.kv_down_bias), impl=self.matmul)  # (T, r + rope)
        c, k_pe = self.kv_norm(latent[..., :r]), latent[..., r:]
        inv_freq = jnp.asarray(rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling))
        mscale = rope_magnitude(cfg.rope_scaling)
        q_pe = apply_rope(q[..., nope:], positions, inv_freq, mscale)
        k_pe = apply_rope(k_pe[:, None, :], positions, inv_freq, mscale)                          # (T, 1, rope)
        q_latent = jnp.einsum("thn,rhn->thr", q[..., :nope], _float(self.k_up, q.dtype),
                              precision=dot_precision(q.dtype))                                    # (T, H, r)
        query = jnp.concatenate([q_latent, q_pe], axis=-1)                                          # (T, H, r + rope)
        key = jnp.concatenate([c[:, None, :].astype(k_pe.dtype), k_pe], axis=-1)                    # (T, 1, r + rope)
        out, kv = attention(query, key, key, positions, scale=cfg.softmax_scale, window=self.window, kv=kv,
                            meta=meta, impl=impl)
        heads = jnp.einsum("thr,rhv->thv", out[..., :r], _float(self.v_up, out.dtype),
                           precision=dot_precision(out.dtype))                                     # (T, H, v)
        return heads, kv


def _float(p: nnx.Param, dtype) -> jax.Array:
    """A weight the absorbed form multiplies directly (always float: quantize= leaves k_up / v_up
    alone and a pre-quantized checkpoint's are dequantized at load)."""
    return p.get_value().astype(dtype)
