"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): per-input-channel scales and
the weight-clipping search, in jax.numpy on sampled calibration rows.

For a group of linears that read the same input X [T, K] (q, k, v; gate, up; o; down) the weights'
input rows are multiplied by s and the operator that produces X divides its output by s, so the
float model is unchanged while the quantizer sees W * s: salient input channels (large mean |x|)
get finer effective steps. s = s_X ** alpha (s_X = mean_t |X_tk|), normalised by sqrt(max s * min s),
with alpha chosen from `n_grid` points in [0, 1] to minimise the group's output error
||X W - X Q(W * s) / s||^2 (alpha = 0 is plain RTN, so the search never does worse than it on
the sampled rows). Where s is folded (calibrate.py names the taps):
    attn_in -> q, k, v   into attn_norm (scale and bias / s)
    o_in    -> o         into v's output columns (and v_bias); with GQA, one s per KV-head channel
                         (the mean of s_X over the query heads that share it), repeated over them
    mlp_in  -> gate, up  into mlp_norm
    down_in -> down      into up's output columns (and up_bias): act(gate) * up is linear in up
A norm whose output also feeds the residual (residual_post_norm) cannot absorb a scale, nor can a
non-gated MLP's up (act(up) is not linear); those groups keep s = 1.
Clipping: for each linear, group and output column, the quantization range is shrunk to r x the
weights' (r = 1 - i / n_grid, i < max_shrink * n_grid) to minimise that group's partial output
error sum_t (X_g (W_g - Q(clip_r W_g)))^2.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.quant import grid_codes, grid_dequant, grid_params


def rtn_dequant(w: jnp.ndarray, bits: int, group_size: int, symmetric: bool) -> jnp.ndarray:
    """Round-to-nearest w [K, N] on its own group grid (groups of group_size along K) -> float [K, N]."""
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)                                 # (K/g, g, N)
    s, z = grid_params(wg, bits, symmetric, axis=1, xp=jnp)
    s, z = s[:, None, :], None if z is None else z[:, None, :]
    return grid_dequant(grid_codes(wg, s, z, bits, xp=jnp), s, z).reshape(k, n)


def output_error(x: jnp.ndarray, w: jnp.ndarray, wq: jnp.ndarray) -> float:
    """||x w - x wq||_F^2 / T: the mean squared output error per row."""
    d = jnp.dot(x, w - wq, precision="highest")
    return float(jnp.sum(d * d) / x.shape[0])


def search_scale(x: np.ndarray, w: np.ndarray, *, bits: int, group_size: int, symmetric: bool,
                 n_grid: int = 20, kv_groups: tuple[int, int, int] | None = None
                 ) -> tuple[np.ndarray, float, list[float]]:
    """x [T, K] sampled inputs, w [K, N] -> (s [K], best alpha, error per alpha).

    kv_groups (n_kv_heads, heads per KV head, head_dim): K is laid out [H, hd] and s must be equal
    across the query heads sharing a KV head (so that it can fold into v): s_X is averaged over them."""
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    s_x = jnp.mean(jnp.abs(x), axis=0)                                             # (K,)
    if kv_groups is not None:
        hkv, rep, hd = kv_groups
        s_x = jnp.broadcast_to(s_x.reshape(hkv, rep, hd).mean(axis=1, keepdims=True), (hkv, rep, hd)).reshape(-1)
    s_x = jnp.maximum(s_x, 1e-8)
    errors, best = [], (np.inf, 0.0, jnp.ones_like(s_x))
    for i in range(n_grid):
        alpha = i / (n_grid - 1)
        s = s_x ** alpha
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        wq = rtn_dequant(w * s[:, None], bits, group_size, symmetric) / s[:, None]
        err = output_error(x, w, wq)
        errors.append(err)
        if err < best[0]:
            best = (err, alpha, s)
    return np.asarray(best[2], np.float32), best[1], errors


def search_clip(x: np.ndarray, w: np.ndarray, *, bits: int, group_size: int, symmetric: bool,
                n_grid: int = 20, max_shrink: float = 0.5) -> np.ndarray:
    """x [T, K], w [K, N] -> w with each (group, output column) clipped to the ratio r of its range
    that minimises sum_t (x_g (w_g - Q(clip_r w_g)))^2 (r = 1 keeps it as it is)."""
    k, n = w.shape
    g = group_size
    xg = jnp.asarray(x, jnp.float32).reshape(x.shape[0], k // g, g)                # (T, G, g)
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
        wq = grid_dequant(grid_codes(wc, s, z, bits, xp=jnp), s, z)               # (G, g, N)
        out = jnp.einsum("tGg,GgN->tGN", xg, wg - wq, precision="highest")
        err = jnp.sum(out * out, axis=0)                                           # (G, N)
        better = err < best_err
        best_err = jnp.where(better, err, best_err)
        best_w = jnp.where(better[:, None, :], wc, best_w)
    return np.asarray(best_w.reshape(k, n), np.float32)
