"""One configurable decoder-only transformer (Flax NNX) for every supported family.

Llama / Mistral / Qwen2 (RMSNorm, RoPE, GQA, SwiGLU), Qwen3 (+ per-head q/k norms), Gemma 2 and 3
(GeGLU, scaled embeddings, (1 + w) norms around attention and MLP, soft-capped scores and logits,
alternating sliding and global layers, per-layer RoPE base), Phi-3 / Phi-4-mini (LongRoPE, partial
rotary), GPT-2 (LayerNorm, learned positions, GELU), BLOOM (ALiBi, embedding LayerNorm) and the
mixtures of experts, Mixtral, Qwen3-MoE and gpt-oss (Block.mlp is a jaxinfer.moe.MoE on the layers
cfg.is_moe_layer marks; gpt-oss adds attention sinks and YaRN), differ only in ModelConfig fields;
there is no per-family model code. config.json -> ModelConfig lives in models/hf_configs.py, HF
weight names in models/hf_maps.py.

Per-layer settings (the sliding window, Gemma 3's local RoPE base) are static attributes of each
layer's Attention, read from cfg.layer_window / cfg.is_sliding when the layer is built, so every
layer's attention call has static shapes and a static window; pipeline.py overrides them per stage.

The forward pass works on a flat, ragged batch of T tokens (DESIGN.md): tokens [T],
positions [T], and either no cache (one sequence, full causal attention) or per-layer KV pages
with AttentionMetadata. Layers are a Python list, unrolled under jit, so each layer's pages
are updated in place when the cache is donated.

Fused projections (fuse_decoder). Checkpoints and the loaders use one matrix per projection
(q, k, v; gate, up). For serving, fuse_decoder(model, tp) concatenates them in memory into one
`qkv` [d, N] and one `gate_up` [d, 2F] per layer ([E, d, 2F] in an MoE layer, per expert), so a
step runs 2 matmuls where it ran 5. Their columns are grouped per tensor-parallel shard: shard i of
`qkv` is [its q heads | its k heads | its v heads] and shard i of `gate_up` is [its gate columns |
its up columns], so splitting the fused output axis over "tensor" gives each device what it needs
with no communication. When
n_kv_heads does not divide over tp, each KV head is repeated kv_replicas times (the smallest count
that gives every device whole KV heads of its own query heads, as vLLM does), and the fused model's
cfg says n_kv_heads * kv_replicas: its KV pages shard over "tensor" instead of being replicated.
The forward is the same computation (fusion only concatenates columns); unfuse_decoder inverts it
for saving and exporting.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import perf
from jaxinfer.attention import attention
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.kv_cache import PAD_SLOT, AttentionMetadata, ConvState, LayerKV
from jaxinfer.layers import (MATMUL_IMPLS, MLP, Norm, alibi_slopes, apply_rope, dense, lora_delta, param, param_value,
                             rms_unweighted, rope_inv_freq, rope_magnitude, sinusoidal_embedding)
from jaxinfer.models.deltanet import GatedDeltaNet, causal_conv, store_conv_inputs
from jaxinfer.models.mamba2 import Mamba2
from jaxinfer.models.mla import MLAttention
from jaxinfer.moe import MoE
from jaxinfer.quant import QuantizedWeight, dot_precision, quantize, quantize_experts, quantize_fp8


class Attention(nnx.Module):
    """shards None: separate q, k, v. An int: one fused `qkv` [d, (H + 2 Hkv) hd] whose columns are
    `shards` groups of [H/shards q heads | Hkv/shards k heads | Hkv/shards v heads] (module docstring).
    matmul: how its quantized projections are multiplied (layers.dense; set_matmul_impl)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None, shards: int | None = None):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.cfg, self.window, self.shards, self.matmul = cfg, cfg.layer_window(layer), shards, "auto"
        # Gemma 3: the sliding layers' RoPE base (a traced bool where pipeline stages differ)
        self.local_rope = cfg.rope_local_theta is not None and cfg.is_sliding(layer)
        # SmolLM3's NoPE layers rotate nothing (a traced bool where pipeline stages differ)
        self.use_rope = cfg.uses_rope(layer)
        qkv_bias, fused = cfg.qkv_bias, shards is not None
        assert not fused or (h % shards == 0 and kv % shards == 0), (h, kv, shards)
        unfused = lambda shape, axes, bias=False: (None if fused or (bias and not qkv_bias) else  # noqa: E731
                                                   param(shape, axes, dtype, rngs, init="zeros" if bias else "normal"))
        self.q = unfused((d, h, hd), ("embed", "heads", "head_dim"))
        self.k = unfused((d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.v = unfused((d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.q_bias = unfused((h, hd), ("heads", "head_dim"), bias=True)
        self.k_bias = unfused((kv, hd), ("kv_heads", "head_dim"), bias=True)
        self.v_bias = unfused((kv, hd), ("kv_heads", "head_dim"), bias=True)
        n, axis = (h + 2 * kv) * hd, "qkv" if fused and shards > 1 else None
        self.qkv = param((d, n), ("embed", axis), dtype, rngs) if fused else None
        self.qkv_bias = param((n,), (axis,), dtype, rngs, init="zeros") if fused and qkv_bias else None
        self.o = param((h, hd, d), ("heads", "head_dim", "embed"), dtype, rngs)
        self.o_bias = param((d,), ("embed",), dtype, rngs, init="zeros") if cfg.out_bias else None
        # one weight per head_dim feature, shared by every head (replicated under tensor parallelism);
        # OLMo 2: one per feature of the whole projection (qk_norm_full), its mean over every head
        # Cohere (qk_norm_heads): one weight per head and feature, statistics over each head
        qk_norm = lambda n, axis: Norm(  # noqa: E731
            n * hd if cfg.qk_norm_full else hd, cfg.qk_norm_kind, cfg.norm_eps, dtype, rngs,
            axis=None if cfg.qk_norm_full else "head_dim", heads=(n, axis) if cfg.qk_norm_heads else None)
        self.q_norm = qk_norm(h, "heads") if cfg.qk_norm else None
        self.k_norm = qk_norm(kv, "kv_heads") if cfg.qk_norm else None
        # gpt-oss: one logit per query head that joins every softmax's denominator (a key with value 0)
        self.sinks = param((h,), ("heads",), dtype, rngs, init="zeros") if cfg.attn_sinks else None
        # AFMoE: a sigmoid gate on each head's output features, from the block's input (never fused)
        self.out_gate = param((d, h, hd), ("embed", "heads", "head_dim"), dtype, rngs) if cfg.attn_out_gate else None

    def project_qkv(self, x: jax.Array, lora: tuple | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> q [T, H, hd], k, v [T, Hkv, hd]. lora: (token slots [T], this layer's LoRA
        stacks) or None (fused models only: jaxinfer/lora/)."""
        if self.qkv is None:
            assert lora is None, "LoRA runs on the fused model"
            return (dense(x, self.q.get_value(), param_value(self.q_bias), impl=self.matmul),
                    dense(x, self.k.get_value(), param_value(self.k_bias), impl=self.matmul),
                    dense(x, self.v.get_value(), param_value(self.v_bias), impl=self.matmul))
        cfg, s = self.cfg, self.shards
        hq, hk = cfg.n_heads // s, cfg.n_kv_heads // s
        y = dense(x, self.qkv.get_value(), param_value(self.qkv_bias), impl=self.matmul)   # (T, N)
        y = y.reshape(*x.shape[:-1], s, hq + 2 * hk, cfg.head_dim)                    # (T, s, hq + 2 hk, hd)
        heads = lambda a: a.reshape(*a.shape[:-3], -1, cfg.head_dim)  # noqa: E731     (T, s * heads, hd)
        q, k, v = heads(y[..., :hq, :]), heads(y[..., hq:hq + hk, :]), heads(y[..., hq + hk:, :])
        if lora is None:
            return q, k, v
        # the adapters' q, k, v in these heads' order (KV heads repeated as the fused cfg counts them)
        dq, dk, dv = lora_delta(x, *lora[1]["qkv"], lora[0])
        return q + dq.reshape(q.shape), k + dk.reshape(k.shape), v + dv.reshape(v.shape)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: LayerKV | None,
                 meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
                 ) -> tuple[jax.Array, LayerKV | None]:
        out, kv = self.attend(x, positions, kv, meta, impl, lora)
        if self.out_gate is not None:   # the sigmoid rounded once from float32 to the gate's dtype, as torch's
            g = dense(x, self.out_gate.get_value(), None, impl=self.matmul)
            out = out * jax.nn.sigmoid(g.astype(jnp.float32)).astype(g.dtype)
        y = dense(out, self.o.get_value(), param_value(self.o_bias), contract=2, impl=self.matmul)   # (T, D)
        return (y if lora is None else y + lora_delta(out, *lora[1]["o"], lora[0], contract=2)[0]), kv

    def qk_norms(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q and k through their norms, where the family has them: per head, or over each token's heads
        together (qk_norm_full)."""
        if self.q_norm is None:
            return q, k
        if self.cfg.qk_norm_full:
            return (self.q_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape),
                    self.k_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape))
        return self.q_norm(q), self.k_norm(k)

    def rope(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [T, H, hd], k [T, Hkv, hd] rotated by this layer's RoPE (its base, scaling, rotated features)."""
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        mscale = rope_magnitude(cfg.rope_scaling)
        if cfg.rope_local_theta is not None:
            local = rope_inv_freq(cfg.rope_dim, cfg.rope_local_theta, None)
            if isinstance(self.local_rope, bool):
                inv_freq, mscale = (local, 1.0) if self.local_rope else (inv_freq, mscale)
            else:   # a pipeline stage's traced choice (pipeline.py)
                inv_freq = jnp.where(self.local_rope, local, inv_freq)
                mscale = jnp.where(self.local_rope, 1.0, mscale)
        inv_freq = jnp.asarray(inv_freq)
        return apply_rope(q, positions, inv_freq, mscale), apply_rope(k, positions, inv_freq, mscale)

    def attend(self, x: jax.Array, positions: jax.Array, kv: LayerKV | None,
               meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
               ) -> tuple[jax.Array, LayerKV | None]:
        """x [T, D] -> the heads' outputs before the `o` projection [T, H, hd] (what calibration sees)."""
        cfg = self.cfg
        q, k, v = self.project_qkv(x, lora)                                                 # (T, H | Hkv, hd)
        if not cfg.qk_norm_after_rope:
            q, k = self.qk_norms(q, k)
        if cfg.clip_qkv is not None:   # OLMo 1
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        alibi = None
        if cfg.nope_query_scale is not None and self.use_rope is not True:   # Llama 4's layers without RoPE
            attn_scale, floor_scale = cfg.nope_query_scale
            grow = 1.0 + attn_scale * jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale))
            scaled = (q.astype(jnp.float32) * grow[:, None, None]).astype(q.dtype)
            q = scaled if self.use_rope is False else jnp.where(self.use_rope, q, scaled)
        if cfg.position == "rope" and self.use_rope is not False:
            qr, kr = self.rope(q, k, positions)
            if cfg.qk_rms_after_rope:   # Llama 4: on the RoPE layers only
                qr, kr = rms_unweighted(qr, cfg.norm_eps), rms_unweighted(kr, cfg.norm_eps)
            if self.use_rope is True:
                q, k = qr, kr
            else:   # a pipeline stage's traced choice (pipeline.py)
                q, k = jnp.where(self.use_rope, qr, q), jnp.where(self.use_rope, kr, k)
            if cfg.query_log_scale is not None:   # Ministral 3: in the queries' dtype, as transformers
                beta, period = cfg.query_log_scale
                grow = 1.0 + beta * jnp.log1p(jnp.floor(positions.astype(jnp.float32) / period))
                q = q * grow.astype(q.dtype)[:, None, None]
        elif cfg.position == "alibi":
            alibi = jnp.asarray(alibi_slopes(cfg.n_heads))
        if cfg.qk_norm_after_rope:   # HunYuan
            q, k = self.qk_norms(q, k)
        sinks = None if self.sinks is None else self.sinks.get_value().astype(jnp.float32)
        return attention(q, k, v, positions, scale=cfg.softmax_scale, window=self.window, alibi=alibi,
                         softcap=cfg.attn_softcap, sinks=sinks, kv=kv, meta=meta, impl=impl)


class ShortConv(nnx.Module):
    """LFM2's gated short convolution, a conv layer's token mixer in attention's place: B, C, v = the
    thirds of x W_in (+ bias) [T, D] each; u = B v; a causal depthwise convolution of L = conv_kernel taps
    along each sequence, conv[p] = sum_j w[j] u[p - (L - 1) + j] (+ bias), zero before position 0;
    y = (C conv) W_out (+ bias). In a paged step each token reads the earlier inputs of its own row from
    the step, and those before its row's first token from the row's ConvState slot (meta.state_slots),
    then the last L - 1 inputs of each row are written there (padding and stopped rows, whose slot
    mapping is PAD_SLOT, write nothing). Without pages: one sequence from position 0."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, taps = cfg.d_model, cfg.conv_kernel
        bias = lambda n: param((n,), (None,), dtype, rngs, init="zeros") if cfg.conv_bias else None  # noqa: E731
        self.in_proj = param((d, 3 * d), ("embed", None), dtype, rngs)
        self.in_proj_bias = bias(3 * d)
        self.conv = param((taps, d), (None, "embed"), dtype, rngs)
        self.conv_bias = bias(d)
        self.out_proj = param((d, d), (None, "embed"), dtype, rngs)
        self.out_proj_bias = bias(d)
        self.matmul = "auto"

    def __call__(self, x: jax.Array, positions: jax.Array, state: ConvState | None,
                 meta: AttentionMetadata | None, impl: str, lora: tuple | None = None
                 ) -> tuple[jax.Array, ConvState | None]:
        assert lora is None, "LoRA adapts no conv layer (lora/adapter.py refuses the family)"
        d = x.shape[-1]
        bcv = dense(x, self.in_proj.get_value(), param_value(self.in_proj_bias), impl=self.matmul)   # (T, 3D)
        u = bcv[:, :d] * bcv[:, 2 * d:]                                                              # (T, D)
        row = jnp.zeros(x.shape[0], jnp.int32) if meta is None else meta.seq_ids
        slot = None if state is None else meta.state_slots[row]                                      # (T,)
        acc = causal_conv(u, self.conv.get_value().astype(jnp.float32), positions, row,
                          None if state is None else state.u, slot)
        if self.conv_bias is not None:
            acc = acc + self.conv_bias.get_value().astype(jnp.float32)
        y = bcv[:, d:2 * d] * acc.astype(x.dtype)
        out = dense(y, self.out_proj.get_value(), param_value(self.out_proj_bias), impl=self.matmul)
        if state is None:
            return out, None
        return out, ConvState(store_conv_inputs(u, state.u, positions, row, slot, meta))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(attn_norm(x)), then + mlp(mlp_norm(.)). post_norms (Gemma):
    each branch's output is normed again before its residual add; without pre_norms (OLMo 2) that is
    the only norm. residual_post_norm (BLOOM): the
    residual is the normed input instead of x. residual_scale (Granite): each branch's output is
    multiplied by it before its residual add. parallel_block (Cohere): attention and MLP both read
    the one attn_norm(x), x + attn + mlp; with parallel_mlp_norm (GPT-NeoX) the MLP reads
    mlp_norm(x); parallel_sum_first (GPT-NeoX, Phi): (attn + mlp) + x, transformers' order of the
    adds there. The mlp is a mixture of experts (jaxinfer.moe.MoE)
    on the layers cfg.is_moe_layer marks; it skips the step's padding tokens (slot PAD_SLOT). A block
    cfg.has_mlp leaves out (Nemotron-H's mixers without an MLP after them) is x + attn(attn_norm(x)),
    one cfg.has_mixer leaves out (its MLP layers after another) x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs | None, fused: FusedLayout | None = None):
        self.residual_post_norm, self.residual_scale = cfg.residual_post_norm, cfg.residual_scale
        norm = lambda: Norm(cfg.d_model, cfg.norm, cfg.norm_eps, dtype, rngs)  # noqa: E731
        mixer = cfg.has_mixer(layer)
        self.attn_norm = norm() if cfg.pre_norms and mixer else None
        self.attn = (None if not mixer else ShortConv(cfg, dtype, rngs) if cfg.is_conv_layer(layer)
                     else GatedDeltaNet(cfg, dtype, rngs)
                     if cfg.is_linear_layer(layer) else Mamba2(cfg, dtype, rngs) if cfg.is_mamba_layer(layer)
                     else MLAttention(cfg, layer, dtype, rngs)
                     if cfg.mla else Attention(cfg, layer, dtype, rngs, None if fused is None else fused.attn_shards))
        mlp = cfg.has_mlp(layer)
        self.mlp_norm = norm() if mlp and cfg.pre_norms and (cfg.parallel_mlp_norm or not cfg.parallel_block) else None
        self.parallel, self.sum_first = cfg.parallel_block, cfg.parallel_sum_first
        if not mlp:
            self.mlp = None
        elif cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype, rngs, *((None, None) if fused is None else (fused.expert_shards,
                                                                                   fused.shared_shards)))
        else:
            self.mlp = MLP(cfg, dtype, rngs, None if fused is None else fused.mlp_shards)
        self.attn_post_norm = norm() if cfg.post_norms and mixer else None
        self.mlp_post_norm = norm() if cfg.post_norms and mlp else None

    def __call__(self, x, positions, kv, meta, impl, lora: tuple | None = None):
        """lora: (token slots [T], this layer's LoRA stacks) or None (jaxinfer/lora/)."""
        if self.attn is None:   # an MLP block (Nemotron-H's MLP layer after another)
            return self.mlp_branch(x, meta, lora), kv
        h = x if self.attn_norm is None else self.attn_norm(x)
        attn_out, kv = self.attn(h, positions, kv, meta, impl, lora)
        if self.attn_post_norm is not None:
            attn_out = self.attn_post_norm(attn_out)
        attn_out = self.scale_branch(attn_out)
        if self.parallel:   # the MLP reads the same normed input, or its own norm's (GPT-NeoX)
            mlp_out = self.scale_branch(self.mlp(h if self.mlp_norm is None else self.mlp_norm(x), lora))
            return ((attn_out + mlp_out) + x if self.sum_first else (x + attn_out) + mlp_out), kv
        x = (h if self.residual_post_norm else x) + attn_out
        return (x if self.mlp is None else self.mlp_branch(x, meta, lora)), kv

    def mlp_branch(self, x: jax.Array, meta, lora) -> jax.Array:
        """x plus the MLP's branch: mlp(mlp_norm(x)), normed again where post_norms, scaled."""
        h = x if self.mlp_norm is None else self.mlp_norm(x)
        if isinstance(self.mlp, MoE):   # padding tokens take no expert's work
            mlp_out = self.mlp(h, None if meta is None else meta.slot_mapping != PAD_SLOT)
        else:
            mlp_out = self.mlp(h, lora)
        if self.mlp_post_norm is not None:
            mlp_out = self.mlp_post_norm(mlp_out)
        return (h if self.residual_post_norm else x) + self.scale_branch(mlp_out)

    def scale_branch(self, y: jax.Array) -> jax.Array:
        """A branch's output times residual_scale, in float32 and rounded once to its dtype (as torch
        multiplies a bfloat16 tensor by a Python float: the scale is not rounded to bfloat16 first)."""
        if self.residual_scale == 1.0:
            return y
        return (y.astype(jnp.float32) * jnp.float32(self.residual_scale)).astype(y.dtype)


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """How a fused Decoder's columns are grouped: attn_shards / mlp_shards / expert_shards column
    groups in `qkv` / the dense MLPs' `gate_up` / each expert's `gate_up` (the tensor-parallel degree,
    or 1 where it does not divide n_heads / ffn_dim / expert_ffn_dim), each KV head repeated
    kv_replicas times (the fused cfg.n_kv_heads is the original's times kv_replicas)."""
    attn_shards: int
    mlp_shards: int
    kv_replicas: int
    expert_shards: int = 1
    shared_shards: int = 1     # the shared experts' gate_up (cfg.moe_shared_ffn_dim)

    @staticmethod
    def for_tp(cfg: ModelConfig, tp: int = 1) -> "FusedLayout":
        """The layout for `tp` devices of an (unfused) cfg."""
        h, kv = cfg.n_heads, cfg.n_kv_heads
        attn = tp if h % tp == 0 else 1
        # the fewest copies of each KV head that split into whole heads per device while every
        # device's query heads still share its own KV heads (kv * r divides h: g = h / kv works)
        reps = next(r for r in range(1, h // kv + 1) if (h // kv) % r == 0 and (kv * r) % attn == 0)
        if cfg.mla:   # the one latent "KV head" is replicated (each device reads it for its query heads)
            reps = 1
        if reps > 1 and (cfg.qk_norm_full or cfg.qk_norm_heads):
            why = ("spans all its KV heads at once (OLMo 2)" if cfg.qk_norm_full
                   else "has weights per KV head (Command R+)")
            raise ConfigError(f"tensor_parallel={tp} splits {kv} KV heads by repeating them, and this model's k "
                              f"norm {why}; use a tensor_parallel that divides {kv}")
        experts = tp if cfg.num_experts and cfg.expert_ffn_dim % tp == 0 else 1
        shared = tp if cfg.moe_shared_ffn_dim and cfg.moe_shared_ffn_dim % tp == 0 else 1
        return FusedLayout(attn, tp if cfg.ffn_dim % tp == 0 else 1, reps, experts, shared)


class Decoder(nnx.Module):
    """tokens [T], positions [T] (+ KV pages, metadata) -> logits [T or N, vocab] float32.

    fused None: one parameter per projection (the checkpoint layout; loaders build this). A
    FusedLayout: fused `qkv` / `gate_up` (fuse_decoder builds it; cfg.n_kv_heads already counts the
    KV replicas)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 fused: FusedLayout | None = None):
        self.cfg, self.fused = cfg, fused
        d = cfg.d_model
        self.embed = param((cfg.vocab_size, d), ("vocab", "embed"), dtype, rngs)
        self.pos_embed = (param((cfg.max_position_embeddings, d), ("position", "embed"), dtype, rngs)
                          if cfg.position == "learned" else None)
        self.embed_norm = Norm(d, cfg.norm, cfg.norm_eps, dtype, rngs) if cfg.embed_norm else None
        self.layers = nnx.List([Block(cfg, i, dtype, rngs, fused) for i in range(cfg.n_layers)])
        self.final_norm = Norm(d, cfg.norm, cfg.norm_eps, dtype, rngs)
        self.lm_head = None if cfg.tie_embeddings else param((d, cfg.vocab_size), ("embed", "vocab"), dtype, rngs)
        self.lm_head_bias = param((cfg.vocab_size,), ("vocab",), dtype, rngs, init="zeros") if cfg.lm_head_bias else None

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """tokens [T], positions [T] -> the first block's input [T, D] (token + position
        embeddings, then the embedding norm where the family has one)."""
        x = self.embed.get_value()[tokens]                                     # (T, D)
        if self.cfg.embed_scale != 1.0:   # Gemma: sqrt(d_model), rounded to the weights' dtype as HF does
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed.get_value()[positions]
        elif self.cfg.position == "sinusoidal":
            x = x + sinusoidal_embedding(positions, self.cfg.d_model).astype(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, kv_pages: list[LayerKV] | None = None,
                      meta: AttentionMetadata | None = None,
                      impl: str = "xla", lora=None) -> tuple[jax.Array, list[LayerKV] | None]:
        """The final-norm hidden states [T, D] and the updated pages. lora: the step's
        jaxinfer.lora.execute.LoraInputs (each token's adapter slot and the slots' stacks) or None."""
        x = self.embed_tokens(tokens, positions)
        new_pages = [] if kv_pages is not None else None
        for i, block in enumerate(self.layers):
            layer_lora = None if lora is None else (lora.token_slots, lora.stacks[i])
            x, layer_kv = block(x, positions, None if kv_pages is None else kv_pages[i], meta, impl, layer_lora)
            if new_pages is not None:
                new_pages.append(layer_kv)
        return self.final_norm(x), new_pages

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states [N, D] -> float32 logits [N, vocab] (soft-capped where the family caps them:
        sampling, logprobs and speculative verification all see the capped logits)."""
        w = self.embed.get_value().T if self.lm_head is None else self.lm_head.get_value()
        logits = jnp.dot(h, w, preferred_element_type=jnp.float32, precision=dot_precision(h.dtype))
        if self.lm_head_bias is not None:   # Phi-2
            logits = logits + self.lm_head_bias.get_value().astype(jnp.float32)
        if self.cfg.logits_scaling != 1.0:   # Granite: divided, as transformers divides them
            logits = logits / jnp.float32(self.cfg.logits_scaling)
        cap = self.cfg.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_pages: list[LayerKV] | None = None,
                 meta: AttentionMetadata | None = None, logits_indices: jax.Array | None = None,
                 impl: str = "xla", lora=None) -> tuple[jax.Array, list[LayerKV] | None]:
        """logits_indices [N]: compute logits only for these token rows (the last of each sequence).
        lora: jaxinfer.lora.execute.LoraInputs or None (hidden_states)."""
        h, kv_pages = self.hidden_states(tokens, positions, kv_pages, meta, impl, lora)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.logits(h), kv_pages


def abstract_decoder(cfg: ModelConfig, dtype, fused: FusedLayout | None = None) -> Decoder:
    """A Decoder whose parameters are ShapeDtypeStructs: the shape/dtype target for loading."""
    return nnx.eval_shape(lambda: Decoder(cfg, dtype, rngs=None, fused=fused))


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat 'a/b/c' name -> shape of every parameter (for loaders and shape checks)."""
    model = abstract_decoder(cfg, jnp.float32)
    flat = nnx.state(model, nnx.Param).flat_state()
    return {"/".join(map(str, path)): tuple(v.get_value().shape) for path, v in flat}


def count_params(model: Decoder) -> int:
    """Parameters of a loaded model (scripts check it against ModelConfig.num_params, the one counter
    of an architecture's parameters)."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def weight_bytes(model) -> perf.WeightBytes:
    """A loaded model's parameter bytes (quantized: codes, scales, zero points) split as jaxinfer.perf's
    cost model reads them: the tables a step gathers rows from (an untied token embedding, learned
    positions: first logical axis "vocab" / "position"), one token's row of them, and every MoE expert
    (logical axis "experts"). Found by logical axes, so fused, quantized, sharded and pipelined
    layouts count alike (a sharded array counts its global size)."""
    total = tables = row = experts = 0
    for _, var in nnx.state(model, nnx.Param).flat_state():
        value = var.get_value()
        nbytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(value)))
        axes = tuple(var.get_metadata().get("logical_axes") or ())
        total += nbytes
        if "experts" in axes:
            experts += nbytes
        elif axes[:1] == ("position",) or (axes[:1] == ("vocab",) and not model.cfg.tie_embeddings):
            tables += nbytes
            row += nbytes // value.shape[0]
    return perf.WeightBytes(total, tables, row, experts)


# The one table of contracted dims: matmul weights that quantize (name -> contracted leading dims; o is
# [heads, head_dim, d]); jaxinfer.quantize reads it too. Embeddings, norms, biases, MoE routers and the
# LM head stay in the model dtype (as llama.cpp keeps the output layer at higher precision). An MoE
# layer's gate / up / down / gate_up have a leading experts axis: each expert is quantized on its own
# (quant.quantize_experts). A Gated DeltaNet's in_proj_b / in_proj_a (one column per value head) stay
# float, as its taps.
CONTRACTED_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "up": 1, "gate": 1, "down": 1, "qkv": 1, "gate_up": 1,
                   "out_gate": 1, "in_proj": 1, "out_proj": 1, "in_proj_qkv": 1, "in_proj_z": 1}


def window_logits(model: Decoder, windows: jax.Array) -> jax.Array:
    """windows [B, L+1] int32 -> next-token logits [B, L, V] of windows[:, :-1] (each window from
    position 0; training, distillation and QAT)."""
    positions = jnp.arange(windows.shape[1] - 1, dtype=jnp.int32)
    return jax.vmap(lambda t: model(t, positions)[0])(windows[:, :-1])


def window_nll(model: Decoder, windows: jax.Array) -> jax.Array:
    """windows [B, L+1] int32 -> per-token next-token NLL [B, L], float32 (training and QAT)."""
    logp = jax.nn.log_softmax(window_logits(model, windows), axis=-1)
    return -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]


def quantize_decoder(model: Decoder, method: str, group_size: int = 128) -> Decoder:
    """Weight-only quantization in place: "int8" or "fp8" (e4m3; per output channel) or "int4"
    (group-wise along K, symmetric; the group shrinks to 64 or 32 when K is not a multiple of 128,
    and a matrix whose K fits none of them stays int8)."""
    bits = {"int8": 8, "int4": 4, "fp8": 8}[method]
    for path, var in nnx.state(model, nnx.Param).flat_state():
        name = str(path[-1])
        if name not in CONTRACTED_DIMS or len(path) < 2:
            continue
        w = var.get_value()
        if isinstance(w, QuantizedWeight):
            kind = "fp8" if w.fp8 else f"int{w.bits}"
            raise ValueError(f"the model is already quantized ({'/'.join(map(str, path))} is {kind}); "
                             f"load it without quantize={method!r}")
        contract = CONTRACTED_DIMS[name]
        if (var.get_metadata().get("logical_axes") or (None,))[0] == "experts":
            var.set_value(quantize_experts(w, method, group_size, contract=contract))
            continue
        k = int(np.prod(w.shape[:contract]))
        if method == "fp8":
            qw = quantize_fp8(w, contract=contract)
        elif bits == 4:
            g = next((g for g in (group_size, 64, 32) if k % g == 0 and g <= group_size), None)
            qw = quantize(w, 4, group_size=g, contract=contract) if g else quantize(w, 8, contract=contract)
        else:
            qw = quantize(w, 8, contract=contract)
        var.set_value(qw)
    return model


def set_matmul_impl(model, impl: str) -> None:
    """Every layer of the model that multiplies by its weights (Attention, MLP, ShortConv, GatedDeltaNet,
    Mamba2) runs its quantized matmuls with `impl` ("pallas" | "xla": the engine's resolved matmul implementation,
    config.ResolvedConfig.matmul; "auto": the backend's default). A static attribute of the layers,
    so the model's graph (and each step program compiled from it) holds it, as it holds the
    layers' windows; the weights carry no choice."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    for _, node in nnx.iter_graph(model):
        if isinstance(node, (Attention, MLAttention, MLP, ShortConv, GatedDeltaNet, Mamba2)):
            node.matmul = impl


def matmul_impl(model) -> str:
    """The layers' matmul setting (set_matmul_impl); "auto" for a model without such layers."""
    return next((node.matmul for _, node in nnx.iter_graph(model) if isinstance(node, (Attention, MLP))), "auto")


# ------------------------------------------------------------------------------ fused projections
# Fusion works on columns: a float weight [d, *out] is viewed as [d, n], a bias [*out] as [n], and a
# QuantizedWeight's q, scales and zeros all end in the same n columns (int8 scales per column, int4
# groups along K), so the same column shuffle applies to every leaf and quantizing before or after
# fusing gives the same numbers.

def _qkv_fuse(cfg: ModelConfig, layout: FusedLayout):
    """[q | k | v] columns -> shard-grouped [s x (q heads | k heads | v heads)], KV heads repeated."""
    s, r, hd = layout.attn_shards, layout.kv_replicas, cfg.head_dim

    def fn(parts):
        q, k, v = parts
        lead = q.shape[:-1]
        k, v = (jnp.repeat(a.reshape(*lead, -1, hd), r, axis=-2).reshape(*lead, -1) for a in (k, v))
        return jnp.concatenate([a.reshape(*lead, s, -1) for a in (q, k, v)], axis=-1).reshape(*lead, -1)
    return fn


def _qkv_split(cfg: ModelConfig, layout: FusedLayout):
    """The inverse of _qkv_fuse (cfg unfused): [..., N] -> [q, k, v] columns, first KV replica."""
    s, r, hd = layout.attn_shards, layout.kv_replicas, cfg.head_dim
    hq, hk = cfg.n_heads // s, cfg.n_kv_heads * r // s

    def fn(fused):
        lead = fused.shape[:-1]
        y = fused.reshape(*lead, s, hq + 2 * hk, hd)
        first = lambda a: a.reshape(*lead, -1, r, hd)[..., 0, :].reshape(*lead, -1)  # noqa: E731
        return [y[..., :hq, :].reshape(*lead, -1), first(y[..., hq:hq + hk, :]), first(y[..., hq + hk:, :])]
    return fn


def _gate_up_fuse(s: int):
    def fn(parts):
        lead = parts[0].shape[:-1]
        return jnp.stack([a.reshape(*lead, s, -1) for a in parts], axis=-2).reshape(*lead, -1)  # (.., s, 2, F/s)
    return fn


def _gate_up_split(s: int):
    def fn(fused):
        y = fused.reshape(*fused.shape[:-1], s, 2, -1)
        return [y[..., i, :].reshape(*fused.shape[:-1], -1) for i in (0, 1)]
    return fn


def _fuse_leaves(parts: list, fn, names: tuple[str, ...] = ()):
    """fn applied to float weights as [d, n] columns, or to each leaf of QuantizedWeights (q, scales,
    zeros: all end in the n columns) -> one fused [d, N] weight of the same kind. names: the parts'
    parameters, for the error when they cannot be fused (some quantized and some not, or quantized
    in different formats: a checkpoint whose quantization config skips one of them)."""
    quantized = [isinstance(p, QuantizedWeight) for p in parts]
    first = parts[0]
    if any(quantized) and (not all(quantized) or not all(
            (p.bits, p.group_size, p.contract, p.symmetric, p.act_bits, p.fp8, p.layout) ==
            (first.bits, first.group_size, 1, first.symmetric, first.act_bits, first.fp8, first.layout)
            for p in parts)):
        kinds = ", ".join(f"{n} {'quantized' if q else 'float'}" for n, q in zip(names, quantized))
        raise ValueError(f"{', '.join(names) or 'the parts'} are served as one fused matmul, and the checkpoint "
                         f"does not quantize them alike ({kinds}): a quantization config that skips or treats "
                         "one of them apart is not supported")
    if isinstance(parts[0], QuantizedWeight):
        # a fused projection reads one input: its parts' static activation scales, and the row order
        # of activation-ordered GPTQ weights (perm), are that input's
        if any((p.perm is None) != (first.perm is None) or
               (p.perm is not None and not bool(jnp.array_equal(p.perm, first.perm))) for p in parts):
            raise ValueError("projections read from one input have different row orders (perm: GPTQ "
                             "desc_act g_idx); they cannot be fused")
        assert all((p.act_scale is None, p.act_zero is None) == (first.act_scale is None, first.act_zero is None)
                   for p in parts)
        q = fn([p.q_kn() for p in parts])      # fp8 codes stored [N, K]: fused as [K, N], stored back
        leaves = [q.T if first.layout == "nk" else q, fn([p.scales for p in parts]),
                  None if first.zeros is None else fn([p.zeros for p in parts])]
        return QuantizedWeight(*leaves, bits=first.bits, group_size=first.group_size, batch=first.batch,
                               shape=(*first.shape[:first.batch + 1], int(q.shape[-1])), contract=1,
                               layout=first.layout,
                               act_bits=first.act_bits,   # a copy: fuse_decoder(consume=True) deletes the parts
                               **_fused_act_range(parts),
                               perm=None if first.perm is None else jnp.array(first.perm))
    return fn(parts)


def _fused_act_range(parts: list) -> dict:
    """The static activation quantizer of one fused input (act_scale, act_zero) from its parts'
    (q / k / v, gate / up: calibrated on the same input, so normally equal, kept as they are).
    Where they differ, the smallest range that holds every part's, so that no part's activations
    clip where they did not (vLLM's rule for fused static int8 layers): symmetric -> the largest
    scale; asymmetric -> the union of the ranges [s * (-128 - z), s * (127 - z)] over 255 steps,
    its zero point round(-128 - lo / s)."""
    first = parts[0]
    if first.act_scale is None:
        return dict(act_scale=None, act_zero=None)
    scales = [float(np.asarray(p.act_scale)) for p in parts]
    zeros = None if first.act_zero is None else [int(np.asarray(p.act_zero)) for p in parts]
    if len(set(scales)) == 1 and (zeros is None or len(set(zeros)) == 1):
        return dict(act_scale=jnp.array(first.act_scale),
                    act_zero=None if first.act_zero is None else jnp.array(first.act_zero))
    if zeros is None:
        return dict(act_scale=jnp.asarray(max(scales), jnp.float32), act_zero=None)
    lo = min(sc * (-128 - z) for sc, z in zip(scales, zeros))
    hi = max(sc * (127 - z) for sc, z in zip(scales, zeros))
    scale = (hi - lo) / 255
    return dict(act_scale=jnp.asarray(scale, jnp.float32),
                act_zero=jnp.asarray(int(np.clip(round(-128 - lo / scale), -128, 127)), jnp.int32))


def _split_leaves(fused, fn, shapes: list[tuple[int, ...]]) -> list:
    """The inverse of _fuse_leaves: the parts back in their own shapes (`shapes`, logical)."""
    if isinstance(fused, QuantizedWeight):
        qs = fn(fused.q_kn())                    # fp8 codes stored [N, K]: split as [K, N], stored back
        leaves = [[q.T for q in qs] if fused.layout == "nk" else qs, fn(fused.scales),
                  None if fused.zeros is None else fn(fused.zeros)]
        return [QuantizedWeight(q, sc, None if leaves[2] is None else leaves[2][i], bits=fused.bits,
                                group_size=fused.group_size, shape=shape, contract=1,
                                batch=fused.batch, layout=fused.layout,
                                act_bits=fused.act_bits, act_scale=fused.act_scale, act_zero=fused.act_zero,
                                perm=fused.perm)
                for i, (q, sc, shape) in enumerate(zip(leaves[0], leaves[1], shapes))]
    return [p.reshape(shape) for p, shape in zip(fn(fused), shapes)]


def _flat_params(model: Decoder) -> dict:
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.state(model, nnx.Param).flat_state()}


def _build(cfg: ModelConfig, dtype, fused: FusedLayout | None, values: dict) -> Decoder:
    model = abstract_decoder(cfg, dtype, fused)
    for path, var in nnx.state(model, nnx.Param).flat_state():
        var.set_value(values["/".join(map(str, path))])
    return model


def fuse_decoder(model: Decoder, tp: int = 1, consume: bool = False) -> Decoder:
    """A new Decoder with fused `qkv` and `gate_up` (module docstring), columns grouped for `tp`
    tensor-parallel devices; float or quantized weights. On a mesh, call shard_decoder afterwards
    (from_pretrained does) to place the fused weights. consume: free each layer's unfused arrays
    once its fused ones exist (peak memory: the model plus one layer's projections), leaving
    `model` unusable."""
    if model.fused is not None:
        raise ValueError("the model is already fused")
    cfg, p, impl = model.cfg, _flat_params(model), matmul_impl(model)
    layout = FusedLayout.for_tp(cfg, tp)
    fused_names = ("q", "k", "v", "q_bias", "k_bias", "v_bias") + (
        ("gate", "up", "gate_bias", "up_bias") if cfg.gated_mlp else ())
    out = {k: v for k, v in p.items() if k.split("/")[-1] not in fused_names}
    # each column shuffle is one jitted program (per leaf shape; every layer shares them), not a
    # dozen eager reshapes, repeats and concatenations per leaf compiled one by one
    qkv = jax.jit(_qkv_fuse(cfg, layout))
    gate_ups = {s: jax.jit(_gate_up_fuse(s)) for s in {layout.expert_shards, layout.mlp_shards, layout.shared_shards}}
    for i in range(cfg.n_layers):
        a, m = f"layers/{i}/attn", f"layers/{i}/mlp"
        if not cfg.mla and cfg.has_kv(i):   # latent attention, state layers and MLP blocks have no q / k / v
            out[f"{a}/qkv"] = _fuse_leaves([_as_columns(p[f"{a}/{n}"]) for n in "qkv"], qkv,
                                           tuple(f"{a}/{n}" for n in "qkv"))
        if cfg.qkv_bias and cfg.has_kv(i):
            out[f"{a}/qkv_bias"] = qkv([p[f"{a}/{n}_bias"].reshape(-1) for n in "qkv"])
        gate_up = gate_ups[layout.expert_shards if cfg.is_moe_layer(i) else layout.mlp_shards]
        if cfg.gated_mlp and cfg.has_mlp(i):
            out[f"{m}/gate_up"] = _fuse_leaves([p[f"{m}/gate"], p[f"{m}/up"]], gate_up, (f"{m}/gate", f"{m}/up"))
            if cfg.mlp_bias:
                out[f"{m}/gate_up_bias"] = gate_up([p[f"{m}/gate_bias"], p[f"{m}/up_bias"]])
        shared = f"{m}/shared"
        shared_fused = f"{shared}/gate" in p   # (ungated shared experts keep their up)
        if shared_fused:
            out[f"{shared}/gate_up"] = _fuse_leaves([p[f"{shared}/gate"], p[f"{shared}/up"]],
                                                    gate_ups[layout.shared_shards], (f"{shared}/gate", f"{shared}/up"))
        if consume:
            for name in ([f"{a}/{n}" for n in fused_names[:6]] + [f"{m}/{n}" for n in fused_names[6:]]
                         + ([f"{shared}/gate", f"{shared}/up"] if shared_fused else [])):
                for leaf in jax.tree.leaves(p.pop(name, None)):
                    leaf.delete()
    fused_cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_kv_heads * layout.kv_replicas)
    fused = _build(fused_cfg, p["embed"].dtype, layout, out)
    set_matmul_impl(fused, impl)
    return fused


def unfuse_decoder(model: Decoder) -> Decoder:
    """The inverse of fuse_decoder: separate q, k, v, gate, up and the original cfg (a model that is
    not fused comes back as it is)."""
    layout = model.fused
    if layout is None:
        return model
    cfg = dataclasses.replace(model.cfg, n_kv_heads=model.cfg.n_kv_heads // layout.kv_replicas)
    h, kv, hd, d, f = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ffn_dim
    p = _flat_params(model)
    out = {k: v for k, v in p.items() if k.split("/")[-1] not in ("qkv", "qkv_bias", "gate_up", "gate_up_bias")}
    for i in range(cfg.n_layers):
        a, m = f"layers/{i}/attn", f"layers/{i}/mlp"
        split = _qkv_split(cfg, layout)
        shapes = [(d, h, hd), (d, kv, hd), (d, kv, hd)]
        no_qkv = cfg.mla or not cfg.has_kv(i)   # latent attention, state layers and MLP blocks have none
        for n, w in zip("qkv", _split_leaves(p[f"{a}/qkv"], split, shapes) if not no_qkv else ()):
            out[f"{a}/{n}"] = w
        if cfg.qkv_bias and not no_qkv:
            for n, b in zip("qkv", _split_leaves(p[f"{a}/qkv_bias"], split, [s[1:] for s in shapes])):
                out[f"{a}/{n}_bias"] = b
        if cfg.gated_mlp and cfg.has_mlp(i):
            moe = cfg.is_moe_layer(i)
            split = _gate_up_split(layout.expert_shards if moe else layout.mlp_shards)
            lead = (cfg.num_experts,) if moe else ()
            width = cfg.expert_ffn_dim if moe else f
            out[f"{m}/gate"], out[f"{m}/up"] = _split_leaves(p[f"{m}/gate_up"], split, [(*lead, d, width)] * 2)
            if cfg.mlp_bias:
                out[f"{m}/gate_bias"], out[f"{m}/up_bias"] = _split_leaves(p[f"{m}/gate_up_bias"], split,
                                                                           [(*lead, width)] * 2)
        if f"{m}/shared/gate_up" in p:
            out[f"{m}/shared/gate"], out[f"{m}/shared/up"] = _split_leaves(
                p[f"{m}/shared/gate_up"], _gate_up_split(layout.shared_shards), [(d, cfg.moe_shared_ffn_dim)] * 2)
    unfused = _build(cfg, p["embed"].dtype, None, out)
    set_matmul_impl(unfused, matmul_impl(model))
    return unfused


def _as_columns(w):
    """A float weight [d, *out] as [d, n]; a QuantizedWeight is already [K, n] underneath."""
    return w if isinstance(w, QuantizedWeight) else w.reshape(w.shape[0], -1)
