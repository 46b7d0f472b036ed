"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): per-input-channel scales and
the weight-clipping search, in jax.numpy, scored on every calibration token.

For a group of linears that read the same input X [T, K] (q, k, v; gate, up; o; down) the weights'
input rows are multiplied by s and the operator that produces X divides its output by s, so the
float model is unchanged while the quantizer sees W * s: salient input channels (large mean |x|)
get finer effective steps. s = s_X ** alpha / s_W ** (1 - alpha) (s_X = mean_t |X_tk|, s_W the
mean |W| of input channel k relative to its group's max: AutoAWQ's default "duo" scaling, which
also evens out the weights' rows), normalised by sqrt(max s * min s), with alpha chosen from
`n_grid` points in [0, 1) to minimise the group's output error ||X W - X Q(W * s) / s||^2; s = 1
(plain RTN) is a candidate too, so the search never does worse than RTN on the calibration set.
Each candidate is scored with its clipping searched (below), as it will be quantized.

Every error is read from the calibration set's second moments H = X^T X / T, which calibration
streams in bounded memory: ||X D||^2 / T = sum_n D[:, n]^T H D[:, n] for D = W - W_q, so the
searches see all T calibration tokens (no row sample, nothing random) at O(K^2 N) per candidate
instead of O(T K N). With H the scale of s folds in as H / (s s^T).

On the bundled model (whose activations have no large outliers: max |x| <= 5 at the inputs of q,
k, v, gate and up and <= 13 at down's) most of AWQ's gain comes from the clipping search, and how
finely it searches matters more than the scales: with clip ratios in steps of 0.05 (AutoAWQ's
n_grid = 20) AWQ removed 16% of RTN's held-out perplexity rise at w4 per channel (17% and 14% when
calibrated on the first or last 32,768 tokens of the calibration text instead of all 43,776) and
33% at w3 g128 (31%, 37%); in steps of 0.01 (clip_grid = 100, the default) 36% (24%, 27%) and 38%
(28%, 39%); steps of 0.005 gave 32% (25%, 26%) at w4 per channel: no better than 0.01, where it
levels off. A finer grid can only lower each column's calibration error (its ratios include the
coarser grid's); from 0.05 to 0.01 the held-out gain followed at w4 per channel on all three
calibration sets (the README's quantization table holds the run). It costs about twice the
quantization time (w4 per channel 25 -> 50 s on the bundled model).
Scoring q, k, v by the attention output and gate, up by the MLP output (AutoAWQ's module loss) did
not help there (11%, 26% with the coarse grid), nor did searching an asymmetric grid's two clip
ends independently (20%, 29%), nor calibrating every block on the float model's activations as
AutoAWQ does (5%, 37%).
Where s is folded (calibrate.py names the taps):
    attn_in -> q, k, v   into attn_norm (scale and bias / s)
    o_in    -> o         into v's output columns (and v_bias); with GQA, one s per KV-head channel
                         (the mean of s_X over the query heads that share it), repeated over them
    mlp_in  -> gate, up  into mlp_norm
    down_in -> down      into up's output columns (and up_bias): act(gate) * up is linear in up
A norm whose output also feeds the residual (residual_post_norm) cannot absorb a scale, nor can a
non-gated MLP's up (act(up) is not linear); those groups keep s = 1.
Clipping: for each linear, group and output column, the quantization range is shrunk to r x the
weights' (r = 1 - i / n_grid, i < max_shrink * n_grid; n_grid = clip_grid) to minimise that
group's partial output error sum_t (X_g (W_g - Q(clip_r W_g)))^2 = d_g^T H_gg d_g (H_gg: the
group's diagonal block).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import grid_codes, grid_dequant, grid_params

CLIP_GRID = 100   # clip ratios 1 - i / CLIP_GRID, i < CLIP_GRID / 2 (QuantizeSettings.awq_clip_grid)


def rtn_dequant(w: jnp.ndarray, bits: int, group_size: int, symmetric: bool) -> jnp.ndarray:
    """Round-to-nearest w [K, N] on its own group grid (groups of group_size along K) -> float [K, N]."""
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)                                 # (K/g, g, N)
    s, z = grid_params(wg, bits, symmetric, axis=1, xp=jnp)
    s, z = s[:, None, :], None if z is None else z[:, None, :]
    return grid_dequant(grid_codes(wg, s, z, bits, xp=jnp), s, z).reshape(k, n)


def output_error(h: jnp.ndarray, d: jnp.ndarray) -> jnp.ndarray:
    """h = X^T X / T [K, K], d = W - W_q [K, N] -> ||X d||_F^2 / T (the mean squared output error per row)."""
    return jnp.sum(d * jnp.dot(h, d, precision="highest"))


def _per_kv_channel(v: jnp.ndarray, kv_groups: tuple[int, int, int] | None) -> jnp.ndarray:
    """v [H * hd] -> averaged over the query heads sharing a KV head, repeated back (or v as is)."""
    if kv_groups is None:
        return v
    hkv, rep, hd = kv_groups
    return jnp.broadcast_to(v.reshape(hkv, rep, hd).mean(axis=1, keepdims=True), (hkv, rep, hd)).reshape(-1)


def search_scale(h: np.ndarray, s_x: np.ndarray, w: np.ndarray, *, bits: int, group_size: int, symmetric: bool,
                 n_grid: int = 20, clip_grid: int = CLIP_GRID, kv_groups: tuple[int, int, int] | None = None,
                 clip: bool = True) -> tuple[np.ndarray, float | None, list[float], np.ndarray]:
    """h = X^T X / T [K, K], s_x = mean_t |X_tk| [K], w [K, N] -> (s [K], best alpha or None,
    error per candidate, W * s as the best candidate rounds it: clipped when clip, [K, N]).

    Candidates: s = 1 (plain RTN; errors[0]) and, for alpha = i / n_grid (i < n_grid),
    s = s_X ** alpha / (s_W ** (1 - alpha) + 1e-4) clamped at 1e-4 and normalised by
    sqrt(max s * min s) (errors[1 + i]), s_W the mean over output columns of |W_kn| / max of |W|
    over its quantization group. Each candidate's error is ||X W - X Q(W s) / s||^2 / T, with Q the
    clipping search (search_clip over clip_grid ratios) then round-to-nearest (clip=True), or
    round-to-nearest alone. alpha is None where s = 1 won. kv_groups (n_kv_heads, heads per KV head, head_dim): K is laid out [H, hd] and
    s must be equal across the query heads sharing a KV head (so that it can fold into v): s_X and
    s_W are averaged over them."""
    h, w = jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32)
    k, n = w.shape
    s_x = _per_kv_channel(jnp.asarray(s_x, jnp.float32), kv_groups)                  # (K,)
    wg = jnp.abs(w).reshape(k // group_size, group_size, n)
    s_w = (wg / jnp.maximum(jnp.max(wg, axis=1, keepdims=True), 1e-12)).reshape(k, n).mean(axis=1)
    s_w = _per_kv_channel(s_w, kv_groups)                                            # (K,)
    errors, best = [], None
    for i in range(-1, n_grid):
        if i < 0:
            alpha, s = None, jnp.ones_like(s_x)
        else:
            alpha = i / n_grid
            s = jnp.maximum(s_x ** alpha / (s_w ** (1 - alpha) + 1e-4), 1e-4)
            s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        hs, ws = h / (s[:, None] * s[None, :]), w * s[:, None]                       # X / s, W * s
        if clip:
            ws = jnp.asarray(search_clip(hs, ws, bits=bits, group_size=group_size, symmetric=symmetric,
                                         n_grid=clip_grid))
        err = float(output_error(hs, w * s[:, None] - rtn_dequant(ws, bits, group_size, symmetric)))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, alpha, s, ws)
    return np.asarray(best[2], np.float32), best[1], errors, np.asarray(best[3], np.float32)


def search_clip(h: np.ndarray, w: np.ndarray, *, bits: int, group_size: int, symmetric: bool,
                n_grid: int = CLIP_GRID, max_shrink: float = 0.5) -> np.ndarray:
    """h = X^T X / T [K, K], w [K, N] -> w with each (group, output column) clipped to the ratio r
    of its range that minimises d_g^T H_gg d_g, d_g = w_g - Q(clip_r w_g) (r = 1 keeps it as it is)."""
    k, n = w.shape
    g = group_size
    h = jnp.asarray(h, jnp.float32)
    hb = jnp.stack([h[i * g:(i + 1) * g, i * g:(i + 1) * g] for i in range(k // g)])  # (G, g, g)
    wg = jnp.asarray(w, jnp.float32).reshape(k // g, g, n)                         # (G, g, N)
    hi, lo = jnp.max(wg, axis=1, keepdims=True), jnp.min(wg, axis=1, keepdims=True)
    amax = jnp.maximum(jnp.abs(hi), jnp.abs(lo))
    best_err = jnp.full((k // g, n), jnp.inf)
    best_w = wg
    for i in range(int(max_shrink * n_grid)):
        r = 1.0 - i / n_grid
        wc = jnp.clip(wg, -r * amax, r * amax) if symmetric else jnp.clip(wg, r * lo, r * hi)
        s, z = grid_params(wc, bits, symmetric, axis=1, xp=jnp)
        s, z = s[:, None, :], None if z is None else z[:, None, :]
        d = wg - grid_dequant(grid_codes(wc, s, z, bits, xp=jnp), s, z)           # (G, g, N)
        err = jnp.sum(d * jnp.einsum("Gij,GjN->GiN", hb, d, precision="highest"), axis=1)   # (G, N)
        better = err < best_err
        best_err = jnp.where(better, err, best_err)
        best_w = jnp.where(better[:, None, :], wc, best_w)
    return np.asarray(best_w.reshape(k, n), np.float32)
