"""One configurable decoder-only transformer (Flax NNX) for every supported family.

Llama / Mistral / Qwen2 (RMSNorm, RoPE, GQA, SwiGLU), GPT-2 (LayerNorm, learned positions,
GELU) and BLOOM (ALiBi, embedding LayerNorm) differ only in ModelConfig fields; there is no
per-family model code. Weight-name maps for loading HF checkpoints live in models/hf_maps.py.

The forward pass works on a flat, ragged batch of T tokens (DESIGN.md): tokens [T],
positions [T], and either no cache (one sequence, full causal attention) or per-layer KV pages
with AttentionMetadata. Layers are a Python list, unrolled under jit, so each layer's pages
are updated in place when the cache is donated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.attention import attention
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import AttentionMetadata, LayerKV
from jaxinfer.layers import (MLP, Norm, alibi_slopes, apply_rope, dense, param, param_value, rope_inv_freq,
                             sinusoidal_embedding)
from jaxinfer.quant import quantize


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg, self.window = cfg, cfg.layer_window(layer)
        self.q = param((d, h, hd), ("embed", "heads", "head_dim"), dtype, rngs)
        self.k = param((d, kv, hd), ("embed", "kv_heads", "head_dim"), dtype, rngs)
        self.v = param((d, kv, hd), ("embed", "kv_heads", "head_dim"), dtype, rngs)
        self.o = param((h, hd, d), ("heads", "head_dim", "embed"), dtype, rngs)
        qkv_bias = cfg.qkv_bias
        self.q_bias = param((h, hd), ("heads", "head_dim"), dtype, rngs, init="zeros") if qkv_bias else None
        self.k_bias = param((kv, hd), ("kv_heads", "head_dim"), dtype, rngs, init="zeros") if qkv_bias else None
        self.v_bias = param((kv, hd), ("kv_heads", "head_dim"), dtype, rngs, init="zeros") if qkv_bias else None
        self.o_bias = param((d,), ("embed",), dtype, rngs, init="zeros") if cfg.out_bias else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv: LayerKV | None,
                 meta: AttentionMetadata | None, impl: str) -> tuple[jax.Array, LayerKV | None]:
        cfg = self.cfg
        q = dense(x, self.q.get_value(), param_value(self.q_bias))                    # (T, H, hd)
        k = dense(x, self.k.get_value(), param_value(self.k_bias))                    # (T, Hkv, hd)
        v = dense(x, self.v.get_value(), param_value(self.v_bias))
        alibi = None
        if cfg.position == "rope":
            inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        elif cfg.position == "alibi":
            alibi = jnp.asarray(alibi_slopes(cfg.n_heads))
        out, kv = attention(q, k, v, positions, scale=cfg.head_dim ** -0.5, window=self.window,
                            alibi=alibi, kv=kv, meta=meta, impl=impl)
        return dense(out, self.o.get_value(), param_value(self.o_bias), contract=2), kv   # (T, D)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None):
        self.residual_post_norm = cfg.residual_post_norm
        self.attn_norm = Norm(cfg.d_model, cfg.norm, cfg.norm_eps, dtype, rngs)
        self.attn = Attention(cfg, layer, dtype, rngs)
        self.mlp_norm = Norm(cfg.d_model, cfg.norm, cfg.norm_eps, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, kv, meta, impl):
        h = self.attn_norm(x)
        attn_out, kv = self.attn(h, positions, kv, meta, impl)
        x = (h if self.residual_post_norm else x) + attn_out
        h = self.mlp_norm(x)
        return (h if self.residual_post_norm else x) + self.mlp(h), kv


class Decoder(nnx.Module):
    """tokens [T], positions [T] (+ KV pages, metadata) -> logits [T or N, vocab] float32."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        d = cfg.d_model
        self.embed = param((cfg.vocab_size, d), ("vocab", "embed"), dtype, rngs)
        self.pos_embed = (param((cfg.max_position_embeddings, d), ("position", "embed"), dtype, rngs)
                          if cfg.position == "learned" else None)
        self.embed_norm = Norm(d, cfg.norm, cfg.norm_eps, dtype, rngs) if cfg.embed_norm else None
        self.layers = nnx.List([Block(cfg, i, dtype, rngs) for i in range(cfg.n_layers)])
        self.final_norm = Norm(d, cfg.norm, cfg.norm_eps, dtype, rngs)
        self.lm_head = None if cfg.tie_embeddings else param((d, cfg.vocab_size), ("embed", "vocab"), dtype, rngs)

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """tokens [T], positions [T] -> the first block's input [T, D] (token + position
        embeddings, then the embedding norm where the family has one)."""
        x = self.embed.get_value()[tokens]                                     # (T, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed.get_value()[positions]
        elif self.cfg.position == "sinusoidal":
            x = x + sinusoidal_embedding(positions, self.cfg.d_model).astype(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, kv_pages: list[LayerKV] | None = None,
                      meta: AttentionMetadata | None = None,
                      impl: str = "xla") -> tuple[jax.Array, list[LayerKV] | None]:
        """The final-norm hidden states [T, D] and the updated pages."""
        x = self.embed_tokens(tokens, positions)
        new_pages = [] if kv_pages is not None else None
        for i, block in enumerate(self.layers):
            x, layer_kv = block(x, positions, None if kv_pages is None else kv_pages[i], meta, impl)
            if new_pages is not None:
                new_pages.append(layer_kv)
        return self.final_norm(x), new_pages

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states [N, D] -> float32 logits [N, vocab]."""
        w = self.embed.get_value().T if self.lm_head is None else self.lm_head.get_value()
        return jnp.dot(h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_pages: list[LayerKV] | None = None,
                 meta: AttentionMetadata | None = None, logits_indices: jax.Array | None = None,
                 impl: str = "xla") -> tuple[jax.Array, list[LayerKV] | None]:
        """logits_indices [N]: compute logits only for these token rows (the last of each sequence)."""
        h, kv_pages = self.hidden_states(tokens, positions, kv_pages, meta, impl)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.logits(h), kv_pages


def abstract_decoder(cfg: ModelConfig, dtype) -> Decoder:
    """A Decoder whose parameters are ShapeDtypeStructs: the shape/dtype target for loading."""
    return nnx.eval_shape(lambda: Decoder(cfg, dtype, rngs=None))


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat 'a/b/c' name -> shape of every parameter (for loaders and shape checks)."""
    model = abstract_decoder(cfg, jnp.float32)
    flat = nnx.state(model, nnx.Param).flat_state()
    return {"/".join(map(str, path)): tuple(v.get_value().shape) for path, v in flat}


def count_params(model: Decoder) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


# matmul weights that quantize (name -> contracted leading dims); embeddings, norms, biases and
# the LM head stay in the model dtype (as llama.cpp keeps the output layer at higher precision)
_QUANTIZED = {"q": 1, "k": 1, "v": 1, "o": 2, "up": 1, "gate": 1, "down": 1}


def quantize_decoder(model: Decoder, method: str, group_size: int = 128) -> Decoder:
    """Weight-only quantization in place: "int8" (per output channel) or "int4" (group-wise along K,
    symmetric; the group shrinks to 64 or 32 when K is not a multiple of 128, and a matrix whose K
    fits none of them stays int8)."""
    bits = {"int8": 8, "int4": 4}[method]
    for path, var in nnx.state(model, nnx.Param).flat_state():
        name = str(path[-1])
        if name not in _QUANTIZED or len(path) < 2:
            continue
        w = var.get_value()
        contract = _QUANTIZED[name]
        k = int(np.prod(w.shape[:contract]))
        if bits == 4:
            g = next((g for g in (group_size, 64, 32) if k % g == 0 and g <= group_size), None)
            qw = quantize(w, 4, group_size=g, contract=contract) if g else quantize(w, 8, contract=contract)
        else:
            qw = quantize(w, 8, contract=contract)
        var.set_value(qw)
    return model
