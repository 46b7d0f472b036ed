"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek-V3, gpt-oss, Nemotron 3): routing
(route: top-k then softmax, softmax then top-k, or sigmoid scores with a choice correction and
group-limited choice), the sort of token rows by expert, the grouped expert FFN and the weighted
combine, all with static shapes; shared experts (one dense MLP every token runs) added after.

    x [T, D] -> router logits [T, E] -> top-k: weights [T, k], experts [T, k]
             -> R = T k rows (row r = token r // k, its (r % k)-th expert), sorted by expert: order [R]
             -> group_sizes [E] (rows per expert), the sorted rows' hidden states xs [R, D]
             -> per expert e, its rows through act(rows W_gate[e]) * (rows W_up[e]) W_down[e] -> ys [R, D]
                (ungated experts, cfg.gated_mlp False: act(rows W_up[e]) W_down[e]; Nemotron 3)
             -> unsorted, weighted, summed over each token's k rows -> [T, D]

Work is proportional to the rows, T k, never to T x E: each row goes through its own expert only.
Padding tokens (bucket padding: slot PAD_SLOT in the step's metadata) are sorted after every
group with zero weight, so they take no expert's work and add nothing to any token.

Two grouped-matmul implementations, the same numbers:
  - "tiles" (the default, every backend): a loop over the experts that received rows (a traced
    count), and inside it over tiles of `tile` consecutive sorted rows of that expert: one [tile, D] x [D, 2F]
    and one [tile, F] x [F, D] dot per tile, the expert's weights sliced (and dequantized) once per
    expert. Rows computed = sum over used experts of ceil(rows_e / tile) * tile <= T k + used
    experts * (tile - 1). Tiles are written in row order with dynamic_update_slice, so a tile's
    rows past its expert's last one are overwritten by the next expert's first tile (last write
    wins): no masks, no scatter.
  - "ragged_dot" (opt-in: set_moe_impl): jax.lax.ragged_dot over the sorted rows. Its work depends on
    how the backend lowers it: XLA:CPU expands it into a masked dense dot over every group (work
    T k x E: bench/moe.py counts 8x the useful FLOPs at 8 experts from the HLO, 64x for a batch-1
    decode step), and XLA:GPU does the same unless a grouped-GEMM backend (cuDNN's, on some GPUs and
    shapes) takes it, so it is not the default anywhere until measured on a device.

Quantized experts (quant.quantize_experts, int8 / int4 / fp8, one scale set per expert) are
dequantized per call in XLA, once per used expert (not per tile): int8 and fp8 codes are converted
to the compute dtype and their per-column scales multiply the dot's output rows; int4 groups and
grouped int8 (GGUF's Q8_0 / Q5_0 / Q6_K experts: a scale per group of k) are dequantized first. On XLA:CPU (bench/moe.py times one layer) int8 reads a quarter of the
bytes and costs a conversion, about a wash per layer, while the engine decodes faster with int8
experts; int4's unpacking dominates (a kernel that dequantizes in registers, as quant_matmul does for
dense weights, would be the GPU answer).

This module never imports the model (models/decoder.py builds MoE where cfg.is_moe_layer).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxinfer.config import ModelConfig
from jaxinfer.layers import ACTIVATIONS, MLP, dense, param, param_value, split_gate_up, swiglu_clamped
from jaxinfer.quant import QuantizedWeight, dequantize, dot_precision, expert_weight

MAX_TILE = 32       # rows per tile of the "tiles" loop (fewer when the step has fewer rows per expert)
IMPLS = ("tiles", "ragged_dot")


def default_impl() -> str:
    """The tile loop: work proportional to T k on every backend (module docstring)."""
    return "tiles"


# the routings whose router transformers runs in float32 (DeepSeek's, GLM-4.5's): kept so here
FLOAT32_ROUTERS = ("sigmoid_topk", "softmax_group_topk", "softmax_corrected_topk")
# the routings with a learned per-expert correction of the choice (router_correction)
CORRECTED_ROUTERS = ("sigmoid_topk", "softmax_corrected_topk")
# ERNIE 4.5's floor under the chosen probabilities' sum (transformers' moe_norm_min default; the
# published configs keep it)
ERNIE_NORM_MIN = 1e-12


def route(logits: jax.Array, k: int, routing: str, norm_topk: bool, correction: jax.Array | None = None,
          groups: int = 1, topk_groups: int = 1, scale: float = 1.0, jitter: float = 0.0, norm_eps: float = 1e-20,
          scores_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, experts [T, k] int32).
    topk_softmax (Mixtral, gpt-oss): the k largest logits, softmax over them. softmax_topk (Qwen3-MoE):
    softmax over all E, the k largest probabilities, divided by their sum when norm_topk.
    sigmoid_topk (DeepSeek-V3, GLM-4.5): scores sigmoid(logits); experts chosen by scores + correction
    [E] among the topk_groups best of `groups` equal groups (a group scored by the sum of its two best),
    weighted by their scores (renormalized when norm_topk, as transformers does: their sum + norm_eps, 1e-20;
    LFM2-MoE's 1e-6), times scale; with scores_dtype (LFM2-MoE's bfloat16 router) the sigmoids, their
    renormalization and scale rounded to that dtype at each step, as transformers computes them there.
    softmax_group_topk (DeepSeek-V2): softmax over all E; the k largest probabilities among the
    topk_groups best of `groups` groups (a group scored by its best; the others' probabilities taken
    as 0, as transformers masks them), never renormalized, times scale. softmax_corrected_topk
    (ERNIE 4.5): softmax over all E, the k largest of probabilities + correction [E], weighted by
    their probabilities divided by max(sum, 1e-12). sparsemixer (PhiMoE; k = 2): _route_sparsemixer.
    topk_sigmoid (Llama 4): the k largest logits, each weighted by its sigmoid."""
    if routing == "topk_softmax":
        top, experts = lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    if routing == "topk_sigmoid":
        top, experts = lax.top_k(logits, k)
        return jax.nn.sigmoid(top), experts
    if routing == "sigmoid_topk":
        return _route_sigmoid(logits, k, norm_topk, correction, groups, topk_groups, scale, norm_eps, scores_dtype)
    if routing == "softmax_group_topk":
        return _route_softmax_groups(logits, k, groups, topk_groups, scale)
    if routing == "sparsemixer":
        return _route_sparsemixer(logits, jitter)
    if routing == "softmax_corrected_topk":
        probs = jax.nn.softmax(logits, axis=-1)
        _, experts = lax.top_k(probs + correction.astype(jnp.float32), k)
        weights = jnp.take_along_axis(probs, experts, axis=1)
        return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), ERNIE_NORM_MIN), experts
    weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _route_sigmoid(logits, k, norm_topk, correction, groups, topk_groups, scale, norm_eps=1e-20, dtype=None):
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    if dtype is not None:   # LFM2-MoE: the sigmoids rounded to the router's dtype before the correction
        scores = scores.astype(dtype).astype(jnp.float32)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    if groups > 1:
        best_two = lax.top_k(choice.reshape(t, groups, e // groups), 2)[0]
        choice = jnp.where(_kept_groups(jnp.sum(best_two, axis=-1), topk_groups, e // groups), choice, -jnp.inf)
    _, experts = lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if dtype is not None:   # renormalized and scaled in that dtype, each operation rounded as torch rounds it
        rnd = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
        if norm_topk:
            weights = rnd(weights / rnd(rnd(jnp.sum(weights, axis=-1, keepdims=True)) + norm_eps))
        return rnd(weights * jnp.float32(scale)), experts
    if norm_topk:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + norm_eps)
    return weights * jnp.float32(scale), experts


def _route_sparsemixer(logits: jax.Array, jitter: float) -> tuple[jax.Array, jax.Array]:
    """PhiMoE's sparsemixer at inference (transformers' sparsemixer with training off): the expert of
    the largest logit m, weighted by its softmax probability over the logits s within a relative
    margin of it, (m - s) / max(|s|, m) <= 2 jitter (the others taken as -inf); then, its logit
    excluded, the same for the largest of the others (margins measured from the second logit)."""
    def pick(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
        top, best = jnp.max(scores, axis=-1, keepdims=True), jnp.argmax(scores, axis=-1)
        far = (top - logits) / jnp.maximum(jnp.abs(logits), top) > 2 * jitter   # 0 / 0 is not far, as in torch
        probs = jax.nn.softmax(jnp.where(far, -jnp.inf, scores), axis=-1)
        return jnp.take_along_axis(probs, best[:, None], axis=1)[:, 0], best
    w1, e1 = pick(logits)
    w2, e2 = pick(jnp.where(jax.nn.one_hot(e1, logits.shape[-1], dtype=bool), -jnp.inf, logits))
    return jnp.stack([w1, w2], axis=-1), jnp.stack([e1, e2], axis=-1).astype(jnp.int32)


def _route_softmax_groups(logits, k, groups, topk_groups, scale):
    t, e = logits.shape
    scores = jax.nn.softmax(logits, axis=-1)
    if groups > 1:
        best = jnp.max(scores.reshape(t, groups, e // groups), axis=-1)
        scores = jnp.where(_kept_groups(best, topk_groups, e // groups), scores, 0.0)
    weights, experts = lax.top_k(scores, k)
    return weights * jnp.float32(scale), experts


def _kept_groups(group_scores: jax.Array, topk_groups: int, per_group: int) -> jax.Array:
    """group_scores [T, G] -> [T, G * per_group] bool: the experts of each token's topk_groups best groups."""
    t, g = group_scores.shape
    _, kept = lax.top_k(group_scores, topk_groups)                                     # (T, topk_groups)
    keep = jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], kept].set(True)
    return jnp.repeat(keep, per_group, axis=1)


def sort_rows(experts: jax.Array, valid: jax.Array | None, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """experts [T, k] -> (order [R]: row indices sorted by expert, stable; group_sizes [E] int32).
    Rows of tokens that are not valid sort last, in no group."""
    keys = experts.reshape(-1).astype(jnp.int32)
    if valid is not None:
        keys = jnp.where(jnp.repeat(valid, experts.shape[1]), keys, num_experts)
    order = jnp.argsort(keys, stable=True)
    sizes = jnp.zeros(num_experts + 1, jnp.int32).at[keys].add(1)[:num_experts]
    return order.astype(jnp.int32), sizes


def combine(ys: jax.Array, order: jax.Array, weights: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Sorted expert outputs ys [R, D] -> each token's weighted sum over its k rows [T, D] (float32)."""
    t, k = weights.shape
    r = order.shape[0]
    inverse = jnp.zeros(r, jnp.int32).at[order].set(jnp.arange(r, dtype=jnp.int32))   # row -> its sorted place
    rows = ys[inverse].reshape(t, k, -1).astype(jnp.float32)                       # (T, k, D)
    if valid is not None:   # padding rows hold whatever their tile computed: never let it through
        rows = jnp.where(valid[:, None, None], rows, 0.0)
    return jnp.sum(rows * weights[..., None], axis=1)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """The tile height of the "tiles" loop for R rows over E experts: the power of two at or above half
    the mean rows per expert, at most MAX_TILE. Decode gets 1-row tiles (no padding rows at all),
    prefill few iterations; against the mean itself (capped at 64), a quarter of it (capped at 16)
    and a fixed 8 (bench/moe.py) it was the fastest or within noise of it from 8 to 512 tokens per
    step, where each of the others lost clearly somewhere."""
    half_mean = -(-num_rows // (2 * num_experts))
    return min(MAX_TILE, 1 << max(0, half_mean - 1).bit_length())


def _expert_operand(w, e, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Expert e's [K, N] matrix in the compute dtype, and per-column scales for its output (int8 / fp8)."""
    if not isinstance(w, QuantizedWeight):
        return w[e], None
    qe = expert_weight(w, e)
    if qe.bits == 8 and not qe.grouped8:    # int8 or e4m3 codes: the scales act on the dot's output columns
        return qe.q.astype(dtype), qe.scales.astype(jnp.float32)
    return dequantize(qe).astype(dtype), None


def _matmul(x: jax.Array, operand: tuple[jax.Array, jax.Array | None]) -> jax.Array:
    """x [m, K] @ an _expert_operand -> [m, N] in x's dtype (float32 accumulation for scaled codes)."""
    w, scales = operand
    dims = (((1,), (0,)), ((), ()))
    if scales is None:
        return lax.dot_general(x, w, dims, precision=dot_precision(x.dtype))
    y = lax.dot_general(x, w, dims, precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)
    return (y * scales).astype(x.dtype)


class MoE(nnx.Module):
    """The mixture-of-experts MLP of one layer: router [D, E] (+ bias), experts' gate / up [E, D, F]
    and down [E, F, D] (+ biases where cfg.mlp_bias). shards None: separate gate and up; an int: one
    fused gate_up [E, D, 2F] whose columns are `shards` groups of [gate | up] per expert, as the
    dense MLP's (models/decoder.py, fuse_decoder). Ungated experts (cfg.gated_mlp False: Nemotron 3's
    squared-ReLU experts) have up and down only, never fused, and so do their shared experts (the dense
    MLP's ungated form). impl: "tiles" | "ragged_dot" | None (default_impl)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, shards: int | None = None,
                 shared_shards: int | None = None):
        d, f, e = cfg.d_model, cfg.expert_ffn_dim, cfg.num_experts
        shards = shards if cfg.gated_mlp else None    # (an ungated expert has no gate to fuse with its up)
        assert shards is None or f % shards == 0, (f, shards)
        self.num_experts, self.k, self.shards, self.impl = e, cfg.num_experts_per_tok, shards, None
        self.routing, self.norm_topk, self.act = cfg.moe_routing, cfg.moe_norm_topk, cfg.activation
        self.groups, self.topk_groups, self.routed_scale = cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale
        self.jitter, self.scale_inputs, self.norm_eps = cfg.moe_router_jitter, cfg.moe_scale_inputs, cfg.moe_norm_eps
        self.scores_in_dtype = cfg.moe_scores_in_dtype
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        fused, bias, gated = shards is not None, cfg.mlp_bias, cfg.gated_mlp
        self.gated = gated
        expert = lambda n, axis, b=False: param((e, *n), ("experts", *axis), dtype, rngs,  # noqa: E731
                                                init="zeros" if b else "normal")
        # DeepSeek's and GLM-4.5's routing: the router in float32, as transformers keeps it (its logits
        # pick among many experts by small margins, which bfloat16 logits would move)
        fp32 = (cfg.moe_routing in FLOAT32_ROUTERS or cfg.moe_router_fp32) and not cfg.moe_router_in_dtype
        self.router = param((d, e), ("embed", None), jnp.float32 if fp32 else dtype, rngs)
        self.router_bias = param((e,), (None,), dtype, rngs, init="zeros") if cfg.router_bias else None
        # the choice correction of sigmoid_topk and softmax_corrected_topk (float32, as transformers keeps it)
        self.router_correction = (param((e,), (None,), jnp.float32, rngs, init="zeros")
                                  if cfg.moe_routing in CORRECTED_ROUTERS else None)
        # the shared experts: one dense MLP every token runs (+ Qwen2-MoE's sigmoid gate [d, 1])
        self.shared = (MLP(dataclasses.replace(cfg, ffn_dim=cfg.moe_shared_ffn_dim, mlp_bias=False), dtype, rngs,
                           shared_shards) if cfg.moe_shared_ffn_dim else None)
        self.shared_gate = param((d, 1), ("embed", None), dtype, rngs) if cfg.moe_shared_gate else None
        self.gate = expert((d, f), ("embed", "expert_mlp")) if gated and not fused else None
        self.up = None if fused else expert((d, f), ("embed", "expert_mlp"))
        self.gate_bias = expert((f,), ("expert_mlp",), True) if bias and gated and not fused else None
        self.up_bias = expert((f,), ("expert_mlp",), True) if bias and not fused else None
        axis = "expert_gate_up" if fused and shards > 1 else None
        self.gate_up = expert((d, 2 * f), ("embed", axis)) if fused else None
        self.gate_up_bias = expert((2 * f,), (axis,), True) if fused and bias else None
        self.down = expert((f, d), ("expert_mlp", "embed"))
        self.down_bias = expert((d,), ("embed",), True) if bias else None

    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """x [T, D], valid [T] bool (None: every token) -> [T, D]; invalid tokens get no routed expert's
        output (the shared experts run for every token)."""
        router = self.router.get_value()
        xr = x.astype(jnp.float32) if router.dtype == jnp.float32 else x
        logits = dense(xr, router, param_value(self.router_bias)).astype(jnp.float32)           # (T, E)
        weights, experts = route(logits, self.k, self.routing, self.norm_topk, param_value(self.router_correction),
                                 self.groups, self.topk_groups, self.routed_scale, self.jitter, self.norm_eps,
                                 router.dtype if self.scores_in_dtype else None)   # (T, k)
        order, sizes = sort_rows(experts, valid, self.num_experts)                  # (R,), (E,)
        xs = x[order // self.k]                                                      # (R, D) sorted by expert
        if self.scale_inputs:   # Llama 4: each row times its weight (in x's dtype) before its expert
            xs = xs * weights.reshape(-1)[order].astype(x.dtype)[:, None]
            weights = jnp.ones_like(weights)
        impl = self.impl or default_impl()
        if impl not in IMPLS:
            raise ValueError(f"unknown MoE implementation {impl!r}; use one of {IMPLS}")
        ys = self._ffn_tiles(xs, sizes) if impl == "tiles" else self._ffn_ragged(xs, sizes)
        out = combine(ys, order, weights, valid).astype(x.dtype)
        return out if self.shared is None else out + self._shared(x)

    def _shared(self, x: jax.Array) -> jax.Array:
        y = self.shared(x)
        if self.shared_gate is None:
            return y
        g = jax.nn.sigmoid(dense(x, self.shared_gate.get_value(), None).astype(jnp.float32))
        return (g * y.astype(jnp.float32)).astype(y.dtype)

    def _activate(self, outs: list[jax.Array]) -> jax.Array:
        """The hidden rows from the gate / up side's outputs (_in_weights' order): act(gate) * up, gpt-oss's
        clamped SwiGLU, or an ungated expert's act(up)."""
        if not self.gated:
            return ACTIVATIONS[self.act](outs[0])
        y_gate, y_up = split_gate_up(outs[0], self.shards) if len(outs) == 1 else outs
        if self.limit is not None:
            return swiglu_clamped(y_gate, y_up, self.limit, self.alpha)
        return ACTIVATIONS[self.act](y_gate) * y_up

    def _in_weights(self) -> list:
        """The gate / up side: [gate_up] (fused), [gate, up] or [up] (ungated), with their biases alongside."""
        if self.gate_up is not None:
            return [(self.gate_up.get_value(), param_value(self.gate_up_bias))]
        up = (self.up.get_value(), param_value(self.up_bias))
        return [(self.gate.get_value(), param_value(self.gate_bias)), up] if self.gated else [up]

    def _expert_ffn(self, rows: jax.Array, ins: list, down: tuple) -> jax.Array:
        """One expert on rows [m, D]: ins [(operand, bias [.., N] or None)], down (operand, bias)."""
        h = self._activate([_matmul(rows, w) + (0 if b is None else b) for w, b in ins])
        return _matmul(h, down[0]) + (0 if down[1] is None else down[1])

    def _ffn_tiles(self, xs: jax.Array, sizes: jax.Array) -> jax.Array:
        """The tile loop (module docstring): xs [R, D] sorted by expert -> [R, D]."""
        r, d = xs.shape
        tile = tile_rows(r, self.num_experts)
        starts = jnp.cumsum(sizes) - sizes
        used = sizes > 0
        ids = jnp.argsort(~used, stable=True)             # the experts with rows first, in row order
        x_pad = jnp.concatenate([xs, jnp.zeros((tile, d), xs.dtype)])
        ins, down_w, down_b = self._in_weights(), self.down.get_value(), param_value(self.down_bias)

        def per_expert(u, out):
            e = ids[u]
            ins_e = [(_expert_operand(w, e, xs.dtype), None if b is None else b[e]) for w, b in ins]
            down_e = (_expert_operand(down_w, e, xs.dtype), None if down_b is None else down_b[e])

            def per_tile(i, out):
                row = starts[e] + i * tile
                y = self._expert_ffn(lax.dynamic_slice_in_dim(x_pad, row, tile), ins_e, down_e)
                return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), row, axis=0)
            return lax.fori_loop(0, (sizes[e] + tile - 1) // tile, per_tile, out)

        out = lax.fori_loop(0, jnp.sum(used), per_expert, jnp.zeros((r + tile, d), xs.dtype))
        return out[:r]

    def _ffn_ragged(self, xs: jax.Array, sizes: jax.Array) -> jax.Array:
        """jax.lax.ragged_dot over all experts at once: xs [R, D] sorted by expert -> [R, D]."""
        row_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(xs.shape[0]), side="right"),
                                 self.num_experts - 1)                              # (R,) rows past all groups: any

        def grouped(x, w, b):
            if isinstance(w, QuantizedWeight) and w.bits == 8 and w.group_size is None:   # scales on the output
                y = lax.ragged_dot(x, w.q.astype(x.dtype), sizes, precision=dot_precision(x.dtype),
                                   preferred_element_type=jnp.float32)
                y = (y * w.scales.astype(jnp.float32)[row_expert]).astype(x.dtype)
            else:
                w = dequantize(w).astype(x.dtype) if isinstance(w, QuantizedWeight) else w
                y = lax.ragged_dot(x, w, sizes, precision=dot_precision(x.dtype))
            return y if b is None else y + b[row_expert]
        outs = [grouped(xs, w, b) for w, b in self._in_weights()]
        return grouped(self._activate(outs), self.down.get_value(), param_value(self.down_bias))


def set_moe_impl(model, impl: str | None) -> None:
    """Every MoE layer of `model` runs its experts with `impl` ("tiles" | "ragged_dot" | None: default_impl)."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; use one of {IMPLS}")
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            node.impl = impl
